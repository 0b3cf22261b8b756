"""Continuous batching: sequences of different lengths decoded together, preemption,
prefetch of queued requests; greedy tokens must equal transformers ``generate``."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from kvtier.engine import LLM, Engine, EngineConfig, SamplingParams
from tests.engine.tiny import CHUNK, FAULT_TOKEN, engine_config, inject_fault, reference_tokens

LENGTHS = (3, 17, 40, 70, 33, 5)
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def prompts(base: int = 100) -> list[list[int]]:
    return [list(range(base + 7 * i, base + 7 * i + n)) for i, n in enumerate(LENGTHS)]


def batching(config: EngineConfig, **changes: Any) -> EngineConfig:
    return dataclasses.replace(config, **{"max_batch_size": 4, **changes})


@pytest.mark.parametrize("prefill_tokens", [None, 3 * CHUNK], ids=["one-chunk", "three-chunks"])
def test_mixed_lengths_decode_together_and_match_generate(
    model: Any, tokenizer: Any, prefill_tokens: int | None
) -> None:
    config = batching(engine_config(), prefill_tokens_per_step=prefill_tokens)
    with Engine(model, tokenizer, config) as engine:
        handles = [engine.submit(p, GREEDY) for p in prompts()]
        outs = [h.result() for h in handles]
        stats = engine.stats()
    for out, prompt in zip(outs, prompts(), strict=True):
        assert out.token_ids == reference_tokens(model, prompt, 20)
        assert out.finish_reason == "length"
    assert stats.max_decode_batch == 4 and stats.mean_decode_batch > 1.5
    assert stats.decode_rows == stats.generated_tokens - len(LENGTHS)  # first tokens: prefill
    assert stats.requests_finished == len(LENGTHS)
    assert stats.ttft is not None and stats.ttft.count == len(LENGTHS)


def test_batch_decoded_kv_is_keyed_for_the_next_turn(model: Any, tokenizer: Any) -> None:
    with Engine(model, tokenizer, batching(engine_config())) as engine:
        first = [engine.submit(p, GREEDY) for p in prompts()]
        turns = [p + h.result().token_ids + [42, 43] for p, h in zip(prompts(), first, strict=True)]
        again = [engine.submit(t, GREEDY).result() for t in turns]
    for out, turn in zip(again, turns, strict=True):
        # Chunks sealed during batched decode carry their token ids: the turn reuses them.
        assert out.reused_tokens == ((len(turn) - 1) // CHUNK) * CHUNK
        assert out.token_ids == reference_tokens(model, turn, 20)


def test_preemption_with_a_small_budget_keeps_the_tokens(model: Any, tokenizer: Any) -> None:
    base = engine_config()
    config = batching(
        base,
        device_budget_bytes=2 * base.cache.device_budget_bytes,  # two sequences at a time
        preempt_after_s=0.02,  # take turns: every 20 ms the youngest yields
    )
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with Engine(model, tokenizer, config) as engine:
        handles = [engine.submit(p, params) for p in prompts()]
        outs = [h.result() for h in handles]
        stats = engine.stats()
    for out, prompt in zip(outs, prompts(), strict=True):
        assert out.token_ids == reference_tokens(model, prompt, 40)
    assert stats.preemptions > 0
    assert stats.max_decode_batch == 2
    assert stats.requests_finished == len(LENGTHS) and stats.queue_depth == 0


def test_queued_requests_prefetch_their_cached_chunks_from_disk(
    model: Any, tokenizer: Any, tmp_path: Path
) -> None:
    disk = str(tmp_path / "kv")
    cached = [list(range(1000 + 50 * i, 1000 + 50 * i + 3 * CHUNK + 5)) for i in range(3)]
    with Engine(model, tokenizer, engine_config(disk_dir=disk)) as engine:
        for prompt in cached:
            engine.submit(prompt, GREEDY).result()
    config = batching(engine_config(disk_dir=disk), max_batch_size=2)
    long = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    with Engine(model, tokenizer, config) as engine:
        busy = [engine.submit(p, long) for p in prompts()[:2]]  # these two hold the batch
        waiting = [engine.submit(p, GREEDY) for p in cached]
        outs = [h.result() for h in waiting]
        assert all(h.result().finish_reason == "length" for h in busy)
        stats = engine.stats()
    assert stats.prefetched_chunks == 3 * 3
    assert stats.manager is not None
    assert stats.manager.links["host<->disk"].steps >= 9
    for out, prompt in zip(outs, cached, strict=True):
        assert out.reused_tokens == 3 * CHUNK
        assert out.token_ids == reference_tokens(model, prompt, 20)
    # Loaded while the first two decoded: found in host at admission, not on disk.
    assert stats.reused_tokens_by_tier.get("host", 0) > 0


def test_cancel_and_close_without_drain(model: Any, tokenizer: Any) -> None:
    engine = Engine(model, tokenizer, batching(engine_config()))
    long = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    handles = [engine.submit(p, long) for p in prompts()]
    next(iter(handles[0]))
    handles[1].cancel()
    engine.close(drain=False)
    reasons = [h.result().finish_reason for h in handles]
    assert reasons == ["cancelled"] * len(LENGTHS)


def test_llm_with_batching_and_sampling(model: Any, tokenizer: Any) -> None:
    params = SamplingParams(temperature=0.9, top_k=50, max_tokens=12, seed=3)
    with LLM(model, tokenizer=tokenizer, config=engine_config(max_batch_size=1)) as serial:
        expected = serial.generate(prompts(), params)
    with LLM(model, tokenizer=tokenizer, config=batching(engine_config())) as batched:
        outs = batched.generate(prompts(), params)
    # Each request samples with its own generator: batching does not change its tokens.
    assert [o.token_ids for o in outs] == [e.token_ids for e in expected]


def test_config_rejects_bad_batching_fields() -> None:
    with pytest.raises(ValueError, match="max_batch_size"):
        EngineConfig(max_batch_size=0)
    with pytest.raises(ValueError, match="device_budget_bytes"):
        EngineConfig(device_budget_bytes=1)
    with pytest.raises(ValueError, match="prefill_tokens_per_step"):
        EngineConfig(prefill_tokens_per_step=0)
    with pytest.raises(ValueError, match="preempt_after_s"):
        EngineConfig(preempt_after_s=-1.0)
    config = EngineConfig(max_batch_size=8)
    assert config.max_running == 8
    assert (
        EngineConfig(
            max_batch_size=8, device_budget_bytes=3 * config.cache.device_budget_bytes
        ).max_running
        == 3
    )


def test_a_failing_sequence_fails_alone_and_the_batch_goes_on(
    model: Any, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every forward that carries a piece of the faulty prompt raises, packed with the
    # other sequences' tokens.
    inject_fault(monkeypatch, model)
    with Engine(model, tokenizer, engine_config()) as engine:
        good = [engine.submit(p, GREEDY) for p in prompts()[:3]]
        bad = engine.submit([FAULT_TOKEN] * 40, SamplingParams(temperature=0, max_tokens=4))
        with pytest.raises(RuntimeError, match="injected fault"):
            bad.result()
        outs = [h.result() for h in good]
        stats = engine.stats()
    monkeypatch.undo()
    for out, prompt in zip(outs, prompts()[:3], strict=True):
        assert out.token_ids == reference_tokens(model, prompt, 20)
    assert stats.isolated_failures >= 1
    assert (stats.requests_failed, stats.requests_finished) == (1, 3)
