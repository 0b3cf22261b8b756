"""Write-back on eviction: a bounded queue of evicted chunks, written down on a link.

When a tier evicts a chunk the tier below lacks, its evict hook (``offer``) copies the
victim's bytes into one of a few spare chunk buffers owned by the queue and submits a drain
step to the link between the two tiers; the link's worker writes the oldest waiting chunk
into the lower tier. The evicting thread (often the compute thread, holding the upper
tier's lock) does one memory copy and never waits for the lower tier, whatever its speed.

When every buffer is taken, the oldest chunk still waiting is dropped to make room (and
counted): the newest victims are the likeliest to be reused. A dropped chunk is simply in
no tier any more, so its next user recomputes it; nothing is ever served wrong. Until its
write lands, a queued chunk counts as held by the lower tier (``holds``): the link is FIFO,
so a promotion submitted after the drain step finds it there (or finds it dropped and
reports it missing).

Invariant (under the queue's lock): drain steps submitted and not yet run >= chunks
waiting, so every waiting chunk is written or dropped by a step already on the link.

Thread-safety: every method is thread-safe. The queue's lock is taken under the upper
tier's lock (``offer`` runs in its evict hook) and is held while submitting to the link,
never while a tier lock is taken or a write runs.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable

import torch

from kvtier.kv.chunk import Chunk, ChunkRef
from kvtier.kv.keys import ChunkKey
from kvtier.kv.layout import KVLayout
from kvtier.tiers.base import Tier, TierFullError
from kvtier.tiers.disk_io import copy_bytes
from kvtier.transfer import CopyStep, Link, TransferHandle

log = logging.getLogger(__name__)


class WriteBackQueue:
    """Evicted chunks of ``upper`` waiting for ``link`` to write them into ``lower``.

    Args:
        lower: the tier the chunks are written to.
        link: the link between the upper tier and ``lower``; drain steps run on its worker.
        layout: the layout of every chunk (sizes the buffers).
        num_buffers: spare chunk buffers, allocated and touched now: the most chunks that
            wait at once. 0 drops every victim (counted).
        track: called with the handle of every drain transfer submitted (so the owner can
            wait for the writes, ``KVManager.wait_writes``).
    """

    def __init__(
        self,
        lower: Tier,
        link: Link,
        layout: KVLayout,
        num_buffers: int,
        track: Callable[[TransferHandle], object],
    ) -> None:
        self.lower = lower
        self.link = link
        self.chunk_nbytes = lower.stored_chunk_nbytes  # what crosses the link (its codec's)
        self._track = track
        self._lock = threading.Lock()
        self._free = [layout.empty_chunk().zero_() for _ in range(num_buffers)]
        self._waiting: OrderedDict[ChunkKey, tuple[ChunkRef, torch.Tensor]] = OrderedDict()
        # popped by the drain step, not landed yet (its buffer is freed after the write)
        self._writing: tuple[ChunkRef, torch.Tensor] | None = None
        self._steps = 0  # drain steps submitted and not yet run
        self.queued = 0  # victims accepted (read under the lock: ``counts``)
        self.dropped = 0  # accepted or offered victims that will never be written

    def counts(self) -> tuple[int, int]:
        """``(queued, dropped)``: victims accepted so far, and those never to be written."""
        with self._lock:
            return self.queued, self.dropped

    def holds(self, ref: ChunkRef) -> bool:
        """True while ``ref`` (these token ids) waits here or is being written down.

        Check this before ``lower.contains``: a chunk stops being held only after its write
        has landed, so one of the two sees it (unless it was dropped).
        """
        with self._lock:
            entry = self._waiting.get(ref.key)
            writing = self._writing
        if entry is not None:
            return entry[0].token_ids == ref.token_ids
        return writing is not None and writing[0] == ref

    def read_into(self, ref: ChunkRef, out: torch.Tensor) -> bool:
        """Copy ``ref``'s bytes into ``out`` if it waits here or is being written down
        (False otherwise, ``out`` untouched). For a reader that missed the chunk in the
        upper tier while its write-back has not landed (the shared tier's writer)."""
        with self._lock:
            entry = self._waiting.get(ref.key)
            if entry is None and self._writing is not None and self._writing[0].key == ref.key:
                entry = self._writing
            if entry is None or entry[0].token_ids != ref.token_ids:
                return False
            copy_bytes(out, entry[1])  # under the lock: the buffer is not freed meanwhile
        return True

    def offer(self, victim: Chunk) -> None:
        """Evict hook of the upper tier: queue ``victim`` for the lower tier if it lacks it.

        Runs under the upper tier's lock, in the evicting thread; ``victim.data`` is read
        here (one memory copy) and not kept. Never blocks on the link and never raises: a
        lower tier that takes no writes skips the chunk (its ``writes_skipped``), a full
        queue drops its oldest waiting chunk, and a link without room drops this one.
        """
        ref = victim.ref
        if self.holds(ref) or self.lower.contains(ref):
            return  # already below (or on its way): nothing to write
        if self.lower.writes_disabled:
            self.lower.count_skipped_writes(1)
            return
        with self._lock:
            buffer = self._take_buffer()
            if buffer is None:  # every buffer is being written: this victim goes
                self.dropped += 1
                return
            copy_bytes(buffer, victim.data)  # under the lock: the drain never sees half
            self._waiting[ref.key] = (ref, buffer)
            self.queued += 1
            if len(self._waiting) <= self._steps:
                return  # a drain step already on the link will take it
            handle = self.link.try_submit(
                [CopyStep(self.chunk_nbytes, range(0), self._drain_one)], 0
            )
            if handle is None:  # the link has no room now: drop rather than wait
                del self._waiting[ref.key]
                self._free.append(buffer)
                self.dropped += 1
                return
            self._steps += 1
        self._track(handle)

    def _take_buffer(self) -> torch.Tensor | None:
        """A free buffer, else the buffer of the oldest waiting chunk (dropped). Lock held."""
        if self._free:
            return self._free.pop()
        if not self._waiting:
            return None
        _, (oldest, buffer) = self._waiting.popitem(last=False)
        self.dropped += 1
        log.debug("write-back to %s: dropped %s (queue full)", self.lower.name, oldest.short())
        return buffer

    def _drain_one(self) -> None:
        """Link step: write the oldest waiting chunk into the lower tier, free its buffer."""
        with self._lock:
            self._steps -= 1
            if not self._waiting:
                return  # its chunk was dropped to make room for a newer one
            _, (ref, buffer) = self._waiting.popitem(last=False)
            self._writing = (ref, buffer)
        try:
            self.lower.put([Chunk(ref, buffer)])  # an I/O error disables its writes instead
        except TierFullError as exc:  # every slot below is pinned: recomputed if needed
            log.debug("write-back to %s: %s not written: %s", self.lower.name, ref.short(), exc)
        finally:
            with self._lock:
                self._writing = None
                self._free.append(buffer)
