"""S3-FIFO (Yang et al., SOSP'23): a small FIFO that filters one-hit chunks, a main FIFO
with second chances, and a ghost FIFO that remembers what the small queue evicted.

    queue   holds                          on eviction from its head
    small   new keys (target 10 % of all)  used twice since insert (freq >= 2): to main,
                                           freq 0; else the victim, its key to ghost
    main    keys that proved reuse         freq > 0: freq - 1, back to the tail; else victim
    ghost   keys only (as many as main's   a key inserted again while in ghost goes to main
            share: 90 % of all)

As the paper's Algorithm 1 and its code (libCacheSim ``S3FIFOv0``, "the original S3FIFO
implementation used in" the paper: ``move-to-main-threshold=2``, ``ghost-size-ratio=0.90``)
have it: a key moves from small to main only if used more than once there. Uses raise a
key's ``freq`` up to 3. The policy is not told the tier's size: it takes the most keys it
has tracked at once (the tier's slot count once full) as the cache size for the 10 %
target and the ghost's length. A pinned key met at a head goes to its queue's tail (it is
in use). Every call is O(1) amortised: each step of a victim search moves a key to main
(once per insert), spends a use (once per ``touch``) or passes a pinned key.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

from kvtier.policy.eviction import EvictionPolicy, IsPinned, offered_then_next

SMALL_FRACTION = 0.1  # of the cache; main's share (and the ghost's length) is the rest
MOVE_TO_MAIN_FREQ = 2  # uses in small that earn a key its place in main
MAX_FREQ = 3


class S3FIFOPolicy(EvictionPolicy):
    """S3-FIFO over tracked keys; see the module docstring. Not thread-safe (tier lock)."""

    def __init__(self) -> None:
        self._small: OrderedDict[Hashable, None] = OrderedDict()  # oldest first
        self._main: OrderedDict[Hashable, None] = OrderedDict()
        self._ghost: OrderedDict[Hashable, None] = OrderedDict()
        self._freq: dict[Hashable, int] = {}
        self._offered: dict[Hashable, bool] = {}  # offered by victims: True if from small
        self._aside: dict[Hashable, bool] = {}  # set aside: True if it left small
        self._capacity_chunks = 0  # most keys tracked at once

    def __len__(self) -> int:
        return len(self._small) + len(self._main) + len(self._offered)

    def insert(self, key: Hashable, parent: Hashable | None = None) -> None:
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = None
        else:
            self._small[key] = None
        self._freq[key] = 0
        self._capacity_chunks = max(self._capacity_chunks, len(self))

    def touch(self, key: Hashable) -> None:
        if self._offered.pop(key, None) is not None:
            self._main[key] = None  # used while offered: it stays, as if just promoted
        self._freq[key] = min(self._freq[key] + 1, MAX_FREQ)

    def remove(self, key: Hashable) -> None:
        from_small = self._offered.pop(key, None)
        if from_small is None:
            self._small.pop(key, None)
            self._main.pop(key, None)
            self._aside.pop(key, None)
        elif from_small:
            self._ghost[key] = None
            while len(self._ghost) > max((1 - SMALL_FRACTION) * self._capacity_chunks, 1):
                self._ghost.popitem(last=False)
        self._freq.pop(key, None)

    def set_aside(self, key: Hashable) -> None:
        from_small = self._offered.pop(key, None)
        if from_small is None:
            from_small = self._small.pop(key, False) is None
            self._main.pop(key, None)
        self._aside[key] = from_small

    def readmit(self, key: Hashable) -> None:
        queue = self._small if self._aside.pop(key, False) else self._main
        self._ghost.pop(key, None)
        queue[key] = None
        queue.move_to_end(key, last=False)
        self._freq.setdefault(key, 0)

    def victims(self, count: int, is_pinned: IsPinned) -> list[Hashable]:
        return offered_then_next(self._offered, count, is_pinned, self._next_victim)

    def _next_victim(self, is_pinned: IsPinned) -> Hashable | None:
        small_first = len(self._small) >= SMALL_FRACTION * self._capacity_chunks
        for from_small in (small_first, not small_first):
            key = self._from_small(is_pinned) if from_small else self._from_main(is_pinned)
            if key is not None:
                return key
        return None

    def _from_small(self, is_pinned: IsPinned) -> Hashable | None:
        for _ in range(len(self._small)):
            key = next(iter(self._small))
            if self._freq[key] >= MOVE_TO_MAIN_FREQ:
                del self._small[key]
                self._main[key] = None
                self._freq[key] = 0
            elif is_pinned(key):
                self._small.move_to_end(key)
            else:
                del self._small[key]
                self._offered[key] = True
                return key
        return None

    def _from_main(self, is_pinned: IsPinned) -> Hashable | None:
        for _ in range((MAX_FREQ + 1) * len(self._main)):
            key = next(iter(self._main))
            if self._freq[key] > 0:
                self._freq[key] -= 1
                self._main.move_to_end(key)
            elif is_pinned(key):
                self._main.move_to_end(key)
            else:
                del self._main[key]
                self._offered[key] = False
                return key
        return None
