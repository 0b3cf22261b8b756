"""The sequences' caches: one ``SequenceKV`` per sequence that may run, reserved at start.

Paired verbs: ``take`` a cache for an admitted sequence, ``give_back`` the cache of one that
finished or was preempted (its chunks stay in the lower tiers), ``replace`` one whose state
is unknown after an error. Used by the scheduler on the engine's worker thread only; not
thread-safe. ``all`` may be read from other threads for stats (a list copy).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from kvtier.runtime import SequenceKV


class CachePool:
    """Reserves ``size`` caches from ``new`` now: the device budget is taken at start and no
    request pays the first touch of its buffers.

    Cache ``i`` is seat ``i`` (``kvtier.runtime.SeatSlab``, when the engine has one): a
    replaced cache keeps its seat, and ``take`` hands out the lowest idle seat, so decoding
    sequences fill the slab's first rows (a decode step attends seats ``0 .. max``).

    Args:
        new: builds the (unreserved) cache of seat ``i``.
        size: caches to keep, one per sequence that may run at once.
        open_chunks: chunks one forward may seal per sequence (``SequenceKV.reserve``).
    """

    def __init__(self, new: Callable[[int], SequenceKV], size: int, open_chunks: int) -> None:
        self._new = new
        self._open_chunks = open_chunks
        self.all: list[SequenceKV] = [self._fresh(i) for i in range(size)]
        self._idle: list[int] = list(range(size))  # seats; a min-heap

    @property
    def idle(self) -> int:
        """Caches no sequence holds."""
        return len(self._idle)

    def take(self) -> SequenceKV:
        """An empty cache for an admitted sequence; the caller checked ``idle``."""
        return self.all[heapq.heappop(self._idle)]

    def give_back(self, cache: SequenceKV) -> None:
        """Keep a finished (or preempted) sequence's cache for the next one, emptied.

        The sequence's chunks are in the host tier already. The device tier is cleared, so
        it fills from slot 0 again and the next sequence's resident chunks lie end to end
        (attention reads them without a mask)."""
        cache.reset()
        cache.clear_device()
        heapq.heappush(self._idle, self.all.index(cache))

    def replace(self, cache: SequenceKV) -> None:
        """Close a cache whose state is unknown after an error; a fresh one takes its place."""
        cache.close()
        seat = self.all.index(cache)
        self.all[seat] = self._fresh(seat)
        heapq.heappush(self._idle, seat)

    def close(self) -> None:
        """Close every cache (the engine closing, after its worker has exited)."""
        for cache in self.all:
            cache.close()
        self.all, self._idle = [], []

    def _fresh(self, seat: int) -> SequenceKV:
        cache = self._new(seat)
        cache.reserve(open_chunks=self._open_chunks)
        return cache
