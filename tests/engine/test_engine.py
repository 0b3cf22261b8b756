"""The engine on a tiny random-weight llama with the embedded model's tokenizer."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.engine import (
    LLM,
    ContextLengthError,
    Engine,
    EngineClosedError,
    ParamError,
    QueueFullError,
    SamplingParams,
    TokenEvent,
)
from tests.engine.tiny import CHUNK, FAULT_TOKEN, engine_config, inject_fault, reference_tokens

GREEDY = SamplingParams(temperature=0, max_tokens=24)
STORY = (
    "Once upon a time, in a village by the sea, there lived an old fisherman who told "
    "stories about the lighthouse, the storms and the ships that never came home."
)


@pytest.fixture(params=[1, 4], ids=["serial", "batching"])
def engine(model: Any, tokenizer: Any, request: pytest.FixtureRequest) -> Iterator[Engine]:
    config = dataclasses.replace(engine_config(), max_batch_size=request.param)
    with Engine(model, tokenizer, config) as engine:
        yield engine


@pytest.mark.parametrize(
    "prompt", ["Hi", "The capital of France is", STORY, STORY + " " + STORY + " The end."]
)
def test_greedy_equals_transformers_generate(
    engine: Engine, model: Any, tokenizer: Any, prompt: str
) -> None:
    ids = engine.encode(prompt)
    handle = engine.submit(prompt, GREEDY)
    events = list(handle)
    done = handle.result()  # the stream is consumed: an empty remainder
    assert done.token_ids == [] and done.text == ""
    tokens = [e.token_id for e in events]
    expected = reference_tokens(model, ids, 24)
    assert tokens == expected
    assert "".join(e.text for e in events) == tokenizer.decode(expected, skip_special_tokens=True)
    assert [e.finished for e in events] == [False] * 23 + [True]
    assert events[-1].finish_reason == "length"


def test_later_requests_reuse_the_shared_prefix_and_the_previous_turn(
    engine: Engine, model: Any
) -> None:
    first_ids = engine.encode(STORY)
    first = engine.submit(first_ids, GREEDY).result()
    assert first.reused_tokens == 0
    # Same opening, another ending: the whole chunks of the shared prefix are adopted.
    other_ids = first_ids + engine.encode(" And then the sea was calm.")
    other = engine.submit(other_ids, GREEDY).result()
    assert other.reused_tokens == (len(first_ids) // CHUNK) * CHUNK > 0
    assert other.token_ids == reference_tokens(model, other_ids, 24)
    # A second turn: the history includes the first answer's tokens, whose KV is cached too.
    turn_ids = first_ids + first.token_ids + engine.encode(" Tell me more.")
    turn = engine.submit(turn_ids, GREEDY).result()
    assert turn.reused_tokens == ((len(first_ids) + 24 - 1) // CHUNK) * CHUNK
    assert turn.token_ids == reference_tokens(model, turn_ids, 24)
    stats = engine.stats()
    assert stats.requests_finished == 3 and stats.queue_depth == 0
    assert stats.reused_tokens == other.reused_tokens + turn.reused_tokens
    assert sum(stats.reused_tokens_by_tier.values()) == stats.reused_tokens
    assert stats.generated_tokens == 72
    assert stats.ttft is not None and stats.ttft.count == 3
    assert stats.inter_token is not None and stats.inter_token.count == 69


def test_stop_strings_cut_the_text_and_end_with_stop(engine: Engine) -> None:
    full = engine.submit(STORY, GREEDY).result()
    words = full.text.split()
    stop = words[len(words) // 2]
    cut = full.text.index(stop)
    handle = engine.submit(STORY, SamplingParams(temperature=0, max_tokens=24, stop=["zzqx", stop]))
    events = list(handle)
    text = "".join(e.text for e in events)
    assert text == full.text[:cut]
    assert events[-1].finish_reason == "stop" and events[-1].finished
    assert len(events) < 24
    assert [e.token_id for e in events] == full.token_ids[: len(events)]


def test_end_of_sequence_stops_unless_ignored(model: Any, tokenizer: Any) -> None:
    with Engine(model, tokenizer, engine_config()) as engine:
        greedy = engine.submit(STORY, GREEDY).result().token_ids
    original = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = greedy[3]  # this model's 4th token now ends it
    try:
        with Engine(model, tokenizer, engine_config()) as engine:
            stopped = engine.submit(STORY, GREEDY).result()
            ignored = engine.submit(
                STORY, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
            ).result()
    finally:
        model.generation_config.eos_token_id = original
    assert stopped.token_ids == greedy[:4] and stopped.finish_reason == "stop"
    assert ignored.token_ids == greedy and ignored.finish_reason == "length"


def test_seeded_sampling_reproduces(engine: Engine) -> None:
    params = SamplingParams(temperature=0.9, top_k=100, top_p=0.95, max_tokens=16, seed=7)
    a = engine.submit("Tell me a story", params).result()
    b = engine.submit("Tell me a story", params).result()
    c = engine.submit("Tell me a story", SamplingParams(**{**params.__dict__, "seed": 8})).result()
    assert a.token_ids == b.token_ids and a.text == b.text
    assert a.token_ids != c.token_ids


def test_queue_full_raises_and_cancel_ends_requests(model: Any, tokenizer: Any) -> None:
    with Engine(model, tokenizer, engine_config(max_queued=1, max_batch_size=1)) as engine:
        long = SamplingParams(temperature=0, max_tokens=1500, ignore_eos=True)
        running = engine.submit(STORY, long)
        events = iter(running)
        next(events)  # it is generating, so the queue is empty again
        waiting = engine.submit(STORY, long)
        with pytest.raises(QueueFullError, match="queue is full"):
            engine.submit(STORY, long)
        assert engine.stats().requests_rejected == 1
        assert engine.stats().queue_depth == 1
        waiting.cancel()
        running.cancel()
        rest = list(events)
        assert rest[-1].finish_reason == "cancelled" and len(rest) < 1499
        assert list(waiting) == [TokenEvent(waiting.request_id, None, "", True, "cancelled")]
        assert engine.submit("Hi", GREEDY).result().finish_reason == "length"
        assert engine.stats().requests_cancelled == 2


def test_submit_rejects_bad_prompts(engine: Engine) -> None:
    with pytest.raises(ParamError, match=r"^prompt: "):
        engine.submit("", GREEDY)
    with pytest.raises(ParamError, match="outside the vocabulary"):
        engine.submit([1, engine.vocab_size], GREEDY)
    with pytest.raises(ContextLengthError, match="maximum context length is 2048") as info:
        engine.submit([5] * 2040, SamplingParams(max_tokens=16))
    assert info.value.param == "max_tokens"
    engine.close()
    with pytest.raises(EngineClosedError):
        engine.submit("Hi", GREEDY)


def test_async_events_match_the_blocking_iterator(engine: Engine) -> None:
    blocking = list(engine.submit(STORY, GREEDY))

    async def consume() -> list[TokenEvent]:
        handle = engine.submit(STORY, GREEDY)
        return [event async for event in handle.events()]

    streamed = asyncio.run(consume())
    assert [(e.token_id, e.text, e.finish_reason) for e in streamed] == [
        (e.token_id, e.text, e.finish_reason) for e in blocking
    ]


def test_close_drains_and_a_restart_finds_the_kv_on_disk(
    model: Any, tokenizer: Any, tmp_path: Path
) -> None:
    disk = str(tmp_path / "kv")
    engine = Engine(model, tokenizer, engine_config(disk_dir=disk))
    handles = [engine.submit(STORY + f" Chapter {i}.", GREEDY) for i in range(3)]
    engine.close(drain=True)  # returns when all three are done and the host is on disk
    assert [h.result().finish_reason for h in handles] == ["length"] * 3
    with Engine(model, tokenizer, engine_config(disk_dir=disk)) as restarted:
        again = restarted.submit(STORY + " Chapter 0.", GREEDY).result()
        by_tier = restarted.stats().reused_tokens_by_tier
    assert again.reused_tokens > 0 and by_tier == {"disk": again.reused_tokens}


def test_close_without_drain_cancels(model: Any, tokenizer: Any) -> None:
    engine = Engine(model, tokenizer, engine_config())
    long = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    handles = [engine.submit(STORY, long) for _ in range(3)]
    engine.close(drain=False)
    reasons = [h.result().finish_reason for h in handles]
    assert reasons.count("cancelled") >= 2 and set(reasons) <= {"cancelled", "length"}


def test_the_engine_freezes_what_lives_at_start_out_of_the_collector(
    model: Any, tokenizer: Any
) -> None:
    """Frozen at start; back in the collector's view at close, so a closed engine's
    reference cycles are freed (a process that builds engine after engine stays flat)."""
    gc.unfreeze()
    engine = Engine(model, tokenizer, engine_config())
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 1000  # the model's modules and the tiers, at least
        done = engine.submit("Hi", SamplingParams(max_tokens=2, temperature=0)).result()
        assert len(done.token_ids) == 2  # serves as before
    finally:
        engine.close()
    assert gc.get_freeze_count() == 0
    collected = weakref.ref(engine._scheduler)
    del engine
    gc.collect()
    assert collected() is None


def test_llm_generates_in_order_with_a_small_queue(model: Any, tokenizer: Any) -> None:
    prompts = [f"Question {i}: what is {i} plus {i}?" for i in range(5)]
    with LLM(model, tokenizer=tokenizer, config=engine_config(max_queued=2)) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8))
        ids = [llm.engine.encode(p) for p in prompts]
    assert [o.prompt_ids for o in outs] == ids
    for out, prompt_ids in zip(outs, ids, strict=True):
        assert out.token_ids == reference_tokens(model, prompt_ids, 8)
    with pytest.raises(ValueError, match="tokenizer"):
        LLM(model)


def test_a_failing_request_fails_alone(
    model: Any, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    inject_fault(monkeypatch, model)
    with Engine(model, tokenizer, engine_config()) as engine:
        failing = engine.submit([FAULT_TOKEN] * 40, GREEDY)
        with pytest.raises(RuntimeError, match="injected fault"):
            failing.result()
        assert engine.submit("Hi", GREEDY).result().finish_reason == "length"
        assert engine.stats().requests_failed == 1


def test_a_request_the_tiers_cannot_hold_is_refused_up_front(model: Any, tokenizer: Any) -> None:
    # Two host chunks cannot hold a 25-chunk context that the device cannot hold either.
    prompt = list(range(100, 500))
    with Engine(model, tokenizer, engine_config(host_chunks=2)) as engine:
        with pytest.raises(ContextLengthError, match="host tier, which holds 2 chunks") as info:
            engine.submit(prompt, GREEDY)
        assert info.value.param == "prompt" and "enlarge the host tier" in str(info.value)
    # With room for the chunks the device cannot hold, the same request is served.
    with Engine(model, tokenizer, engine_config(host_chunks=32)) as engine:
        out = engine.submit(prompt, GREEDY).result()
    assert out.token_ids == reference_tokens(model, prompt, len(out.token_ids))


def test_placement_auto_calibrates_once_at_first_start_and_stays_exact(
    model: Any, tokenizer: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No profile of the model here: the engine refuses placement auto in one line naming
    the fix; ``ensure_profile`` (what ``kvtier serve`` runs at start) measures one and
    saves it, once; greedy tokens equal transformers' with the chunks past the budget
    placed by the cost model."""
    from kvtier.calibrate import ensure_profile
    from kvtier.profiles import ProfileMissingError, load_profile

    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path))
    base = engine_config()
    config = dataclasses.replace(
        base, cache=dataclasses.replace(base.cache, placement="auto", rates=None)
    )
    assert load_profile("tiny-auto") is None
    with pytest.raises(ProfileMissingError, match="kvtier calibrate"):
        Engine(model, tokenizer, config, model_id="tiny-auto")
    assert ensure_profile(model, tokenizer, "tiny-auto") is not None
    assert ensure_profile(model, tokenizer, "tiny-auto") is None  # not measured again
    with Engine(model, tokenizer, config, model_id="tiny-auto") as engine:
        profile = load_profile("tiny-auto")
        assert profile is not None and profile["model"]["id"] == "tiny-auto"
        ids = engine.encode(" ".join([STORY] * 5))  # 12+ chunks: past the 8-chunk budget
        tokens = [e.token_id for e in engine.submit(ids, GREEDY)]
        stats = engine.stats().cache
        assert stats is not None
        placed = {d: n for d, n in stats.decided_chunks.items() if d in ("stream", "host")}
    assert tokens == reference_tokens(model, ids, 24)
    assert sum(placed.values()) > 0, stats.decided_chunks


def test_admission_by_cost_refuses_what_the_queue_cannot_drain_in_time(
    model: Any, tokenizer: Any
) -> None:
    """A bound of 1 ms of predicted work: while one request runs, the next is refused
    with a retry estimate; once the engine is idle again, it is taken."""
    config = dataclasses.replace(engine_config(), max_queue_s=0.001, max_batch_size=1)
    with Engine(model, tokenizer, config) as engine:
        first = engine.submit(STORY, SamplingParams(temperature=0, max_tokens=64))
        with pytest.raises(QueueFullError, match="queue bound") as refused:
            engine.submit(STORY, GREEDY)
        assert refused.value.retry_after_s >= 1
        first.result()
        deadline = time.monotonic() + 10
        while engine.stats().running and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.submit("Hi", GREEDY).result().finish_reason == "length"
        assert engine.stats().requests_rejected == 1
