"""What the shared tier's writes need (``kvtier.tiers.remote``): the write-behind queue,
where its writer reads the chunks, and this instance's share of the store that the size
cap bounds.

``WriteBehindQueue``: refs waiting to be written, drained in batches by one writer thread.
``offer`` never blocks: past ``limit`` refs waiting, the oldest is dropped (the caller
counts it). The writer thread starts with the first offer and calls ``write(batch)`` with
up to ``batch_chunks`` refs at a time, oldest first; an exception there is logged and the
writer goes on. ``sync`` waits for the queue to drain; ``close`` stops the writer.

``BehindSource``: where the writer thread reads queued chunks: host (pinned while read),
else, for a chunk that left host first, a fallback reader (the manager's write-back
queues and the tiers between host and the store).

``OwnedValues``: the values this instance wrote, least recently used first, and their
bytes; past the cap, the oldest are the victims.

Thread-safety: ``WriteBehindQueue`` is thread-safe (one condition guards the queue);
``BehindSource.encode_each`` runs on the writer thread only (its buffer is that thread's);
``OwnedValues`` is not thread-safe (the tier calls it under its lock).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence

import torch

from kvtier.kv.chunk import ChunkRef
from kvtier.kv.layout import KVLayout
from kvtier.tiers.pool import PoolTier
from kvtier.tiers.types import ChunkReader

log = logging.getLogger("kvtier.tiers.remote")


class WriteBehindQueue:
    """A bounded, drop-oldest queue of refs and the thread that writes them.

    Args:
        write: writes one batch (on the writer thread).
        limit: refs that may wait at once.
        batch_chunks: refs per ``write`` call at most.
    """

    def __init__(
        self, write: Callable[[list[ChunkRef]], None], limit: int, batch_chunks: int
    ) -> None:
        self._write, self.limit, self.batch_chunks = write, limit, batch_chunks
        self._queue: deque[ChunkRef] = deque()
        self._cond = threading.Condition()
        self._closing = False
        self._writer: threading.Thread | None = None
        self._writing = 0  # refs taken by the writer, not yet written

    def offer(self, refs: Iterable[ChunkRef]) -> int:
        """Queue refs; how many waiting ones were dropped to stay within ``limit`` (all
        of them once the queue is closed)."""
        dropped = 0
        with self._cond:
            if self._closing:
                return sum(1 for _ in refs)
            for ref in refs:
                self._queue.append(ref)
                if len(self._queue) > self.limit:
                    self._queue.popleft()
                    dropped += 1
            if self._writer is None:
                self._writer = threading.Thread(
                    target=self._loop, name="kvtier-remote-writer", daemon=True
                )
                self._writer.start()
            self._cond.notify_all()
        return dropped

    def sync(self, seconds_per_chunk: float) -> None:
        """Wait until nothing waits or is being written, at most ``seconds_per_chunk``
        for each ref waiting now (plus one)."""
        with self._cond:
            limit = seconds_per_chunk * (len(self._queue) + self._writing + 1)
            self._cond.wait_for(lambda: not self._queue and not self._writing, limit)

    def close(self, join_timeout_s: float) -> None:
        """Drop what still waits and stop the writer (waiting at most ``join_timeout_s``
        for the batch it is writing)."""
        with self._cond:
            self._closing = True
            self._queue.clear()
            self._cond.notify_all()
            writer = self._writer
        if writer is not None:
            writer.join(timeout=join_timeout_s)

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closing)
                if not self._queue:
                    return
                take = min(self.batch_chunks, len(self._queue))
                batch = [self._queue.popleft() for _ in range(take)]
                self._writing = len(batch)
            try:
                self._write(batch)
            except Exception:  # a bug here must not stop the writes that follow
                log.exception("remote tier: writing %d chunks failed", len(batch))
            finally:
                with self._cond:
                    self._writing = 0
                    self._cond.notify_all()


class BehindSource:
    """Where write-behind reads: ``host`` and ``fallback``, set by ``use`` (see the module
    docstring).

    Args:
        layout: the chunk layout (sizes the fallback's buffer).
    """

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self.host: PoolTier | None = None
        self.fallback: ChunkReader | None = None
        self._buffer: torch.Tensor | None = None

    def use(self, host: PoolTier, fallback: ChunkReader | None) -> None:
        self.host, self.fallback = host, fallback

    def encode_each(
        self, refs: Sequence[ChunkRef], encode: Callable[[ChunkRef, torch.Tensor], bytes]
    ) -> list[tuple[ChunkRef, bytes]]:
        """``(ref, encode(ref, data))`` for every ref found, in order; the data is read while
        pinned in host, or through the fallback into this object's buffer (the values are
        copies: a slot reused later cannot change them). Writer thread only."""
        host = self.host
        if host is None:
            return []
        pinned = host.pin(refs)
        try:
            values = []
            for ref, ok in zip(refs, pinned, strict=True):
                data = host.view(ref) if ok else self._read_elsewhere(ref)
                if data is not None:
                    values.append((ref, encode(ref, data)))
        finally:
            host.unpin([r for r, ok in zip(refs, pinned, strict=True) if ok])
        return values

    def _read_elsewhere(self, ref: ChunkRef) -> torch.Tensor | None:
        if self.fallback is None:
            return None
        if self._buffer is None:
            self._buffer = self.layout.empty_chunk()
        return self._buffer if self.fallback(ref, self._buffer) else None


class OwnedValues:
    """The keys of the values this instance wrote and still holds in the store, least
    recently used first, with their bytes (``nbytes``: their sum).

    Args:
        capacity_bytes: the most they may hold; past it ``record`` names victims.
    """

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.nbytes = 0
        self._sizes: OrderedDict[str, int] = OrderedDict()

    def record(self, written: list[tuple[str, int]]) -> list[str]:
        """Note values written (key, bytes) as the most recent; the least recently used
        keys to delete to stay within the cap (forgotten here already). The newest one
        always stays."""
        for key, nbytes in written:
            self.nbytes += nbytes - self._sizes.pop(key, 0)
            self._sizes[key] = nbytes
        victims = []
        while self.nbytes > self.capacity_bytes and len(self._sizes) > 1:
            key, nbytes = self._sizes.popitem(last=False)
            self.nbytes -= nbytes
            victims.append(key)
        return victims

    def touch(self, key: str) -> None:
        """A read of ``key``: it becomes the most recently used (if this instance owns it)."""
        if key in self._sizes:
            self._sizes.move_to_end(key)

    def forget(self, key: str) -> None:
        """``key`` is deleted from the store."""
        self.nbytes -= self._sizes.pop(key, 0)
