"""Throttling: make a link behave like a slower one (a PCIe link on a CPU-only machine).

A throttled step takes at least ``latency_ms / 1000 + nbytes / (gbps * 1e9)`` seconds: the
real copy runs first and the worker sleeps for the remainder. The time is kept on a
virtual clock, so that back-to-back steps are paced against the modelled link and not
against their own sleep overshoot (which would otherwise add up over many small steps).
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Throttle:
    """The model of a link: bandwidth and per-step latency.

    A frozen value; the pacing state lives in a ``ThrottleClock`` per link, so one
    ``Throttle`` may configure several links.

    Attributes:
        gbps: bandwidth in GB/s (1e9 bytes per second, not gigabits), > 0.
        latency_ms: fixed cost of every step in milliseconds, >= 0.
        burst_ms: how late (ms) a step may begin after the previous one's modelled end and
            still be paced from that end rather than from its own start. This absorbs sleep
            overshoot and scheduling jitter; it also bounds how far a busy link can run
            ahead of the model. >= 0.
    """

    gbps: float
    latency_ms: float = 0.0
    burst_ms: float = 1.0

    def __post_init__(self) -> None:
        if not (self.gbps > 0 and math.isfinite(self.gbps)):
            raise ValueError(f"Throttle.gbps: must be a finite number > 0, got {self.gbps}")
        if not (self.latency_ms >= 0 and math.isfinite(self.latency_ms)):
            raise ValueError(f"Throttle.latency_ms: must be >= 0, got {self.latency_ms}")
        if not (self.burst_ms >= 0 and math.isfinite(self.burst_ms)):
            raise ValueError(f"Throttle.burst_ms: must be >= 0, got {self.burst_ms}")

    def step_s(self, nbytes: int) -> float:
        """Modelled seconds for one step of ``nbytes`` bytes."""
        return self.latency_ms / 1e3 + nbytes / (self.gbps * 1e9)

    def describe(self) -> str:
        """E.g. ``"throttled 8.0 GB/s, 0.01 ms"``."""
        return f"throttled {float(self.gbps)} GB/s, {float(self.latency_ms)} ms"


class ThrottleClock:
    """The virtual clock that paces one link's steps to a ``Throttle``.

    Thread-safe: steps reserved concurrently are serialised on the clock, as on one wire.

    Args:
        throttle: the link model.
    """

    def __init__(self, throttle: Throttle) -> None:
        self.throttle = throttle
        self._free_at_s = -math.inf  # perf_counter time the modelled wire becomes free
        self._lock = threading.Lock()

    def reserve(self, nbytes: int, now_s: float | None = None) -> float:
        """Reserve the wire for a step beginning at ``now_s``; returns its deadline.

        The step starts at the modelled end of the previous one if it begins no more than
        ``burst_ms`` after it (or before it), else at ``now_s``. Mutates the clock; never
        blocks.

        Args:
            nbytes: bytes the step moves.
            now_s: the step's start in ``time.perf_counter()`` seconds (default: now).

        Returns:
            The ``time.perf_counter()`` time before which the step must not finish.
        """
        now = time.perf_counter() if now_s is None else now_s
        with self._lock:
            back_to_back = now <= self._free_at_s + self.throttle.burst_ms / 1e3
            start = self._free_at_s if back_to_back else now
            self._free_at_s = start + self.throttle.step_s(nbytes)
            return self._free_at_s


def sleep_until(deadline_s: float) -> None:
    """Block the calling thread until ``time.perf_counter()`` reaches ``deadline_s``."""
    while True:
        remaining_s = deadline_s - time.perf_counter()
        if remaining_s <= 0:
            return
        time.sleep(remaining_s)
