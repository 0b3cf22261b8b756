"""The one interface every tier implements, and the shared bookkeeping behind it.

A tier stores sealed chunks of one ``KVLayout`` in fixed-size slots, up to a byte budget.
Chunks are addressed by ``ChunkRef`` (key + token ids); a hit compares the token ids, so a
key collision reads as a miss (counted in ``stats.collisions``), never as wrong KV.

Thread-safety: every public method of ``Tier`` is thread-safe. The index (slots, pins and
eviction order: ``kvtier.tiers.index``) and the stats are guarded by one lock per tier;
the data copies of ``put`` and ``get_into`` run outside it on slots that are reserved
(put) or pinned (get), so several threads can move data through one tier at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict

import torch

from kvtier.codec import Codec, get_codec
from kvtier.kv.chunk import Chunk, ChunkRef
from kvtier.kv.keys import ChunkKey
from kvtier.kv.layout import KVLayout
from kvtier.tiers.index import ChunkIndex
from kvtier.tiers.slots import SlotStorage
from kvtier.tiers.types import (
    ChunkLostError,
    ChunkReader,
    EvictHook,
    PutResult,
    TierFullError,
    TierStats,
)

__all__ = ["ChunkLostError", "EvictHook", "PutResult", "Tier", "TierFullError", "TierStats"]

log = logging.getLogger(__name__)


class Tier(SlotStorage):
    """A store of sealed chunks in fixed-size slots with a byte budget.

    Subclasses provide slot storage (``kvtier.tiers.slots.SlotStorage``: ``_write_slot``,
    ``_read_slot``, ``_free_slot``, ``_alloc_slot``, ``_victim_data``) and may override
    the hooks ``_forget_slot`` and ``_end_put``; durable tiers register what they find at
    start with ``_restore``. This class provides the index, token-id checks, pins,
    eviction and stats, identically for every tier.

    Args:
        name: short tier name for stats and reports ("device", "host", "disk").
        layout: the KV layout of every chunk stored.
        capacity_bytes: the byte budget; the tier never holds more than
            ``capacity_bytes // layout.chunk_nbytes`` chunks.
        eviction_policy: registry name of the eviction policy.
        codec: registry name of the chunk codec its stored bytes are in
            (``kvtier.codec``); slots are ``codec.encoded_nbytes(layout)`` long, and the
            budget, ``used_bytes`` and the byte counters count those stored bytes.
    """

    takes_write_behind = False
    """True for a tier that takes every chunk host stores, whatever the write policy (the
    shared tier): the manager hands them to ``write_behind``."""

    degrade_on_io_error = False
    """True for tiers whose writes can fail on I/O (the disk): an ``OSError`` from a write
    disables further writes instead of reaching the caller; reads continue."""

    def __init__(
        self,
        name: str,
        layout: KVLayout,
        capacity_bytes: int,
        eviction_policy: str = "lru",
        codec: str = "raw",
    ) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"{name}.capacity_bytes: must be >= 0, got {capacity_bytes}")
        self.name, self.layout, self.capacity_bytes = name, layout, int(capacity_bytes)
        self.codec: Codec = get_codec(codec)
        self.stored_chunk_nbytes = self.codec.encoded_nbytes(layout)
        self.num_slots = self.capacity_bytes // self.stored_chunk_nbytes
        self._lock = threading.RLock()
        self._stats = TierStats()
        self._index = ChunkIndex(name, eviction_policy, self._stats)
        self._on_evict: EvictHook | None = None
        self._write_fault: OSError | None = None  # set: writes are disabled

    def _restore(self, ref: ChunkRef, slot: int) -> None:
        """Register a chunk already stored in ``slot`` as held, newest in eviction order.

        For tiers that find chunks at construction (before the tier is shared). The
        subclass marks ``slot`` taken in its own slot storage; this adds the index entry
        and the policy entry.
        """
        with self._lock:
            self._index.add(ref, slot, ready=True)

    # ---- public API ---------------------------------------------------------------------

    @property
    def chunk_nbytes(self) -> int:
        return self.layout.chunk_nbytes

    @property
    def used_bytes(self) -> int:
        """Bytes held, counting slots reserved by puts still in progress."""
        with self._lock:
            return self._index.num_entries * self.stored_chunk_nbytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def set_evict_hook(self, hook: EvictHook | None) -> None:
        """Install the callback that sees each victim before its slot is freed."""
        self._on_evict = hook

    @property
    def writes_disabled(self) -> bool:
        """True once an I/O error disabled writes (until ``enable_writes``)."""
        return self._write_fault is not None

    def disable_writes(self, exc: OSError) -> None:
        """Stop taking writes after the I/O error ``exc``; reads continue.

        Counts the error in ``stats.io_errors``; the first call logs it (one error line
        naming the tier and the cause), later ones only count. Thread-safe.
        """
        with self._lock:
            self._stats.io_errors += 1
            if self._write_fault is not None:
                return
            self._write_fault = exc
            self._stats.writes_disabled = 1
        log.error(
            "%s tier: writes disabled after an I/O error (%s); serving continues with the "
            "chunks it holds, and KV that would have gone here is recomputed when needed. "
            "Free space or fix the device, then restart.",
            self.name,
            exc,
        )

    def enable_writes(self) -> None:
        """Take writes again after ``disable_writes`` (e.g. once space was freed)."""
        with self._lock:
            self._write_fault = None
            self._stats.writes_disabled = 0

    def count_skipped_writes(self, num_chunks: int) -> None:
        """Count chunks not written here because writes are disabled (``writes_skipped``)."""
        with self._lock:
            self._stats.writes_skipped += num_chunks

    def write_behind(
        self, refs: Iterable[ChunkRef], source: Tier, fallback: ChunkReader | None = None
    ) -> None:
        """Queue chunks ``source`` holds to be copied here later (``takes_write_behind``
        tiers only); never blocks. A chunk that has left ``source`` by then is read
        through ``fallback`` instead (from wherever it went), if given."""
        raise NotImplementedError(f"{self.name}: takes no write-behind")

    def sync(self) -> None:
        """Make every chunk stored so far durable; a no-op for tiers that are not.

        Raises ``OSError`` from the device (the caller disables writes). Blocks.
        """
        return None

    def count_io_error(self) -> None:
        """Count a failed I/O call that did not disable writes (a read, a header erase)."""
        with self._lock:
            self._stats.io_errors += 1

    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(**asdict(self._stats))

    def refs(self) -> list[ChunkRef]:
        """Every chunk held (a snapshot)."""
        with self._lock:
            return self._index.refs()

    def contains(self, ref: ChunkRef) -> bool:
        """True if the chunk is held with exactly these token ids. Does not count as use."""
        with self._lock:
            return self._index.contains(ref)

    def contains_many(self, refs: Sequence[ChunkRef]) -> list[bool]:
        """``contains`` of each ref (the shared tier asks for them all in one round trip)."""
        return [self.contains(r) for r in refs]

    def read_ahead(self, refs: Sequence[ChunkRef]) -> None:
        """Hint: these chunks are read next, in this order (the shared tier starts some)."""
        return None

    def pin(self, refs: Iterable[ChunkRef]) -> list[bool]:
        """Pin chunks so eviction skips them; False for each chunk not held. Pins nest."""
        with self._lock:
            return self._index.pin(refs)

    def unpin(self, refs: Iterable[ChunkRef]) -> None:
        """Undo one ``pin`` per chunk. Unpinning a chunk that is not pinned is an error."""
        with self._lock:
            self._index.unpin(refs)

    def count_reads(self, hits: int, nbytes: int) -> None:
        """Record reads served straight from a pinned slot view (not via ``get_into``)."""
        with self._lock:
            self._stats.hits += hits
            self._stats.bytes_out += nbytes

    def is_pinned(self, key: ChunkKey) -> bool:
        with self._lock:
            return self._index.is_pinned(key)

    def put(self, chunks: Sequence[Chunk]) -> PutResult:
        """Copy sealed chunks in, evicting unpinned chunks (policy order) to make room.

        The caller keeps ownership of every ``chunk.data``. Chunks already held are left as
        they are (sealed chunks never change). Blocks for the copies, then runs
        ``_end_put`` (also when it raises). A tier that ``degrade_on_io_error`` never
        raises ``OSError`` here: the first one disables its writes (``disable_writes``),
        and this and later calls skip the chunks they were given (``stats.writes_skipped``).

        Raises:
            TierFullError: a slot is needed and every held chunk is pinned (the chunks
                before the failing one are stored).
        """
        result = PutResult()
        try:
            for i, chunk in enumerate(chunks):
                if self._write_fault is not None:
                    with self._lock:
                        self._stats.writes_skipped += len(chunks) - i
                    break
                slot = self._reserve(chunk.ref, result)
                if slot is None:
                    continue
                start = time.perf_counter()
                try:
                    self._write_slot(slot, chunk)
                except BaseException as exc:
                    with self._lock:
                        self._drop(chunk.key)
                    if isinstance(exc, OSError) and self.degrade_on_io_error:
                        self.disable_writes(exc)
                        continue  # counts the rest as skipped
                    raise
                elapsed = time.perf_counter() - start
                with self._lock:
                    self._index.mark_ready(chunk.key, slot)
                    self._stats.puts += 1
                    self._stats.bytes_in += self.stored_chunk_nbytes
                    self._stats.put_seconds += elapsed
                result.stored.append(chunk.key)
        finally:
            self._end_put()
        return result

    def get_into(
        self, refs: Sequence[ChunkRef], outs: Sequence[torch.Tensor], *, as_use: bool = True
    ) -> list[bool]:
        """Copy held chunks into caller-owned buffers.

        A miss (key not held, or other token ids) leaves its buffer untouched. A hit counts
        as a use for eviction and in ``stats.hits`` unless ``as_use=False`` (a copy between
        tiers, e.g. write-through, which must not keep a chunk resident). A chunk found
        corrupt is dropped, counted in ``stats.corrupt_dropped`` and reads as a miss, but its
        buffer may be left partly written: tiers that verify while they copy (the disk tier)
        have written part of the chunk before the check fails. Blocks for the copies.
        """
        if len(refs) != len(outs):
            raise ValueError(f"get_into: {len(refs)} refs but {len(outs)} output buffers")
        found = []
        for ref, out in zip(refs, outs, strict=True):
            with self._lock:
                entry = self._index.match(ref)
                if entry is None:
                    self._stats.misses += as_use
                    found.append(False)
                    continue
                entry.pins += 1
                if as_use:
                    self._index.policy.touch(ref.key)
            start = time.perf_counter()
            try:
                ok = self._read_slot(entry.slot, ref, out)
            finally:
                with self._lock:
                    entry.pins -= 1
            elapsed = time.perf_counter() - start
            with self._lock:
                if ok:
                    if as_use:
                        self._stats.hits += 1
                        self._stats.bytes_out += self.stored_chunk_nbytes
                        self._stats.get_seconds += elapsed
                else:
                    self._stats.corrupt_dropped += 1
                    self._stats.misses += 1
                    if entry.pins == 0 and self._index.get(ref.key) is entry:
                        self._drop(ref.key)
            found.append(ok)
        return found

    def read(self, ref: ChunkRef, out: torch.Tensor, *, as_use: bool = True) -> str:
        """``get_into`` of one chunk that says why it missed: ``"ok"``; ``"missing"`` (not
        held, or other token ids); ``"corrupt"`` (held, failed its checks, dropped)."""
        held = self.contains(ref)
        ok = self.get_into([ref], [out], as_use=as_use)[0]
        return "ok" if ok else "corrupt" if held else "missing"

    def remove(self, refs: Iterable[ChunkRef]) -> int:
        """Drop unpinned chunks; returns how many were dropped (pinned ones stay)."""
        dropped = 0
        with self._lock:
            for ref in refs:
                entry = self._index.match(ref)
                if entry is not None and entry.pins == 0:
                    self._drop(ref.key)
                    dropped += 1
        return dropped

    def clear(self) -> None:
        """Drop every unpinned chunk (no evict hook: nothing is written back)."""
        with self._lock:
            for key in self._index.evictable_keys():
                self._drop(key)

    def close(self) -> None:
        """Release resources; the tier must not be used afterwards."""
        return None

    # ---- internals ----------------------------------------------------------------------

    def _reserve(self, ref: ChunkRef, result: PutResult) -> int | None:
        """Reserve a slot for ``ref`` (evicting if needed); None if it is already held."""
        with self._lock:
            existing = self._index.get(ref.key)
            if existing is not None:
                if existing.ref.token_ids != ref.token_ids:
                    # A colliding key: keep the first chunk; the newcomer is not stored.
                    self._stats.collisions += 1
                self._stats.duplicate_puts += 1
                result.already_present.append(ref.key)
                return None
            slot = self._alloc_slot()
            while slot is None:
                victim = self._index.victim()
                if victim is None:
                    raise TierFullError(
                        f"{self.name}: all {self.num_slots} slots are pinned or in use; "
                        f"unpin chunks or raise the {self.name} capacity"
                    )
                if self._on_evict is not None:
                    data = self._victim_data(victim.slot)
                    if data is None:
                        self._stats.corrupt_dropped += 1
                        log.warning(
                            "%s: victim %s is corrupt; not written back",
                            self.name,
                            victim.ref.short(),
                        )
                    else:
                        self._on_evict(Chunk(victim.ref, data))
                self._drop(victim.ref.key)
                self._stats.evictions += 1
                result.evicted.append(victim.ref)
                slot = self._alloc_slot()
            self._index.add(ref, slot, ready=False)
            return slot

    def _drop(self, key: ChunkKey) -> None:
        entry = self._index.remove(key)
        self._forget_slot(entry.slot)
        self._free_slot(entry.slot)
