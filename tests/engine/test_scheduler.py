"""The scheduler's contracts: one prefix lookup per wait (kept on the sequence, redone
when stale), the hand-off queue's bound and life states, and the reused-by-tier counters
from the adopted part of the match."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from kvtier.engine import Engine, EngineClosedError, QueueFullError, SamplingParams
from kvtier.engine.handoff import Handoff, Occupancy
from kvtier.engine.metrics import EngineMetrics
from kvtier.engine.request import Request, RequestHandle
from kvtier.engine.work import WorkModel
from tests.engine.tiny import CHUNK, engine_config

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
PROMPT = list(range(500, 500 + 5 * CHUNK + 3))


def count_lookups(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every ``manager.lookup`` the engine makes from now on appends its hit tokens."""
    lookup = engine.manager.lookup
    hits: list[int] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        match = lookup(*args, **kwargs)
        hits.append(match.hit_tokens)
        return match

    monkeypatch.setattr(engine.manager, "lookup", counted)
    return hits


@pytest.mark.parametrize("disk", [False, True], ids=["host", "host+disk"])
def test_one_prefix_lookup_per_admission(
    model: Any, tokenizer: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, disk: bool
) -> None:
    config = engine_config(disk_dir=str(tmp_path) if disk else None)
    with Engine(model, tokenizer, config) as engine:
        hits = count_lookups(engine, monkeypatch)
        outs = [engine.submit(PROMPT, GREEDY).result() for _ in range(3)]
        stats = engine.stats()
    # Each request, admitted in the step that first saw it, looked its prefix up once
    # (with a disk tier that one lookup served the prefetch hint too).
    assert hits == [0, 5 * CHUNK, 5 * CHUNK]
    assert [o.reused_tokens for o in outs] == [0, 5 * CHUNK, 5 * CHUNK]
    assert stats.reused_tokens_by_tier == {"host": 10 * CHUNK}


def test_a_match_from_an_earlier_step_is_looked_up_again(
    model: Any, tokenizer: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One at a time: the second request is first seen (and prefetched) while the first
    # runs, before its chunks are sealed; admitted later, it must see them.
    config = engine_config(disk_dir=str(tmp_path), max_batch_size=1)
    with Engine(model, tokenizer, config) as engine:
        hits = count_lookups(engine, monkeypatch)
        first = engine.submit(PROMPT, GREEDY)
        second = engine.submit(PROMPT, GREEDY)
        outs = [first.result(), second.result()]
    assert outs[1].reused_tokens == 5 * CHUNK
    assert outs[1].token_ids == outs[0].token_ids
    # The first's one lookup; the second's at first sight (before the first sealed its
    # prefix), and again at its admission.
    assert len(hits) == 3 and hits[1] < hits[2] == 5 * CHUNK


def handle(name: str = "r") -> RequestHandle:
    return RequestHandle(Request(name, (1, 2, 3), SamplingParams()))


def test_the_handoff_bound_counts_what_the_scheduler_holds() -> None:
    metrics = EngineMetrics()
    handoff = Handoff(max_queued=2, max_running=1, metrics=metrics)
    a, b, c = handle("a"), handle("b"), handle("c")
    handoff.put(a)
    assert handoff.take() == [a]  # taken into the scheduler's line: still queued
    handoff.put(b)
    with pytest.raises(QueueFullError):
        handoff.put(c)
    assert handoff.take() == [b]
    handoff.publish(waiting=[b], running=[a], resuming=[])  # a admitted, b in line
    assert handoff.occupancy() == Occupancy(queued=1, running=1, resuming=0)
    handoff.put(c)
    assert metrics.stats(0, 0, None, None).requests_submitted == 3
    assert metrics.stats(0, 0, None, None).requests_rejected == 1


def test_admission_by_cost_refuses_what_would_not_drain_in_time_and_says_when() -> None:
    """At 10 ms per prompt token and 100 ms per output token, each 3-token, 16-token
    request is predicted at 1.63 s; a 5 s bound takes three, the fourth waits."""
    work = WorkModel()
    work.seed(0.01, 0.1)
    handoff = Handoff(8, 1, EngineMetrics(), work, max_queue_s=5.0)
    first = handle("a")
    handoff.put(first)
    assert first.predicted_s == pytest.approx(0.03 + 1.6)
    handoff.put(handle("b"))
    handoff.put(handle("c"))
    with pytest.raises(QueueFullError, match="predicted to take 5 s") as refused:
        handoff.put(handle("d"))
    assert refused.value.retry_after_s == 2  # ceil(4.89 + 1.63 - 5)
    handoff.take()
    handoff.publish(waiting=[], running=[], resuming=[])  # every one of them done
    big = RequestHandle(Request("e", tuple(range(1, 2001)), SamplingParams(max_tokens=16)))
    handoff.put(big)  # nothing ahead: taken, however long it is predicted to take
    assert big.predicted_s > 5.0


def test_the_work_model_follows_the_steps() -> None:
    """Steps of 20 ms per decode row, and prefill of 1 ms per token plus 2 µs per token
    pair: pieces of 100 tokens at several depths tell the two prefill terms apart."""
    work = WorkModel()
    work.seed(0.01, 0.05)
    for _ in range(50):
        work.observe_step(0, 4, 0.08)
    for i in range(60):
        start = 100 * (i % 8)
        pairs = 100 * (start + 50)
        work.observe_step(100, 4, 0.08 + 100 * 1e-3 + pairs * 2e-6, pairs)
    a, b, decode_s = work.rates
    assert decode_s == pytest.approx(0.02, rel=1e-3)
    assert a == pytest.approx(1e-3, rel=1e-2) and b == pytest.approx(2e-6, rel=1e-2)
    # 1,000 prompt tokens: 1 s + 2e-6 * 1000^2 / 2 = 2 s of prefill; 10 decode tokens.
    assert work.predict_s(1000, 10) == pytest.approx(2.2, rel=1e-2)


def test_the_handoff_close_cancels_and_kill_returns_every_request() -> None:
    handoff = Handoff(max_queued=8, max_running=1, metrics=EngineMetrics())
    pending, running = handle("p"), handle("r")
    handoff.put(running)
    handoff.take()
    handoff.publish(waiting=[], running=[running], resuming=[])
    handoff.put(pending)
    assert handoff.close(cancel=True) and not handoff.close(cancel=True)
    assert pending.cancelled and running.cancelled and handoff.closing
    with pytest.raises(EngineClosedError, match="shutting down"):
        handoff.put(handle())
    assert handoff.wait(busy=False)  # one is pending still: the worker goes on
    assert set(handoff.kill("boom")) == {pending, running}
    assert handoff.dead_reason == "boom" and handoff.take() == []
    assert not handoff.wait(busy=False)


def test_the_handoff_wakes_a_waiting_worker() -> None:
    handoff = Handoff(max_queued=8, max_running=1, metrics=EngineMetrics())
    woke: list[bool] = []
    worker = threading.Thread(target=lambda: woke.append(handoff.wait(busy=False)))
    worker.start()
    handoff.put(handle())
    worker.join(timeout=5)
    assert woke == [True]


def test_reused_tokens_by_tier_count_only_the_adopted_chunks() -> None:
    # The match found three chunks; a fault cut the adoption to the first one.
    metrics = EngineMetrics()
    metrics.add_prompt(3 * CHUNK + 1, CHUNK, ["disk", "host", "host"], CHUNK)
    stats = metrics.stats(0, 0, None, None)
    assert (stats.reused_tokens, stats.reused_tokens_by_tier) == (CHUNK, {"disk": CHUNK})


def test_reused_pages_count_under_the_tier_they_came_from() -> None:
    metrics = EngineMetrics()
    metrics.add_prompt(3 * CHUNK, 2 * CHUNK + 5, ["host", "disk", "remote", "remote"], CHUNK)
    stats = metrics.stats(0, 0, None, None)
    assert stats.reused_tokens_by_tier == {"host": CHUNK, "disk": CHUNK, "remote": 5}
