"""Every per-request part of a step fails alone: generator set-up, sampling, detokenizing;
a cancelled request leaves within a step; a dead worker says so instead of hanging; tenants
with different salts never share KV."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
import torch
import uvicorn

from kvtier.engine import Engine, EngineClosedError, SamplingParams
from kvtier.engine import postprocess as postprocess_module
from kvtier.engine import sequence as sequence_module
from kvtier.engine.sampling import TextStream, sample
from tests.engine.tiny import CHUNK, engine_config, reference_tokens

GREEDY = SamplingParams(temperature=0, max_tokens=16)
PROMPTS = [list(range(300 + 7 * i, 340 + 7 * i)) for i in range(3)]
POISON_SEED = 666


def run_with_poison(engine: Engine, poison: SamplingParams) -> tuple[list[list[int]], Any]:
    """Three greedy requests and one poisoned one, together; their tokens and its handle."""
    good = [engine.submit(p, GREEDY) for p in PROMPTS]
    bad = engine.submit("A poisoned request", poison)
    return [h.result().token_ids for h in good], bad


def check_alone(model: Any, engine: Engine, poison: SamplingParams, match: str) -> None:
    outs, bad = run_with_poison(engine, poison)
    with pytest.raises(RuntimeError, match=match):
        bad.result()
    for out, prompt in zip(outs, PROMPTS, strict=True):
        assert out == reference_tokens(model, prompt, GREEDY.max_tokens)
    assert engine.submit("After it", GREEDY).result().finish_reason == "length"
    deadline = time.monotonic() + 5  # the last event reaches us just before it leaves
    while (stats := engine.stats()).running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert stats.requests_failed == 1 and stats.queue_depth == 0 and stats.running == 0


def test_a_failing_generator_set_up_fails_alone(
    model: Any, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    def make_generator(seed: int | None) -> torch.Generator:
        if seed == POISON_SEED:
            raise RuntimeError("generator set-up fault")
        return torch.Generator().manual_seed(seed or 0)

    monkeypatch.setattr(sequence_module, "make_generator", make_generator)
    with Engine(model, tokenizer, engine_config()) as engine:
        poison = SamplingParams(temperature=1, seed=POISON_SEED, max_tokens=8)
        check_alone(model, engine, poison, "generator set-up fault")


def test_a_failing_sample_fails_alone_and_is_logged(
    model: Any, tokenizer: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def faulty(logits: torch.Tensor, params: SamplingParams, generator: Any = None) -> int:
        if params.seed == POISON_SEED:
            raise RuntimeError("sampling fault")
        return sample(logits, params, generator)

    monkeypatch.setattr(postprocess_module, "sample", faulty)
    with Engine(model, tokenizer, engine_config()) as engine:
        poison = SamplingParams(temperature=1, seed=POISON_SEED, max_tokens=8)
        with caplog.at_level(logging.ERROR, logger="kvtier.engine.scheduler"):
            check_alone(model, engine, poison, "sampling fault")
    (record,) = [r for r in caplog.records if r.name == "kvtier.engine.scheduler"]
    assert "failed: RuntimeError('sampling fault')" in record.getMessage()
    assert record.exc_info is not None  # the operator gets the traceback


def test_a_failing_stop_string_check_fails_alone(
    model: Any, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    push = TextStream.push

    def faulty(self: TextStream, token_id: int) -> str:
        if self.stop == ("POISON",):
            raise RuntimeError("detokenizer fault")
        return push(self, token_id)

    monkeypatch.setattr(TextStream, "push", faulty)
    with Engine(model, tokenizer, engine_config()) as engine:
        check_alone(model, engine, SamplingParams(stop=("POISON",)), "detokenizer fault")


def test_cancelling_a_running_request_ends_it_within_a_step(model: Any, tokenizer: Any) -> None:
    with Engine(model, tokenizer, engine_config()) as engine:
        handle = engine.submit(
            PROMPTS[0], SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
        )
        events = iter(handle)
        next(events)  # running now
        # Tokens the engine delivered before the cancel but this thread has not read yet
        # (a busy machine delays it): counted with the handle's lock held, so no step
        # delivers one between the count and the cancel.
        with handle._cond:
            unread = len(handle._events)
            handle.cancel()
        rest = list(events)
        assert rest[-1].finish_reason == "cancelled"
        assert len(rest) <= unread + 2  # at most the token of the step under way, the end
        assert engine.stats().requests_cancelled == 1


def test_a_dead_worker_fails_what_waits_and_says_why(
    model: Any, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = Engine(model, tokenizer, engine_config())
    try:

        def die() -> None:
            raise SystemExit("the worker's loop itself broke")

        monkeypatch.setattr(engine._scheduler, "step", die)
        waiting = engine.submit("Hello", GREEDY)
        with pytest.raises(EngineClosedError, match="worker died"):
            waiting.result()
        assert "worker's loop itself broke" in (engine.dead_reason or "")
        with pytest.raises(EngineClosedError, match="worker died"):
            engine.submit("Hello again", GREEDY)
        # kvtier serve's watchdog stops uvicorn, so the process exits non-zero.
        from kvtier.server.launch import _Watchdog

        server = uvicorn.Server(uvicorn.Config(app=None))
        watchdog = _Watchdog(engine, server)
        deadline = time.monotonic() + 5
        while not server.should_exit and time.monotonic() < deadline:
            time.sleep(0.05)
        watchdog.stop()
        assert server.should_exit and watchdog.dead == engine.dead_reason
    finally:
        engine.close(timeout_s=5)


def test_salts_never_share_kv(model: Any, tokenizer: Any, tmp_path: Any) -> None:
    prompt = list(range(1000, 1000 + 6 * CHUNK + 3))
    with Engine(model, tokenizer, engine_config(disk_dir=str(tmp_path))) as engine:
        first = engine.submit(prompt, GREEDY, cache_salt="tenant-a").result()
        other = engine.submit(prompt, GREEDY, cache_salt="tenant-b")
        shared = engine.submit(prompt, GREEDY)
        again = engine.submit(prompt, GREEDY, cache_salt="tenant-a")
        outs = [other.result(), shared.result(), again.result()]
        assert [first.reused_tokens, *(o.reused_tokens for o in outs)] == [0, 0, 0, 6 * CHUNK]
        assert all(o.token_ids == first.token_ids for o in outs)
    # Across a restart from disk, too: a new tenant finds nothing, tenant-a its chunks.
    with Engine(model, tokenizer, engine_config(disk_dir=str(tmp_path))) as engine:
        c = engine.submit(prompt, GREEDY, cache_salt="tenant-c").result()
        a = engine.submit(prompt, GREEDY, cache_salt="tenant-a").result()
    assert (c.reused_tokens, a.reused_tokens) == (0, 6 * CHUNK)
