"""Eviction policies: which unpinned chunk leaves a full tier first.

A policy only orders keys; the tier owns the data, the pins and the lock. Policies are not
thread-safe on their own: every call happens under the owning tier's lock.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator


class EvictionPolicy(ABC):
    """Orders resident keys for eviction.

    Contract: ``insert`` adds a key that is not tracked, ``touch`` records a use of a
    tracked key, ``remove`` forgets a tracked key, and ``candidates`` yields tracked keys
    best-victim first. None of them blocks; none is thread-safe (the tier locks).
    """

    @abstractmethod
    def insert(self, key: Hashable) -> None: ...

    @abstractmethod
    def touch(self, key: Hashable) -> None: ...

    @abstractmethod
    def remove(self, key: Hashable) -> None: ...

    @abstractmethod
    def candidates(self) -> Iterator[Hashable]:
        """Tracked keys, best victim first. The caller must not mutate while iterating."""

    def victims(self, count: int, is_pinned: Callable[[Hashable], bool]) -> list[Hashable]:
        """Up to ``count`` unpinned keys in eviction order (fewer if too many are pinned)."""
        chosen: list[Hashable] = []
        for key in self.candidates():
            if len(chosen) == count:
                break
            if not is_pinned(key):
                chosen.append(key)
        return chosen

    @abstractmethod
    def __len__(self) -> int: ...


class LRUPolicy(EvictionPolicy):
    """Least recently used first."""

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def insert(self, key: Hashable) -> None:
        self._order[key] = None

    def touch(self, key: Hashable) -> None:
        self._order.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def candidates(self) -> Iterator[Hashable]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)


class FIFOPolicy(LRUPolicy):
    """First in, first out: uses do not refresh a key (cheap, scan-resistant baseline)."""

    def touch(self, key: Hashable) -> None:
        return None


EVICTION_POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LRUPolicy,
    "fifo": FIFOPolicy,
}


def make_policy(name: str) -> EvictionPolicy:
    """A new policy by registry name; ``ValueError`` names the accepted values."""
    try:
        return EVICTION_POLICIES[name]()
    except KeyError:
        raise ValueError(
            f"eviction_policy: unknown policy {name!r}; accepted: {sorted(EVICTION_POLICIES)}"
        ) from None
