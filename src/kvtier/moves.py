"""How bytes move between adjacent tiers: the hop (two tiers and their link) and its step.

``kvtier.manager.KVManager`` keeps the books (where every chunk is, the counters); a
``Hop`` joins tier ``i`` to tier ``i + 1`` through one ``Link`` and owns that link's
write-back queue and staging buffer. Every copy between tiers is one ``Move`` run on the
worker of a hop's link, whatever the kinds of the tiers: a promotion (a lower tier into
host), a write-through or a save at close (a tier into the one below). Write-back on
eviction goes through the hop's ``WriteBackQueue``. No step raises to its caller: a tier
that takes no writes, or whose slots are all pinned, just does not take the chunk.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvtier.kv.chunk import Chunk, ChunkRef
from kvtier.kv.layout import KVLayout
from kvtier.tiers.base import Tier, TierFullError
from kvtier.transfer import Link
from kvtier.writeback import WriteBackQueue

log = logging.getLogger(__name__)


@dataclass
class Hop:
    """Tier ``upper`` above tier ``lower``, the link between them and what it owns.

    Attributes:
        upper: the faster tier (its evict hook is ``queue.offer``).
        lower: the slower tier.
        link: runs every copy between the two, in submission order, on its worker.
        queue: chunks evicted from ``upper`` waiting to be written into ``lower``.
        layout: the chunk layout (sizes the staging buffer).
    """

    upper: Tier
    lower: Tier
    link: Link
    queue: WriteBackQueue
    layout: KVLayout
    _staging: torch.Tensor | None = field(default=None, repr=False)

    def holds_many(self, refs: Sequence[ChunkRef]) -> list[bool]:
        """For each ref: True if ``lower`` holds it or it is queued to be written there
        (``lower`` is asked once, for those not queued)."""
        queued = [self.queue.holds(r) for r in refs]
        asked = iter(
            self.lower.contains_many([r for r, q in zip(refs, queued, strict=True) if not q])
        )
        return [q or next(asked) for q in queued]

    @property
    def staging(self) -> torch.Tensor:
        """One chunk buffer that only the link's worker uses (made on first use)."""
        if self._staging is None:
            self._staging = self.layout.empty_chunk().zero_()
        return self._staging


Outcome = Callable[[str], None]
"""Told where a moved chunk stands: the target's name, ``"corrupt"`` or ``"missing"``."""


class Move:
    """Link step: copy one chunk from ``source`` into ``target`` through the hop's staging.

    Runs on ``hop.link``'s worker. The chunk is read with ``get_into`` (counted as a use of
    the source only when ``as_use``: a promotion is a read, a copy down is not) and put
    into ``target``, where it may evict (whose write-back queues on a link without
    waiting). Reports the outcome to ``outcome``: the target's name once it holds the
    chunk; ``"corrupt"`` if the source held it and its bytes failed their checks (the
    source drops it and ``on_corrupt`` is called); ``"missing"`` if the source did not
    hold it or the target had no unpinned slot.

    Args:
        hop: the hop whose link runs the step (and whose staging buffer it uses).
        ref: the chunk.
        source: the tier read from.
        target: the tier written to.
        as_use: count the read as a use of the source (hits, eviction order).
        outcome: told where the chunk stands afterwards.
        on_corrupt: called once when the source's copy is found corrupt.
        then: called with ``ref`` after it landed in ``target`` (e.g. to copy it on down).
    """

    def __init__(
        self,
        hop: Hop,
        ref: ChunkRef,
        source: Tier,
        target: Tier,
        *,
        as_use: bool = True,
        outcome: Outcome | None = None,
        on_corrupt: Callable[[], None] | None = None,
        then: Callable[[ChunkRef], None] | None = None,
    ) -> None:
        self.hop = hop
        self.ref = ref
        self.source = source
        self.target = target
        self.as_use = as_use
        self.outcome = outcome
        self.on_corrupt = on_corrupt
        self.then = then

    def landed(self) -> bool:
        """True (and the outcome told) when ``target`` already holds the chunk: the step
        can be skipped (``CopyStep.skip``)."""
        if not self.target.contains(self.ref):
            return False
        if self.outcome is not None:
            self.outcome(self.target.name)
        if self.then is not None:
            self.then(self.ref)
        return True

    def __call__(self) -> None:
        result = self._move()
        if self.outcome is not None:
            self.outcome(result)
        if result == self.target.name and self.then is not None:
            self.then(self.ref)

    def _move(self) -> str:
        if self.target.contains(self.ref):
            return self.target.name
        staging = self.hop.staging
        read = self.source.read(self.ref, staging, as_use=self.as_use)
        if read != "ok":
            if read == "corrupt" and self.on_corrupt is not None:
                self.on_corrupt()
            return read
        try:
            self.target.put([Chunk(self.ref, staging)])
        except TierFullError as exc:  # every slot pinned: its user recomputes it
            log.debug("%s: chunk %s not taken: %s", self.target.name, self.ref.short(), exc)
            return "missing"
        return self.target.name if self.target.contains(self.ref) else "missing"


def outcome_into(outcomes: list[str], index: int) -> Outcome:
    """An ``Outcome`` that stores the result at ``outcomes[index]``."""

    def store(result: str) -> None:
        outcomes[index] = result

    return store
