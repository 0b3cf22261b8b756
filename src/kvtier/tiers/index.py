"""A tier's index: which chunk is in which slot, its pins, and the eviction order.

``ChunkIndex`` is the bookkeeping half of ``kvtier.tiers.base.Tier`` (the other half moves
the bytes). It maps keys to entries (the ref with its token ids, the slot, a pin count, and
whether the slot's copy has finished) and keeps the eviction policy in step with them.

Not thread-safe: the owning tier calls every method under its lock. It mutates only its
own entries, its policy, and the ``collisions`` counter of the stats it was given.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass

from kvtier.kv.chunk import ChunkRef
from kvtier.kv.keys import ChunkKey
from kvtier.policy import EvictionPolicy, make_policy
from kvtier.tiers.types import TierStats


@dataclass
class Entry:
    """One chunk of a tier: valid while the tier's lock is held (or the chunk is pinned)."""

    ref: ChunkRef
    slot: int
    pins: int = 0
    ready: bool = True  # False while a put is still copying into the slot


class ChunkIndex:
    """Entries by key plus the eviction order over the ready ones.

    Args:
        tier_name: for error messages.
        eviction_policy: registry name of the eviction policy.
        stats: the tier's counters (``collisions`` is counted here).
    """

    def __init__(self, tier_name: str, eviction_policy: str, stats: TierStats) -> None:
        self.tier_name = tier_name
        self.policy: EvictionPolicy = make_policy(eviction_policy)
        self._entries: dict[ChunkKey, Entry] = {}
        self._stats = stats

    @property
    def num_entries(self) -> int:
        """Entries, counting slots reserved by puts still copying."""
        return len(self._entries)

    def __len__(self) -> int:
        return sum(1 for e in self._entries.values() if e.ready)

    def get(self, key: ChunkKey) -> Entry | None:
        """The entry of ``key``, ready or not."""
        return self._entries.get(key)

    def match(self, ref: ChunkRef) -> Entry | None:
        """The ready entry for ``ref`` if its token ids match; a mismatch is a collision."""
        entry = self._entries.get(ref.key)
        if entry is None or not entry.ready:
            return None
        if entry.ref.token_ids != ref.token_ids:
            self._stats.collisions += 1
            return None
        return entry

    def contains(self, ref: ChunkRef) -> bool:
        """Held and ready with exactly these token ids (no collision counted)."""
        entry = self._entries.get(ref.key)
        return entry is not None and entry.ready and entry.ref.token_ids == ref.token_ids

    def refs(self) -> list[ChunkRef]:
        return [e.ref for e in self._entries.values() if e.ready]

    def add(self, ref: ChunkRef, slot: int, ready: bool) -> Entry:
        """A new entry; a ready one joins the eviction order now, others on ``mark_ready``."""
        if ref.key in self._entries:
            raise ValueError(f"{self.tier_name}: chunk {ref.short()} indexed twice")
        entry = self._entries[ref.key] = Entry(ref=ref, slot=slot, ready=ready)
        if ready:
            self.policy.insert(ref.key, ref.parent)
        return entry

    def mark_ready(self, key: ChunkKey, slot: int) -> None:
        """The copy into ``slot`` finished: its entry (if still that slot's) is evictable."""
        entry = self._entries.get(key)
        if entry is not None and entry.slot == slot and not entry.ready:
            entry.ready = True
            self.policy.insert(key, entry.ref.parent)

    def pin(self, refs: Iterable[ChunkRef]) -> list[bool]:
        """Pin each held chunk once more; False for each chunk not held."""
        out = []
        for ref in refs:
            entry = self.match(ref)
            if entry is not None:
                entry.pins += 1
            out.append(entry is not None)
        return out

    def unpin(self, refs: Iterable[ChunkRef]) -> None:
        """Undo one pin per chunk. Raises ``RuntimeError`` for a chunk not pinned."""
        for ref in refs:
            entry = self._entries.get(ref.key)
            if entry is None or entry.pins == 0:
                raise RuntimeError(f"{self.tier_name}: unpin of chunk {ref.short()} not pinned")
            entry.pins -= 1

    def is_pinned(self, key: ChunkKey) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.pins > 0

    def victim(self) -> Entry | None:
        """The unpinned ready entry to evict first, or None when every one is pinned."""
        victims = self.policy.victims(1, self._key_pinned)
        return self._entries[victims[0]] if victims else None  # type: ignore[index]

    def evictable_keys(self) -> list[ChunkKey]:
        """Keys of every ready, unpinned entry."""
        return [k for k, e in self._entries.items() if e.ready and e.pins == 0]

    def remove(self, key: ChunkKey) -> Entry:
        """Forget an entry (ready or reserved) and its place in the eviction order."""
        entry = self._entries.pop(key)
        if entry.ready:
            self.policy.remove(key)
        return entry

    def _key_pinned(self, key: Hashable) -> bool:
        return self._entries[key].pins > 0  # type: ignore[index]
