"""A request's predicted engine seconds, from what the engine measured of its own steps.

``WorkModel`` predicts ``prompt tokens × s per prefill token + output tokens × s per decode
token``. Both rates start from the engine's warm-up forwards (``seed``) and then follow
its steps (``observe_step``): a step with only decode rows updates the decode rate (its
seconds ÷ its rows: a batched step's cost is shared by its rows); a step with prefill
updates the prefill rate with what the decode rows did not take. Moving averages, so a
change of load (longer contexts, bigger batches) shows within a few steps.

The admission that uses it (``kvtier.engine.handoff``) sums the predictions of the
requests ahead of one to predict when the queue drains.

Thread-safe: one lock; ``observe_step`` and ``seed`` are called by the worker, the
predictions by any thread.
"""

from __future__ import annotations

import threading

_WEIGHT = 0.2  # of each new observation in the moving averages


class WorkModel:
    """Seconds per prefill token and per decode token, measured (see the module docstring).

    Args:
        prefill_s_per_token: the starting prefill rate (until ``seed`` or a step).
        decode_s_per_token: the starting decode rate.
    """

    def __init__(self, prefill_s_per_token: float = 1e-3, decode_s_per_token: float = 0.05):
        self._lock = threading.Lock()
        self._prefill_s = prefill_s_per_token
        self._decode_s = decode_s_per_token

    def seed(self, prefill_s_per_token: float, decode_s_per_token: float) -> None:
        """Replace both rates (the warm-up forwards' figures)."""
        with self._lock:
            self._prefill_s = max(prefill_s_per_token, 0.0)
            self._decode_s = max(decode_s_per_token, 0.0)

    def observe_step(self, prefill_tokens: int, decode_rows: int, seconds: float) -> None:
        """One engine step of ``prefill_tokens`` prompt tokens and ``decode_rows`` decode
        rows took ``seconds``."""
        with self._lock:
            if prefill_tokens <= 0:
                if decode_rows > 0:
                    self._decode_s = _mix(self._decode_s, seconds / decode_rows)
                return
            rest = max(0.0, seconds - decode_rows * self._decode_s)
            self._prefill_s = _mix(self._prefill_s, rest / prefill_tokens)

    def predict_s(self, prompt_tokens: int, output_tokens: int) -> float:
        """Predicted engine seconds of a request (its share of batched steps)."""
        with self._lock:
            return prompt_tokens * self._prefill_s + output_tokens * self._decode_s

    @property
    def rates(self) -> tuple[float, float]:
        """``(s per prefill token, s per decode token)`` now."""
        with self._lock:
            return self._prefill_s, self._decode_s


def _mix(old: float, new: float) -> float:
    return (1 - _WEIGHT) * old + _WEIGHT * new
