"""The prefix-aware rule: a chunk whose children are held is not evicted before them.

A chunk is only reusable behind its whole prefix (lookups stop at the first chunk
missing), so evicting a parent first strands its children: they fill slots no lookup can
reach. ``PrefixAwarePolicy`` wraps any base policy and keeps its order among the chunks
that have no held child (the leaves):

    state        in the base policy  how it gets there
    leaf         yes                 insert; its last held child leaves
    set aside    kept apart          the base reached it as a victim while it had a child
                                     (``base.set_aside``: it remembers where it stood)
    (back)       yes, next victim    its last held child leaves, or it is used:
                                     ``base.readmit`` (S3-FIFO and ARC put it back in the
                                     queue it left, so its eviction still feeds the ghosts)

So a sequence is evicted from its tail up, once the base policy's order reaches its
first chunk, and a parent set aside goes right after its last child. Only if every leaf is
pinned does a set-aside parent go (a full tier must still make room: stranded children
cost recompute, a failed put costs an error). Each key is set aside at most once per child
that leaves, so every call stays O(1) amortised on top of the base policy's cost.
``victims(count)`` offers leaves only (as a tier asks: one at a time, then removes it);
a parent is offered once its children were removed.
"""

from __future__ import annotations

from collections.abc import Hashable

from kvtier.policy.eviction import EvictionPolicy, IsPinned


class PrefixAwarePolicy(EvictionPolicy):
    """The prefix-aware rule over ``base``; see the module docstring. Not thread-safe.

    Args:
        base: the policy that orders the leaves (owned by this wrapper from now on).
    """

    def __init__(self, base: EvictionPolicy) -> None:
        self.base = base
        self._parent: dict[Hashable, Hashable] = {}  # tracked key -> its parent's key
        self._children: dict[Hashable, int] = {}  # key -> tracked keys naming it as parent
        self._aside: dict[Hashable, None] = {}  # tracked, out of the base, children held

    def __len__(self) -> int:
        return len(self.base) + len(self._aside)

    def held_children(self, key: Hashable) -> int:
        """How many tracked keys name ``key`` as their parent."""
        return self._children.get(key, 0)

    def insert(self, key: Hashable, parent: Hashable | None = None) -> None:
        if parent is not None:
            self._parent[key] = parent
            self._children[parent] = self._children.get(parent, 0) + 1
        self.base.insert(key, parent)

    def touch(self, key: Hashable) -> None:
        if key in self._aside:  # used again: back into the order, then the use
            del self._aside[key]
            self.base.readmit(key)
        self.base.touch(key)

    def remove(self, key: Hashable) -> None:
        self._aside.pop(key, None)
        self.base.remove(key)
        parent = self._parent.pop(key, None)
        if parent is None:
            return
        left = self._children[parent] - 1
        if left:
            self._children[parent] = left
            return
        del self._children[parent]
        if parent in self._aside:  # its eviction was due: it goes next
            del self._aside[parent]
            self.base.readmit(parent)

    def set_aside(self, key: Hashable) -> None:
        self.base.set_aside(key)

    def readmit(self, key: Hashable) -> None:
        self.base.readmit(key)

    def victims(self, count: int, is_pinned: IsPinned) -> list[Hashable]:
        parents: dict[Hashable, None] = {}

        def held_back(key: Hashable) -> bool:
            if self._children.get(key, 0):
                parents[key] = None
                return True
            return is_pinned(key)

        chosen = self.base.victims(count, held_back)
        for key in parents:
            self.base.set_aside(key)
            self._aside[key] = None
        if chosen:  # a parent becomes a victim once its children were removed
            return chosen
        for key in self._aside:  # every leaf is pinned
            if len(chosen) == count:
                break
            if not is_pinned(key):
                chosen.append(key)
        return chosen
