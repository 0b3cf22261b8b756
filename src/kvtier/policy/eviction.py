"""Eviction policies: which unpinned chunk leaves a full tier first.

A policy only orders keys; the tier owns the data, the pins and the lock. Policies are not
thread-safe on their own: every call happens under the owning tier's lock. This module
holds the interface and the two history-free policies (LRU, FIFO); S3-FIFO
(``kvtier.policy.s3fifo``), ARC (``kvtier.policy.arc``) and the prefix-aware rule
(``kvtier.policy.prefix``) sit beside it, and ``kvtier.policy.registry`` names them all.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator

IsPinned = Callable[[Hashable], bool]
"""Whether a tracked key must not be offered as a victim now (pinned, or held back)."""


def offered_then_next(
    offered: Iterable[Hashable],
    count: int,
    is_pinned: IsPinned,
    next_victim: Callable[[IsPinned], Hashable | None],
) -> list[Hashable]:
    """``victims`` of a policy that moves each key it offers out of its queues: the unpinned
    keys already offered and not yet removed first, then ``next_victim`` until ``count``
    or none is left (S3-FIFO, ARC)."""
    chosen = [k for k in offered if not is_pinned(k)][:count]
    while len(chosen) < count:
        key = next_victim(is_pinned)
        if key is None:
            break
        chosen.append(key)
    return chosen


class EvictionPolicy(ABC):
    """Orders resident keys for eviction.

    Contract (every call O(1) amortised unless it says otherwise; none blocks; none is
    thread-safe: the tier calls them under its lock):

    - ``insert(key, parent)`` adds a key that is not tracked; ``parent`` is the key of the
      chunk before it in its sequence (None for a sequence's first chunk, or unknown).
    - ``touch`` records a use of a tracked key.
    - ``victims(count, is_pinned)`` returns up to ``count`` tracked keys to evict, best
      first, none for which ``is_pinned`` is true; it does not stop tracking them (the
      caller ``remove``s those it evicts) but may reorder its queues while it looks.
    - ``remove`` forgets a tracked key. Policies with history (ghost lists) remember a key
      removed after ``victims`` offered it; a key removed otherwise leaves no trace.
    - ``set_aside`` stops offering a tracked key (nor counting it in ``len``), keeping
      where it stood; ``readmit`` brings it back there as (one of) the next victims, and
      ``remove`` forgets it for good. ``kvtier.policy.prefix`` sets aside a parent the
      base offered too early and readmits it once its last child has left.
    """

    @abstractmethod
    def insert(self, key: Hashable, parent: Hashable | None = None) -> None: ...

    @abstractmethod
    def touch(self, key: Hashable) -> None: ...

    @abstractmethod
    def remove(self, key: Hashable) -> None: ...

    def set_aside(self, key: Hashable) -> None:
        self.remove(key)

    @abstractmethod
    def readmit(self, key: Hashable) -> None: ...

    @abstractmethod
    def victims(self, count: int, is_pinned: IsPinned) -> list[Hashable]:
        """Up to ``count`` unpinned keys in eviction order (fewer if too many are pinned)."""

    @abstractmethod
    def __len__(self) -> int: ...


class LRUPolicy(EvictionPolicy):
    """Least recently used first. ``victims`` scans past pinned keys (O(pinned))."""

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()  # oldest first

    def insert(self, key: Hashable, parent: Hashable | None = None) -> None:
        self._order[key] = None

    def touch(self, key: Hashable) -> None:
        self._order.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def readmit(self, key: Hashable) -> None:
        self._order[key] = None
        self._order.move_to_end(key, last=False)

    def candidates(self) -> Iterator[Hashable]:
        """Tracked keys, best victim first. The caller must not mutate while iterating."""
        return iter(self._order)

    def victims(self, count: int, is_pinned: IsPinned) -> list[Hashable]:
        chosen: list[Hashable] = []
        for key in self.candidates():
            if len(chosen) == count:
                break
            if not is_pinned(key):
                chosen.append(key)
        return chosen

    def __len__(self) -> int:
        return len(self._order)


class FIFOPolicy(LRUPolicy):
    """First in, first out: uses do not refresh a key (cheap, scan-resistant baseline)."""

    def touch(self, key: Hashable) -> None:
        return None
