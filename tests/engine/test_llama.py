"""kvtier's own Llama-family forward: greedy tokens equal transformers' on every model of
the family (mixed lengths batched, preemption, prefix reuse), and the engine picks the
runner by architecture."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from kvtier import native
from kvtier.codec import get_codec
from kvtier.engine import Engine, EngineConfig, SamplingParams
from kvtier.engine.linear import MEASURED_ROWS
from kvtier.engine.llama import LlamaModel
from kvtier.engine.runner import LlamaRunner, ModelRunner, make_runner
from kvtier.kv.layout import KVLayout
from kvtier.models import random_model
from kvtier.runtime import DecodeBatch
from tests.engine.tiny import CHUNK, engine_config, record_one_call_steps, reference_tokens

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LENGTHS = (5, 23, 40, 70, 33)

FAMILY: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen2": {},  # q/k/v with bias
    "qwen3": {},  # RMSNorm on q and k per head
    "mistral (sliding window 24)": {"sliding_window": 24},
    "qwen2 (sliding layers)": {
        "use_sliding_window": True,
        "sliding_window": 24,
        "max_window_layers": 1,
    },
    # head dims kvtier's fused prefill attention is compiled for (the others take segments)
    "llama (head dim 64)": {"head_dim": 64},
    "qwen2 (head dim 128, 4 query heads per KV head)": {
        "head_dim": 128,
        "num_attention_heads": 8,
    },
    "llama (bias, rope scaling)": {
        "attention_bias": True,
        "mlp_bias": True,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
}


def family_model(name: str, tokenizer: Any) -> Any:
    return random_model(name.split()[0], seed=3, vocab_size=len(tokenizer), **FAMILY[name])


def prompts() -> list[list[int]]:
    return [list(range(200 + 11 * i, 200 + 11 * i + n)) for i, n in enumerate(LENGTHS)]


@pytest.mark.parametrize("kernels", ["native", "torch"])
@pytest.mark.parametrize("name", list(FAMILY))
def test_batched_greedy_tokens_equal_transformers(
    name: str, kernels: str, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With kvtier's CPU kernels and with torch's ops only (``KVTIER_NATIVE=0``)."""
    monkeypatch.setenv(native.ENV_SWITCH, "1" if kernels == "native" else "0")
    model = family_model(name, tokenizer)
    expected = [reference_tokens(model, p, 12) for p in prompts()]
    config = dataclasses.replace(engine_config(), runner="kvtier")
    with Engine(model, tokenizer, config) as engine:
        assert isinstance(engine.runner, LlamaRunner)
        assert (engine.runner.llama.ops is not None) == (kernels == "native")
        outs = [h.result() for h in [engine.submit(p, GREEDY) for p in prompts()]]
        # The next turn reuses the first turn's chunks (prefix hit) and stays exact.
        turn = prompts()[3] + outs[3].token_ids + [77, 78]
        again = engine.submit(turn, GREEDY).result()
    assert [o.token_ids for o in outs] == expected
    assert again.reused_tokens == ((len(turn) - 1) // CHUNK) * CHUNK
    assert again.token_ids == reference_tokens(model, turn, 12)


@pytest.mark.parametrize("on_host", [False, True], ids=["streamed", "on-host"])
def test_contexts_past_the_device_budget_stay_exact(
    on_host: bool, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """3 chunks of device budget per sequence, prompts of up to 14 chunks: the rest is
    streamed over the link, or attended in the host pool where it lies (decode rows then
    take the batched kernel and merge the other part, where the kernels are built)."""
    merged: dict[str, int] = {"host": 0, "stream": 0}
    originals = {"host": DecodeBatch._merge_hosted, "stream": DecodeBatch._merge_streamed}

    def counting(name: str) -> Any:
        def counted(self: DecodeBatch, *args: Any) -> None:
            merged[name] += len(self.hosted if name == "host" else self.streamed)
            originals[name](self, *args)

        return counted

    monkeypatch.setattr(DecodeBatch, "_merge_hosted", counting("host"))
    monkeypatch.setattr(DecodeBatch, "_merge_streamed", counting("stream"))
    model = family_model("llama (head dim 64)", tokenizer)
    base = engine_config()
    chunk_nbytes = KVLayout.from_model_config(model.config, torch.float32, CHUNK).chunk_nbytes
    cache = dataclasses.replace(
        base.cache, device_budget_bytes=3 * chunk_nbytes, placement="host" if on_host else "stream"
    )
    config = dataclasses.replace(base, runner="kvtier", cache=cache)
    long_prompts = [list(range(300 + 7 * i, 300 + 7 * i + n)) for i, n in enumerate((150, 230))]
    with Engine(model, tokenizer, config) as engine:
        outs = [h.result() for h in [engine.submit(p, GREEDY) for p in long_prompts]]
        decided = engine.stats().cache.decided_chunks
    assert [o.token_ids for o in outs] == [reference_tokens(model, p, 12) for p in long_prompts]
    assert decided.get("host" if on_host else "stream", 0) > 0
    assert decided.get("stream" if on_host else "host", 0) == 0
    placed = "host" if on_host else "stream"
    assert merged[placed] > 0 or native.ops() is None  # the batched kernel took the rows
    assert merged["stream" if on_host else "host"] == 0


@pytest.mark.parametrize("name", ["llama", "qwen2", "llama (bias, rope scaling)"])
def test_one_call_for_a_decode_steps_layers_gives_the_loops_bits(
    name: str, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``kvtier_cpu::decode_layers`` (every layer of a decode-only step in one call) and the
    layer loop give the same logits, bit for bit, at every step of a batched generation."""
    if native.ops() is None:
        pytest.skip("kvtier's CPU kernels are not built here")
    fused_steps = record_one_call_steps(monkeypatch)
    model = family_model(name, tokenizer)
    MEASURED_ROWS[model] = {torch.get_num_threads(): 64}  # linear_panels up to 64 rows
    config = dataclasses.replace(engine_config(), runner="kvtier")
    logits: dict[bool, list[torch.Tensor]] = {}
    for fuse in (True, False):
        steps: list[torch.Tensor] = []
        with Engine(model, tokenizer, config) as engine:
            assert isinstance(engine.runner, LlamaRunner)
            llama = engine.runner.llama
            assert llama.decode_weights is not None
            llama.fuse_decode = fuse
            forward = llama.forward

            def keep(
                *args: Any, forward: Any = forward, steps: Any = steps, **kwargs: Any
            ) -> torch.Tensor:
                out: torch.Tensor = forward(*args, **kwargs)
                steps.append(out.clone())
                return out

            monkeypatch.setattr(llama, "forward", keep)
            for handle in [engine.submit(p, GREEDY) for p in prompts()]:
                handle.result()
        logits[fuse] = steps
    assert any(fused_steps)  # decode steps took the one call
    assert len(logits[True]) == len(logits[False])
    for fused, looped in zip(logits[True], logits[False], strict=True):
        assert torch.equal(fused, looped)


@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_the_last_layer_runs_its_mlp_on_the_sampled_rows_only(
    kernels: str, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step of three prompts that samples two rows: the last layer's o-projection and MLP
    see those two rows, the other layers all 60, and the two rows' logits are the ones the
    same step gives when every row's logits are wanted."""
    monkeypatch.setenv(native.ENV_SWITCH, "1" if kernels == "native" else "0")
    model = family_model("qwen2", tokenizer)
    llama = LlamaModel(model)
    assert (llama.ops is not None) == (kernels == "native")
    rows_seen: list[list[int]] = [[] for _ in llama.layers]

    class Counted:
        def __init__(self, linear: Any, seen: list[int]) -> None:
            self.linear, self.seen = linear, seen

        def __call__(self, x: torch.Tensor, low_out: bool = False) -> torch.Tensor:
            self.seen.append(x.shape[0])
            return self.linear(x, low_out)  # type: ignore[no-any-return]

    llama.layers = [
        dataclasses.replace(layer, o=Counted(layer.o, seen), gate_up=Counted(layer.gate_up, seen))
        for layer, seen in zip(llama.layers, rows_seen, strict=True)
    ]
    spans = [(0, 20), (20, 25), (45, 15)]
    ids = torch.tensor([(300 + 7 * i) % 1000 for i in range(60)])
    positions = torch.cat([torch.arange(n) for _, n in spans])
    sampled = torch.tensor([19, 59])  # the first and last spans end their prompts here
    with torch.no_grad():
        logits = llama.forward(ids, positions, None, spans, sampled)
        every = llama.forward(ids, positions, None, spans, torch.arange(60))
    assert logits.shape == (2, model.config.vocab_size)
    assert rows_seen[-1] == [2, 2, 60, 60]  # o and gate_up: sampled rows, then every row
    assert all(seen == [60, 60, 60, 60] for seen in rows_seen[:-1])
    torch.testing.assert_close(logits, every[sampled], rtol=1e-5, atol=1e-5)


def test_preemption_keeps_the_tokens(tokenizer: Any) -> None:
    model = family_model("qwen3", tokenizer)
    base = engine_config()
    config = dataclasses.replace(
        base,
        runner="kvtier",
        device_budget_bytes=2 * base.cache.device_budget_bytes,  # two sequences at a time
        preempt_after_s=0.0,
    )
    with Engine(model, tokenizer, config) as engine:
        outs = [h.result() for h in [engine.submit(p, GREEDY) for p in prompts()]]
        preemptions = engine.stats().preemptions
    assert preemptions > 0
    assert [o.token_ids for o in outs] == [reference_tokens(model, p, 12) for p in prompts()]


def test_the_engine_picks_the_runner_by_architecture(tokenizer: Any) -> None:
    llama = family_model("llama", tokenizer)
    device = next(llama.parameters()).device
    assert isinstance(make_runner(llama, device), LlamaRunner)
    assert isinstance(make_runner(llama, device, "transformers"), ModelRunner)
    phi3 = random_model("phi3", seed=1, vocab_size=len(tokenizer))
    assert isinstance(make_runner(phi3, device), ModelRunner)  # not the family: transformers
    reason = LlamaModel.why_not(phi3)
    assert reason is not None and "phi3" in reason
    with pytest.raises(ValueError, match="cannot run this model: model type 'phi3'"):
        make_runner(phi3, device, "kvtier")
    with pytest.raises(ValueError, match="runner: unknown"):
        make_runner(llama, device, "fast")
    with pytest.raises(ValueError, match="runner: unknown 'fast'"):
        EngineConfig(runner="fast")


def test_an_int8_host_streams_encoded_bytes_and_serves_the_next_turn(tokenizer: Any) -> None:
    """The engine over a host tier in int8: chunks past a 3-chunk budget stream from it as
    int8 (a quarter of the link bytes of a raw host, plus scales), and the same prompt again
    adopts its chunks from it, decoded. Tokens are the codec's (``bench codec`` measures
    them), so this checks the path, not token equality."""
    model = family_model("llama (head dim 64)", tokenizer)
    base = engine_config()
    layout = KVLayout.from_model_config(model.config, torch.float32, CHUNK)
    link_bytes: dict[str, int] = {}
    long_prompt = list(range(300, 450))
    for codec in ("raw", "int8"):
        cache = dataclasses.replace(base.cache, device_budget_bytes=3 * layout.chunk_nbytes)
        host = dataclasses.replace(base.manager.host, codec=codec)
        manager = dataclasses.replace(base.manager, host=host)
        config = dataclasses.replace(base, runner="kvtier", cache=cache, manager=manager)
        with Engine(model, tokenizer, config) as engine:
            first = engine.submit(long_prompt, GREEDY).result()
            again = engine.submit(long_prompt, GREEDY).result()
            stats = engine.stats()
        assert len(first.token_ids) == len(again.token_ids) == 12
        assert stats.cache.decided_chunks.get("stream", 0) > 0
        assert again.reused_tokens >= 8 * CHUNK and stats.reused_tokens_by_tier["host"] > 0
        link_bytes[codec] = stats.cache.link.bytes
        if codec == "raw":
            assert first.token_ids == reference_tokens(model, long_prompt, 12)
    stored = get_codec("int8").encoded_nbytes(layout) / layout.chunk_nbytes
    assert link_bytes["int8"] == pytest.approx(stored * link_bytes["raw"], rel=0.05)
