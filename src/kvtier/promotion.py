"""Promotion up the stack: chunks held below host copied into host, on the links of the
hops above them (``KVManager.prefetch_to_host`` and ``KVManager.promote``).

Each copy is a ``kvtier.moves.Move`` from the tier holding the chunk into host, run on the
link of the hop just above that tier; a chunk that host holds by the time its step runs
is skipped on the link (``Move.landed``), unpaced. Prefetches go one transfer per chunk,
so a full link refuses only the rest, and a chunk whose prefetch is still in flight is
not submitted again.

Thread-safety: thread-safe (the links and tiers lock themselves; the in-flight map has a
lock, never held while another is taken).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from kvtier.kv.chunk import ChunkRef
from kvtier.kv.keys import ChunkKey
from kvtier.moves import Hop, Move, outcome_into
from kvtier.tiers.base import Tier
from kvtier.transfer import CopyStep, TransferHandle


class Promotions:
    """Promotes chunks into ``host`` through ``hops``.

    Args:
        host: the tier promotions land in.
        hops: the stack's hops, top first (hop ``i`` joins tier ``i`` and ``i + 1``).
        levels: where each chunk is (the index of the fastest tier holding it, or None).
        track: registers a submitted transfer with its owner (waited for at flush).
        on_corrupt: called once for each chunk found corrupt where it was held.
    """

    def __init__(
        self,
        host: Tier,
        hops: Sequence[Hop],
        levels: Callable[[Sequence[ChunkRef]], list[int | None]],
        track: Callable[[TransferHandle], TransferHandle],
        on_corrupt: Callable[[], None],
    ) -> None:
        self.host, self.hops = host, hops
        self._levels, self._track, self._on_corrupt = levels, track, on_corrupt
        self._lock = threading.Lock()
        self._prefetching: dict[ChunkKey, TransferHandle] = {}  # prefetches in flight

    def steps(
        self, refs: Sequence[ChunkRef], outcomes: list[str] | None
    ) -> dict[int, list[CopyStep]]:
        """Moves into host for every ref held below it, grouped by the hop whose link
        runs them (the one just above the tier holding the chunk); each tells
        ``outcomes[i]`` where chunk ``i`` stands when it has run (None: nobody asks).
        Each lower tier is told the order its chunks will be read in (``read_ahead``)."""
        by_hop: dict[int, list[CopyStep]] = {}
        order: dict[int, list[ChunkRef]] = {}
        for i, (ref, level) in enumerate(zip(refs, self._levels(refs), strict=True)):
            if level is None or level == 0:
                continue
            hop = self.hops[level - 1]
            outcome = outcome_into(outcomes, i) if outcomes is not None else None
            move = Move(
                hop, ref, hop.lower, self.host, outcome=outcome, on_corrupt=self._on_corrupt
            )
            step = CopyStep(hop.lower.stored_chunk_nbytes, range(0), move, skip=move.landed)
            by_hop.setdefault(level - 1, []).append(step)
            order.setdefault(level - 1, []).append(ref)
        for index, planned in order.items():
            self.hops[index].lower.read_ahead(planned)
        return by_hop

    def prefetch(
        self, refs: Sequence[ChunkRef], wait_for_room: bool = True
    ) -> list[TransferHandle]:
        """Start promoting chunks held below host into host, one transfer each, in the
        order given, on their links.

        Skips chunks host holds and those whose prefetch is still in flight. Blocks only
        for link back-pressure; with ``wait_for_room=False`` never blocks, and stops at the
        first chunk its link has no room for. Returns the transfers started.
        """
        with self._lock:
            seen = dict(self._prefetching)
        live = {key: handle for key, handle in seen.items() if not handle.done()}
        todo = [r for r in refs if r.key not in live]
        started: list[TransferHandle] = []
        for index, steps in self.steps(todo, None).items():
            link = self.hops[index].link
            for step in steps:
                handle = link.submit([step], 0) if wait_for_room else link.try_submit([step], 0)
                if handle is None:
                    break
                move = step.run
                assert isinstance(move, Move)
                live[move.ref.key] = handle
                started.append(self._track(handle))
        with self._lock:  # a concurrent call's entries may be lost: a duplicate is skipped
            self._prefetching = live
        return started

    def promote(self, refs: Sequence[ChunkRef]) -> list[str]:
        """Bring chunks into host (from the tier below holding each) and say where each
        one stands.

        Blocks until the promotions have landed (and for link back-pressure). Mutates host
        (promoted chunks, evictions) and the lower tiers (a chunk found corrupt is dropped).

        Returns:
            For each ref: ``"host"`` (host holds it now; pin it before it can be evicted
            again), ``"corrupt"`` (its stored copy failed its checks) or ``"missing"`` (in
            no tier, unreadable, dropped from a write-back queue, or no host slot free).
        """
        outcomes = ["host" if self.host.contains(r) else "missing" for r in refs]
        handles = [
            self._track(self.hops[index].link.submit(steps, num_layers=0))
            for index, steps in self.steps(refs, outcomes).items()
        ]
        for handle in handles:
            handle.wait()
        return outcomes
