"""Which path a decode-only step takes, decided on the engine's own steps.

A step whose rows are all seated decode rows can run every layer in one
``kvtier_cpu::decode_layers`` call, whose projections are kvtier's ``linear_panels``, or the
layer loop, whose projections above ``LlamaModel.rows_kernel_max`` rows are oneDNN's. The
projections alone, timed at start (``kvtier.engine.linear.rows_kernel_max``), do not decide
between the two: the loop alternates oneDNN's OpenMP team with kvtier's thread pool (RoPE,
attention, norms), and the team's helper spins on a core the pool needs after each of its
regions. Bf16 projections at 16 rows (Intel Xeon, 2 threads): ``linear_panels`` 15.7 ms
against oneDNN's 15.9 over the 121 projections, but a 16-row decode step 32 ms in one call
against 42-58 ms through the loop, 35 % of whose samples were libgomp spinning.

So for row counts above ``fused_max_rows`` (where the projections alone already favour the
one call) and up to ``trial_max_rows`` (what ``decode_layers`` takes), the first steps of
each size class (``ROWS_MEASURED``'s buckets) alternate the two paths, ``trials`` each; the
faster one's fastest step decides that class for the model's lifetime.

Not thread-safe: one forward at a time (the engine's worker thread) calls ``fused`` and
``record``.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field

from kvtier.engine.linear import ROWS_MEASURED

log = logging.getLogger(__name__)


@dataclass
class _Trials:
    fused_s: list[float] = field(default_factory=list)
    loop_s: list[float] = field(default_factory=list)


class DecodePath:
    """The path of decode-only steps by row count, measured on the first steps of each class.

    Args:
        fused_max_rows: up to this many rows, always the one call.
        trial_max_rows: above this many, always the loop; in between, measured.
        trials: steps timed on each path per size class before it is decided.
    """

    def __init__(self, fused_max_rows: int, trial_max_rows: int, trials: int = 3) -> None:
        if trials < 1:
            raise ValueError(f"trials must be at least 1, not {trials}")
        self.fused_max_rows = fused_max_rows
        self.trial_max_rows = trial_max_rows
        self.trials = trials
        self.decided: dict[int, bool] = {}
        """Size class (its largest row count) → True: the one call; False: the loop."""
        self._trials: dict[int, _Trials] = {}

    def size_class(self, rows: int) -> int:
        """The smallest of ``ROWS_MEASURED`` that holds ``rows`` (``rows`` above them all)."""
        at = bisect.bisect_left(ROWS_MEASURED, rows)
        return ROWS_MEASURED[at] if at < len(ROWS_MEASURED) else rows

    def fused(self, rows: int) -> bool:
        """Whether a decode-only step of ``rows`` rows takes the one call now."""
        if rows <= self.fused_max_rows:
            return True
        if rows > self.trial_max_rows:
            return False
        size = self.size_class(rows)
        if size in self.decided:
            return self.decided[size]
        trials = self._trials.setdefault(size, _Trials())
        return len(trials.fused_s) <= len(trials.loop_s)  # alternate, the one call first

    def record(self, rows: int, fused: bool, seconds: float) -> None:
        """A decode-only step of ``rows`` took ``seconds`` on the path ``fused`` named;
        decides its size class once both paths have ``trials`` steps."""
        if not self.fused_max_rows < rows <= self.trial_max_rows:
            return
        size = self.size_class(rows)
        if size in self.decided:
            return
        trials = self._trials.setdefault(size, _Trials())
        (trials.fused_s if fused else trials.loop_s).append(seconds)
        if min(len(trials.fused_s), len(trials.loop_s)) < self.trials:
            return
        one_call, loop = min(trials.fused_s), min(trials.loop_s)
        self.decided[size] = one_call <= loop
        del self._trials[size]
        log.info(
            "decode steps of up to %d rows: %s (one call %.1f ms, the layer loop %.1f ms)",
            size,
            "one decode_layers call" if self.decided[size] else "the layer loop",
            one_call * 1e3,
            loop * 1e3,
        )
