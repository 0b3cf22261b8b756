"""Projections in bf16 (``EngineConfig.matmul_dtype``): each projection is oneDNN's bf16
product of the rounded input and weight, the engine's tokens follow the float32 engine's
closely but not exactly, and the option is refused where it cannot apply."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from kvtier import native
from kvtier.engine import Engine, EngineConfig, SamplingParams
from kvtier.engine.linear import make_linear
from kvtier.engine.llama import LlamaModel
from kvtier.engine.runner import make_runner
from kvtier.models import random_model
from kvtier.runtime import low_attend
from tests.engine.tiny import CHUNK, engine_config, reference_tokens, tiny_model

ONEDNN = torch.backends.mkldnn.is_available() and hasattr(
    torch.ops.mkldnn, "_reorder_linear_weight"
)


@pytest.mark.skipif(not ONEDNN, reason="needs torch's oneDNN")
def test_a_bf16_projection_is_the_product_of_the_rounded_input_and_weight() -> None:
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(96, 64, generator=gen), torch.randn(96, generator=gen)
    linear = make_linear(weight, bias, None, torch.bfloat16)
    assert linear.matmul_dtype == torch.bfloat16 and linear.kernels is None
    for rows in (1, 3, 40):
        x = torch.randn(rows, 64, generator=gen)
        out = linear(x)
        assert out.dtype == torch.float32 and out.shape == (rows, 96)
        rounded = torch.nn.functional.linear(
            x.bfloat16().float(), weight.bfloat16().float(), bias.bfloat16().float()
        )  # float32 accumulation of the bf16 operands; the output is rounded to bf16
        torch.testing.assert_close(out, rounded, atol=0, rtol=2**-7)
        exact = torch.nn.functional.linear(x, weight, bias)
        assert not torch.equal(out, exact)


@pytest.mark.skipif(native.ops() is None, reason="needs kvtier's CPU kernels")
def test_few_rows_multiply_the_bf16_weight_and_the_rounded_input() -> None:
    """``linear_panels`` on a bf16 weight (pairs of k): the float32 sums of the bf16 input's
    and weight's products, as oneDNN's bf16 matmul above ``rows_max``."""
    gen = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(80, 64, generator=gen), torch.randn(80, generator=gen)
    linear = make_linear(weight, bias, native.ops(), torch.bfloat16)
    assert linear.kernels is not None and linear.panels is not None
    assert linear.panels.dtype == torch.bfloat16
    widened = (weight.bfloat16().double(), bias.bfloat16().double())
    for rows in (1, 2, 7, 8, 9, 16, 17, linear.rows_max):
        x = torch.randn(rows, 64, generator=gen)
        want = torch.nn.functional.linear(x.bfloat16().double(), *widened).float()
        torch.testing.assert_close(linear(x), want, atol=1e-5, rtol=1e-5)


def _logprob_runs(model: Any, tokenizer: Any, matmul_dtype: str | None) -> list[Any]:
    config = dataclasses.replace(engine_config(), runner="kvtier", matmul_dtype=matmul_dtype)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    prompts = [list(range(200 + 11 * i, 200 + 11 * i + n)) for i, n in enumerate((9, 40, 70))]
    with Engine(model, tokenizer, config) as engine:
        return [h.result() for h in [engine.submit(p, params) for p in prompts]]


@pytest.mark.skipif(not ONEDNN, reason="needs torch's oneDNN")
def test_the_engine_in_bf16_projections_stays_close_to_float32(tokenizer: Any) -> None:
    model = tiny_model(tokenizer, seed=4)
    exact = _logprob_runs(model, tokenizer, None)
    low = _logprob_runs(model, tokenizer, "bfloat16")
    prompt = list(range(200, 209))
    assert exact[0].token_ids == reference_tokens(model, prompt, 8)  # float32 stays exact
    pairs = zip(exact, low, strict=True)
    first = [(a.logprobs[0].logprob, b.logprobs[0].logprob) for a, b in pairs]
    assert all(abs(a - b) < 0.05 for a, b in first)  # the first token's log-probability
    assert any(a != b for a, b in first)  # and it is another computation


@pytest.mark.skipif(not ONEDNN, reason="needs torch's oneDNN")
def test_the_bf16_mode_keeps_the_kv_in_bf16_and_a_next_turn_reuses_it(tokenizer: Any) -> None:
    """Every tier holds bf16 chunks (half the bytes); a next turn adopts the first turn's
    chunks and decodes on them (kvtier's decode kernel reads the bf16 slab)."""
    model = tiny_model(tokenizer, seed=4)
    config = dataclasses.replace(engine_config(), runner="kvtier", matmul_dtype="bfloat16")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    first = list(range(300, 300 + 5 * CHUNK + 3))
    with Engine(model, tokenizer, config) as engine:
        assert engine.manager.layout.dtype == torch.bfloat16
        assert engine.manager.host.pool.dtype == torch.bfloat16
        one = engine.submit(first, params).result()
        turn = first + one.token_ids + [17, 18]
        two = engine.submit(turn, params).result()
    assert two.reused_tokens == ((len(turn) - 1) // CHUNK) * CHUNK > 0
    assert len(two.token_ids) == 6 and all(abs(p.logprob) < 30 for p in two.logprobs)


@pytest.mark.skipif(not ONEDNN, reason="needs torch's oneDNN")
def test_a_float32_manager_is_refused_by_a_bf16_engine_in_one_line(tokenizer: Any) -> None:
    """A shared manager must hold the engine's KV dtype: bf16 mode keeps bf16 chunks."""
    model = tiny_model(tokenizer)
    base = dataclasses.replace(engine_config(), runner="kvtier")
    with Engine(model, tokenizer, base) as engine:
        config = dataclasses.replace(base, matmul_dtype="bfloat16")
        with pytest.raises(ValueError, match=r"KV dtype \(bfloat16 under EngineConfig"):
            Engine(model, tokenizer, config, manager=engine.manager)


def test_matmul_dtype_is_checked_in_one_line(tokenizer: Any) -> None:
    with pytest.raises(ValueError, match=r"matmul_dtype: unknown 'float16'; accepted"):
        EngineConfig(matmul_dtype="float16")
    neox = random_model("gpt_neox", vocab_size=len(tokenizer))
    with pytest.raises(ValueError, match="matmul_dtype: only kvtier's own forward"):
        make_runner(neox, torch.device("cpu"), "auto", torch.bfloat16)
    llama = tiny_model(tokenizer)
    with pytest.raises(ValueError, match="matmul_dtype: only kvtier's own forward"):
        make_runner(llama, torch.device("cpu"), "transformers", torch.bfloat16)
    runner = make_runner(llama, torch.device("cpu"), "auto", torch.bfloat16)
    assert "projections in bfloat16" in runner.name


@pytest.mark.skipif(not ONEDNN or native.ops() is None, reason="needs oneDNN and kvtier's kernels")
@pytest.mark.parametrize("dots", [True, False])
def test_a_long_prompt_attends_in_bf16_and_stays_close_to_float32(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch, dots: bool
) -> None:
    """A 1,100-token prompt on a head-dim-64 llama: in bf16 its passes take kvtier's bf16
    kernel over the bf16 KV where the CPU has bf16 dot products (AMX, AVX-512 BF16), else
    torch's bf16 flash kernel (every layer); in float32 kvtier's own; the first token's
    log-probability stays close."""
    if dots and not native.bf16_prefill():
        pytest.skip("this CPU (or build) has no bf16 dot products")
    if not dots:
        monkeypatch.setattr(native, "bf16_prefill", lambda: "")
    model = random_model("llama", seed=5, vocab_size=len(tokenizer), head_dim=64)
    passes: list[tuple[int, int]] = []
    real = low_attend.attend_prefill_low

    def counted(query: torch.Tensor, k_old: torch.Tensor, *args: Any) -> None:
        passes.append((query.shape[1], k_old.shape[1]))
        real(query, k_old, *args)

    monkeypatch.setattr(low_attend, "attend_prefill_low", counted)
    base = engine_config()
    cache = dataclasses.replace(base.cache, device_budget_bytes=64 * base.cache.device_budget_bytes)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
    prompt = [(300 + 7 * i) % 4000 for i in range(1100)]
    runs = []
    for low in (None, "bfloat16"):
        config = dataclasses.replace(
            base, runner="kvtier", matmul_dtype=low, cache=cache, prefill_tokens_per_step=2048
        )
        with Engine(model, tokenizer, config) as engine:
            runs.append(engine.submit(prompt, params).result())
        assert len(passes) == (0 if low is None or dots else model.config.num_hidden_layers)
    assert dots or passes[0] == (1100, 0)  # the whole prompt in one pass, over no earlier keys
    exact, rounded = (run.logprobs[0].logprob for run in runs)  # the prompt's next token
    assert abs(exact - rounded) < 0.05 and exact != rounded


@pytest.mark.skipif(not ONEDNN or native.ops() is None, reason="needs oneDNN and kvtier's kernels")
def test_bf16_activations_between_the_ops_give_the_same_bits(tokenizer: Any) -> None:
    """A prefill step oneDNN multiplies: handing the projections bf16 activations (the
    norms round, o / gate_up / down stay bf16) gives the logits float32 activations give,
    since every projection rounds its input to bf16 anyway."""
    model = random_model("llama", seed=6, vocab_size=len(tokenizer), head_dim=64)
    llama = LlamaModel(model, torch.bfloat16)
    assert llama.low_activations
    ids = torch.tensor([(300 + 7 * i) % 4000 for i in range(300)])
    positions = torch.cat([torch.arange(150), torch.arange(150)])
    spans, rows = [(0, 150), (150, 150)], torch.tensor([149, 299])
    assert ids.shape[0] > llama.layers[0].gate_up.rows_max  # oneDNN takes the step
    with torch.no_grad():
        low = llama.forward(ids, positions, None, spans, rows)
        llama.low_activations = False
        wide = llama.forward(ids, positions, None, spans, rows)
    assert torch.equal(low, wide)
