"""Throttle model, its virtual clock, and pacing through a link."""

from __future__ import annotations

import time

import pytest

from kvtier.transfer import CopyStep, Link, Throttle, ThrottleClock, sleep_until


def test_step_seconds_and_describe() -> None:
    throttle = Throttle(gbps=8.0, latency_ms=0.01)
    assert throttle.step_s(8_000_000) == pytest.approx(0.001 + 0.00001)
    assert throttle.describe() == "throttled 8.0 GB/s, 0.01 ms"


@pytest.mark.parametrize(
    "kwargs", [{"gbps": 0.0}, {"gbps": -1.0}, {"gbps": 1.0, "latency_ms": -1.0}]
)
def test_bad_throttle_raises(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="Throttle"):
        Throttle(**kwargs)


def test_clock_paces_back_to_back_steps_from_the_modelled_end() -> None:
    clock = ThrottleClock(Throttle(gbps=1.0, burst_ms=1.0))  # 1 MB = 1 ms
    assert clock.reserve(1_000_000, now_s=10.0) == pytest.approx(10.001)
    # Began 0.3 ms late (sleep overshoot): still paced from 10.001, so no drift.
    assert clock.reserve(1_000_000, now_s=10.0013) == pytest.approx(10.002)
    # Began early (a second thread): queued behind the wire.
    assert clock.reserve(1_000_000, now_s=10.0) == pytest.approx(10.003)
    # Idle for a while: starts from now.
    assert clock.reserve(1_000_000, now_s=20.0) == pytest.approx(20.001)


def test_clock_without_burst_never_credits_lateness() -> None:
    clock = ThrottleClock(Throttle(gbps=1.0, burst_ms=0.0))
    clock.reserve(1_000_000, now_s=0.0)
    assert clock.reserve(1_000_000, now_s=0.0015) == pytest.approx(0.0025)


def test_sleep_until_never_returns_early() -> None:
    deadline_s = time.perf_counter() + 0.002
    sleep_until(deadline_s)
    assert time.perf_counter() >= deadline_s


def test_link_paces_ten_megabyte_steps_at_one_gbps() -> None:
    steps = [CopyStep(1_000_000, range(i, i + 1), lambda: None) for i in range(10)]
    with Link("host->device", max_inflight_bytes=1 << 30, throttle=Throttle(gbps=1.0)) as link:
        start = time.perf_counter()
        link.submit(steps, num_layers=10).wait()
        elapsed_s = time.perf_counter() - start
        stats = link.stats()
    assert elapsed_s >= 0.010 - 1e-6  # a lower bound only: sleep never returns early
    assert stats.bytes == 10_000_000 and stats.achieved_gbps > 0
    assert link.describe() == "host->device: throttled 1.0 GB/s, 0.0 ms"
