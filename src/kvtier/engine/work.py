"""A request's predicted engine seconds, from what the engine measured of its own steps.

``WorkModel`` predicts a request's prefill as ``a·n + b·n²/2`` for an ``n``-token prompt
(``a``: the projections and MLP per token; ``b``: attention per token and earlier token)
and its decode as ``output tokens × s per decode token``. The rates start from the
engine's warm-up forwards (``seed``) and then follow its steps (``observe_step``): a step
with only decode rows updates the decode rate (its seconds ÷ its rows: a batched step's
cost is shared by its rows); a step with prefill refits ``a`` and ``b`` to what the decode
rows did not take, by least squares over the recent steps (each step's weight decays, so
a change of load shows within a few dozen steps).

The admission that uses it (``kvtier.engine.handoff``) sums the predictions of the
requests ahead of one to predict when the queue drains.

Thread-safe: one lock; ``observe_step`` and ``seed`` are called by the worker, the
predictions by any thread.
"""

from __future__ import annotations

import threading

_WEIGHT = 0.2  # of each new decode observation in its moving average
_DECAY = 0.9  # of the earlier prefill observations in the fit, per new one


class WorkModel:
    """Seconds per prefill token (and per token pair) and per decode token, measured.

    Args:
        prefill_s_per_token: the starting prefill rate (until ``seed`` or a step).
        decode_s_per_token: the starting decode rate.
    """

    def __init__(self, prefill_s_per_token: float = 1e-3, decode_s_per_token: float = 0.05):
        self._lock = threading.Lock()
        self._a = prefill_s_per_token
        self._b = 0.0
        self._decode_s = decode_s_per_token
        self._sums = [0.0] * 5  # decayed Σ t², Σ t·p, Σ p², Σ t·y, Σ p·y

    def seed(self, prefill_s_per_token: float, decode_s_per_token: float) -> None:
        """Replace the rates (the warm-up forwards' figures); forget the fit."""
        with self._lock:
            self._a = max(prefill_s_per_token, 0.0)
            self._b = 0.0
            self._decode_s = max(decode_s_per_token, 0.0)
            self._sums = [0.0] * 5

    def observe_step(
        self, prefill_tokens: int, decode_rows: int, seconds: float, prefill_pairs: float = 0.0
    ) -> None:
        """One engine step of ``prefill_tokens`` prompt tokens (``prefill_pairs``: the sum
        over them of the tokens each attends to) and ``decode_rows`` decode rows took
        ``seconds``."""
        with self._lock:
            if prefill_tokens <= 0:
                if decode_rows > 0:
                    mixed = (1 - _WEIGHT) * self._decode_s + _WEIGHT * seconds / decode_rows
                    self._decode_s = mixed
                return
            rest = max(0.0, seconds - decode_rows * self._decode_s)
            t, p = float(prefill_tokens), float(prefill_pairs)
            s = [x * _DECAY for x in self._sums]
            s = [s[0] + t * t, s[1] + t * p, s[2] + p * p, s[3] + t * rest, s[4] + p * rest]
            self._sums = s
            self._a, self._b = _fit(s, self._a)

    def predict_s(self, prompt_tokens: int, output_tokens: int) -> float:
        """Predicted engine seconds of a request (its share of batched steps)."""
        with self._lock:
            prefill = prompt_tokens * self._a + prompt_tokens * prompt_tokens / 2 * self._b
            return prefill + output_tokens * self._decode_s

    @property
    def rates(self) -> tuple[float, float, float]:
        """``(s per prefill token, s per prefill token pair, s per decode token)`` now."""
        with self._lock:
            return self._a, self._b, self._decode_s


def _fit(s: list[float], a_before: float) -> tuple[float, float]:
    """Least squares ``y = a·t + b·p`` from the sums, both ≥ 0; ``a`` alone where the
    steps do not tell the two apart."""
    tt, tp, pp, ty, py = s
    det = tt * pp - tp * tp
    if det > 1e-9 * tt * pp and pp > 0:
        a = (ty * pp - py * tp) / det
        b = (py * tt - ty * tp) / det
        if a >= 0 and b >= 0:
            return a, b
    if tt > 0:
        return max(0.0, ty / tt), 0.0
    return a_before, 0.0
