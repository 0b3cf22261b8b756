"""Every placement decision with its predicted and its measured cost: ``Ledger``.

A pass's plan says, per layer group and chunk range, where attention reads the KV
(``Decision``). The ledger counts, per decision, the chunk reads and their bytes (a chunk
read by ten passes counts ten times) and, where the cost model has rates, the seconds it
predicted for them:

- ``stream``: the bytes over the link, ``bytes / link GB/s`` (the throttle where one is
  set); measured: the seconds the sequence's link spent executing its copies (throttle
  sleeps included), read from the link's counters when a snapshot is taken;
- ``host``: ``bytes / host attention GB/s``; measured: the wall seconds the host-side
  attention calls took (``host_spent``, called by ``kvtier.runtime.dispatch``);
- ``resident``: counted only (the device reads them at its own pace, inside compute).

One ``Ledger`` belongs to one ``SequenceKV`` and is written by the thread that runs its
forward passes; ``snapshot`` returns copies, so readers on other threads see a value a
pass left (each field is a plain number).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvtier.config import PlacementRates
from kvtier.runtime.plan import ChunkRange, Decision


@dataclass(frozen=True)
class DecisionCost:
    """One decision's totals.

    Attributes:
        chunks: chunk reads (chunk × pass) of every layer of their group.
        nbytes: their bytes.
        predicted_s: the cost model's seconds for them (None: no rates).
        measured_s: the seconds they took (None: not measured for this decision).
    """

    chunks: int = 0
    nbytes: int = 0
    predicted_s: float | None = None
    measured_s: float | None = None

    @staticmethod
    def total(items: Iterable[Mapping[str, DecisionCost]]) -> dict[str, DecisionCost]:
        """Several ledgers' snapshots as one (per decision: counts and seconds add; a
        second is None only where every part had None)."""
        out: dict[str, DecisionCost] = {}
        for item in items:
            for name, cost in item.items():
                seen = out.get(name, DecisionCost())
                out[name] = DecisionCost(
                    seen.chunks + cost.chunks,
                    seen.nbytes + cost.nbytes,
                    _add(seen.predicted_s, cost.predicted_s),
                    _add(seen.measured_s, cost.measured_s),
                )
        return out


def _add(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else a + b


class Ledger:
    """The running totals of one sequence's decisions (see the module docstring).

    Args:
        group_chunk_nbytes: bytes of one chunk of every layer of each layer group, as the
            host stores them (what a streamed read moves; its codec's bytes when coded).
        rates: the cost model's rates (None: nothing is predicted).
        throttle_gbps: the link's throttle (None: its measured rate).
    """

    def __init__(
        self,
        group_chunk_nbytes: Sequence[int],
        rates: PlacementRates | None,
        throttle_gbps: float | None,
    ) -> None:
        self._chunk_nbytes = list(group_chunk_nbytes)
        self._gbps: dict[Decision, float] = {}
        if rates is not None:
            link = rates.link_gbps if throttle_gbps is None else min(rates.link_gbps, throttle_gbps)
            self._gbps = {Decision.STREAM: link, Decision.HOST: rates.host_attention_gbps}
        self._chunks = dict.fromkeys(Decision, 0)
        self._nbytes = dict.fromkeys(Decision, 0)
        self._host_s = 0.0

    def record(self, ranges: Iterable[ChunkRange]) -> None:
        """Count one pass's chunk ranges."""
        for r in ranges:
            n = r.stop - r.start
            self._chunks[r.decision] += n
            self._nbytes[r.decision] += n * self._chunk_nbytes[r.group]

    def host_spent(self, seconds: float) -> None:
        """Add the wall seconds of one host-side attention call."""
        self._host_s += seconds

    def snapshot(self, link_busy_s: float) -> dict[str, DecisionCost]:
        """Per decision that occurred, its totals; ``link_busy_s``: the sequence's link's
        busy seconds so far (the measured cost of streaming)."""
        measured = {Decision.STREAM: link_busy_s, Decision.HOST: self._host_s}
        out: dict[str, DecisionCost] = {}
        for decision in Decision:
            if not self._chunks[decision]:
                continue
            nbytes = self._nbytes[decision]
            gbps = self._gbps.get(decision)
            out[decision.value] = DecisionCost(
                chunks=self._chunks[decision],
                nbytes=nbytes,
                predicted_s=nbytes / (gbps * 1e9) if gbps is not None else None,
                measured_s=measured.get(decision),
            )
        return out
