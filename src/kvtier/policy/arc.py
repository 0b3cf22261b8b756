"""ARC, the adaptive replacement cache (Megiddo & Modha, FAST'03).

    list  holds                           role
    t1    keys used once since admission  recency
    t2    keys used at least twice        frequency
    b1    keys evicted from t1 (ghosts)   a hit here grows p (favour recency)
    b2    keys evicted from t2 (ghosts)   a hit here shrinks p (favour frequency)

A victim comes from t1's LRU end while ``len(t1) > p`` (else from t2's). ARC's tie rule
(take t1 when ``len(t1) == p`` and the missed key is in b2) needs the incoming key, which a
tier names only after it has made room, so it is left out. The cache size ``c`` is the most
keys tracked at once (the tier's slot count once full); ghosts are trimmed to
``len(t1) + len(b1) <= c`` and ``len(all four) <= 2c``. A pinned key met at an LRU end
goes to its list's MRU end (it is in use). Every call is O(1) amortised.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

from kvtier.policy.eviction import EvictionPolicy, IsPinned, offered_then_next


class ARCPolicy(EvictionPolicy):
    """ARC over tracked keys; see the module docstring. Not thread-safe (tier lock)."""

    def __init__(self) -> None:
        self._t1: OrderedDict[Hashable, None] = OrderedDict()  # LRU first
        self._t2: OrderedDict[Hashable, None] = OrderedDict()
        self._b1: OrderedDict[Hashable, None] = OrderedDict()
        self._b2: OrderedDict[Hashable, None] = OrderedDict()
        self._offered: dict[Hashable, bool] = {}  # offered by victims: True if from t1
        self._aside: dict[Hashable, bool] = {}  # set aside: True if it left t1
        self.p = 0.0  # target length of t1, in keys
        self._capacity_chunks = 0

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2) + len(self._offered)

    def insert(self, key: Hashable, parent: Hashable | None = None) -> None:
        c = max(self._capacity_chunks, len(self) + 1)
        if key in self._b1:
            self.p = min(float(c), self.p + max(len(self._b2) / len(self._b1), 1.0))
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            self.p = max(0.0, self.p - max(len(self._b1) / len(self._b2), 1.0))
            del self._b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None
        self._capacity_chunks = max(self._capacity_chunks, len(self))
        self._trim_ghosts()

    def touch(self, key: Hashable) -> None:
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        elif key in self._t2:
            self._t2.move_to_end(key)
        elif self._offered.pop(key, None) is not None:
            self._t2[key] = None  # used while offered: it stays

    def remove(self, key: Hashable) -> None:
        from_t1 = self._offered.pop(key, None)
        if from_t1 is None:
            self._t1.pop(key, None)
            self._t2.pop(key, None)
            self._aside.pop(key, None)
            return
        (self._b1 if from_t1 else self._b2)[key] = None
        self._trim_ghosts()

    def set_aside(self, key: Hashable) -> None:
        from_t1 = self._offered.pop(key, None)
        if from_t1 is None:
            from_t1 = self._t1.pop(key, False) is None
            self._t2.pop(key, None)
        self._aside[key] = from_t1

    def readmit(self, key: Hashable) -> None:
        queue = self._t2 if self._aside.pop(key, True) is False else self._t1
        self._b1.pop(key, None)
        self._b2.pop(key, None)
        queue[key] = None
        queue.move_to_end(key, last=False)

    def victims(self, count: int, is_pinned: IsPinned) -> list[Hashable]:
        return offered_then_next(self._offered, count, is_pinned, self._replace)

    def _replace(self, is_pinned: IsPinned) -> Hashable | None:
        from_t1 = bool(self._t1) and (len(self._t1) > self.p or not self._t2)
        for source in (from_t1, not from_t1):
            queue = self._t1 if source else self._t2
            for _ in range(len(queue)):
                key = next(iter(queue))
                if is_pinned(key):
                    queue.move_to_end(key)
                    continue
                del queue[key]
                self._offered[key] = source
                return key
        return None

    def _trim_ghosts(self) -> None:
        c = max(self._capacity_chunks, 1)
        while self._b1 and len(self._t1) + len(self._b1) > c:
            self._b1.popitem(last=False)
        while self._b2 and len(self) + len(self._b1) + len(self._b2) > 2 * c:
            self._b2.popitem(last=False)
