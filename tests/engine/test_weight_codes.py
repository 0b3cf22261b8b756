"""Exact low-bit codes of GGUF-dequantised weights: found only where they rebuild every
weight, multiplied bit for bit as the float32 panels multiply, and a model made of them
gives transformers' tokens."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from kvtier import native
from kvtier.engine import Engine, SamplingParams
from kvtier.engine.linear import CODES_ROWS_MAX, CODES_ROWS_MAX_BF16, MEASURED_ROWS
from kvtier.engine.llama import LlamaModel
from kvtier.engine.runner import LlamaRunner
from kvtier.engine.weight_codes import CODE_K, WeightCodes, find_codes, pack_code_panels
from tests.engine.tiny import (
    engine_config,
    record_one_call_steps,
    reference_tokens,
    tiny_model,
)

ops = native.ops()
NAMES = ("qkv", "o", "gate_up", "down")
needs_kernels = pytest.mark.skipif(ops is None, reason="kvtier's CPU kernels are not built")


def gguf_like(weight: torch.Tensor, bits: int) -> torch.Tensor:
    """``weight`` quantised and dequantised as GGUF's Q4_1 (4 bits: float16 scale and
    minimum per 32 inputs) or Q8_0 (8 bits: float16 scale, codes -127..127) do it."""
    rows, cols = weight.shape
    pad = -cols % CODE_K
    padded = torch.cat([weight, weight[:, -1:].expand(rows, pad)], dim=1) if pad else weight
    w = padded.reshape(rows, -1, CODE_K)
    if bits == 4:
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        d, m = ((hi - lo) / 15).half().float(), lo.half().float()
        q = torch.round((w - m) / torch.where(d == 0, 1.0, d)).clamp(0, 15)
        out = d * q + m
    else:
        d = (w.abs().amax(-1, keepdim=True) / 127).half().float()
        out = d * torch.round(w / torch.where(d == 0, 1.0, d)).clamp(-127, 127)
    return out.reshape(rows, -1)[:, :cols].contiguous()


def weight(rows: int, cols: int, bits: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=gen) * 0.1
    w[1, :CODE_K] = 0.25  # a constant block (4 bits: d = 0)
    w[2] = 0.0  # a zero row
    return gguf_like(w, bits)


def codes_of(w: torch.Tensor) -> WeightCodes:
    """``w``'s codes, which it must have."""
    codes = find_codes(w)
    assert codes is not None
    return codes


PANEL_SHAPES = [(96, 64), (40, 70), (17, 33), (960, 576)]
"""Weights the kernels multiply: whole and partial groups of panels and blocks of inputs."""


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", [(96, 64), (40, 70), (17, 33), (200, 576)])
def test_codes_rebuild_every_weight(shape: tuple[int, int], bits: int) -> None:
    w = weight(*shape, bits)
    codes = find_codes(w)
    assert codes is not None and codes.bits == bits
    rebuilt = codes.scale.repeat_interleave(CODE_K, 1) * codes.codes.float()
    rebuilt = (rebuilt + codes.offset.repeat_interleave(CODE_K, 1))[:, : shape[1]]
    assert torch.equal(rebuilt, w)
    assert int(codes.codes.max()) < 1 << bits


def test_weights_without_exact_codes_keep_float32() -> None:
    assert find_codes(torch.randn(100, 64)) is None  # trained in float32
    w = weight(64, 64, 4)
    assert find_codes(w.to(torch.bfloat16)) is None
    for bad in (float("nan"), float("inf")):
        broken = w.clone()
        broken[70 % 64, 5] = bad
        assert find_codes(broken) is None
    tall = weight(192, 64, 4)  # one value an ulp off its code, past the rows probed first
    tall[150, 9] = torch.nextafter(tall[150, 9], torch.tensor(1.0))
    assert find_codes(tall) is None


@needs_kernels
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", PANEL_SHAPES)
def test_code_panels_multiply_as_float32_panels_bit_for_bit(
    shape: tuple[int, int], bits: int
) -> None:
    """Every row count of the decode kernels (the in-register tiles up to 8 rows, the
    widened lines in turns above, more than one 64-row chunk), with and without bias."""
    assert ops is not None
    w = weight(*shape, bits)
    coded, plain = pack_code_panels(codes_of(w)), ops.pack_panels(w)
    assert coded.dtype == torch.uint8
    bias = torch.randn(shape[0])
    gen = torch.Generator().manual_seed(1)
    for rows in (1, 2, 3, 5, 8, 9, 16, 33, 64, 70):
        x = torch.randn(rows, shape[1], generator=gen)
        for b in (None, bias):
            got = ops.linear_panels(x, coded, b, shape[0])
            want = ops.linear_panels(x, plain, b, shape[0])
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (rows, b is None)


@needs_kernels
def test_malformed_code_panels_are_refused() -> None:
    assert ops is not None
    coded = pack_code_panels(codes_of(weight(48, 64, 4)))
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="code panels must be"):
        ops.linear_panels(x, coded[..., :-1].contiguous(), None, 48)
    with pytest.raises(RuntimeError, match="must match x's I"):
        ops.linear_panels(torch.randn(2, 96), coded, None, 48)
    with pytest.raises(RuntimeError, match="take scales, and only they"):
        ops.linear_panels(x, coded, None, 48, torch.ones(48))


@needs_kernels
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", PANEL_SHAPES)
def test_bf16_code_panels_multiply_the_rounded_input_and_the_exact_weight(
    shape: tuple[int, int], bits: int
) -> None:
    """bf16 mode's code panels: x rounded to bf16 times the weight as it is (not rounded),
    summed in float32: within float32's rounding of the terms the kernel sums (x times
    ``d * (offset + u)``: 4 bits, ``128 + u``; 8 bits, ``2176 + u``), at every tile size
    (4 rows) and past it."""
    assert ops is not None
    w = weight(*shape, bits)
    codes = codes_of(w)
    coded = pack_code_panels(codes, bf16=True)
    assert coded.dtype == torch.uint8 and coded.shape[2:] == (3, 1 + bits, 64)
    assert not torch.equal(coded.flatten(-2), pack_code_panels(codes))  # the unpacks' order
    scale = codes.scale.double().repeat_interleave(CODE_K, 1)[:, : shape[1]]
    top = 128 + 16 if bits == 4 else 2176 + 256  # the largest offset + u
    bias = torch.randn(shape[0])
    gen = torch.Generator().manual_seed(2)
    for rows in (1, 2, 3, 4, 5, 8, 9):
        x = torch.randn(rows, shape[1], generator=gen)
        xr = x.bfloat16().double()
        for b in (None, bias):
            got = ops.linear_panels(x, coded, b, shape[0]).double()
            want = xr @ w.double().T
            size = xr.abs() @ (w.double().abs() + top * scale).T
            if b is not None:
                want, size = want + b.double(), size + b.double().abs()
            assert ((got - want).abs() <= 2e-6 * size + 1e-30).all(), (rows, b is None)
    rounded = ops.linear_panels(x, ops.pack_panels(w.bfloat16()), None, shape[0]).double()
    assert not torch.equal(rounded, got)  # the bf16 panels hold the rounded weight


@needs_kernels
def test_malformed_bf16_code_panels_are_refused() -> None:
    assert ops is not None
    coded = pack_code_panels(codes_of(weight(48, 64, 4)), bf16=True)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="bf16 code panels must be"):
        ops.linear_panels(x, coded[..., :-1, :].contiguous(), None, 48)
    with pytest.raises(RuntimeError, match="must match x's I"):
        ops.linear_panels(torch.randn(2, 96), coded, None, 48)


def coded_model(tokenizer: Any, seed: int) -> Any:
    """The tiny llama with every projection in Q4_1's values and the embedding (tied head)
    in Q8_0's, as a GGUF file's dequantised weights are."""
    model = tiny_model(tokenizer, seed=seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2:
                param.copy_(gguf_like(param, 8 if "embed" in name or "lm_head" in name else 4))
    return model


@needs_kernels
def test_a_coded_model_gives_transformers_tokens(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Code panels in every projection and the head, greedy tokens equal transformers' for
    prompts decoded together (``decode_layers`` on the code panels) and alone, and a
    forward's logits are bit for bit those of the float32 panels; with
    ``KVTIER_WEIGHT_CODES=0`` the model has no code panels."""
    model = coded_model(tokenizer, seed=6)
    MEASURED_ROWS[model] = {torch.get_num_threads(): 64}
    llama = LlamaModel(model)
    linears = [x for layer in llama.layers for x in layer.projections()] + [llama.lm_head]
    assert all(x.codes is not None and x.codes.dtype == torch.uint8 for x in linears)
    assert llama.decode_codes is not None and llama.greedy_head is None
    n = len(linears)
    assert f"; {n} of {n} projections read from their exact weight codes (" in llama.codes_line()
    assert llama.codes_line().endswith(f"up to {CODES_ROWS_MAX} rows")
    spans = [(0, 3), (3, 2), (5, 3)]  # 8 rows: every projection on the code panels
    ids = torch.tensor([(500 + 13 * i) % 200 for i in range(8)])
    positions = torch.cat([torch.arange(n) for _, n in spans])
    rows = torch.tensor([2, 4, 7])
    coded = llama.forward(ids, positions, None, spans, rows)
    plain = dataclasses.replace(llama.lm_head, codes=None)
    with_plain = LlamaModel.__new__(LlamaModel)
    with_plain.__dict__.update(llama.__dict__, lm_head=plain, decode_codes=None)
    with_plain.layers = [
        dataclasses.replace(
            layer, **{n: dataclasses.replace(getattr(layer, n), codes=None) for n in NAMES}
        )
        for layer in llama.layers
    ]
    assert torch.equal(coded, with_plain.forward(ids, positions, None, spans, rows))
    one_call = record_one_call_steps(monkeypatch)
    config = dataclasses.replace(engine_config(), runner="kvtier")
    prompts = [list(range(300 + 7 * i, 330 + 11 * i)) for i in range(3)]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with Engine(model, tokenizer, config) as engine:
        assert isinstance(engine.runner, LlamaRunner)
        futures = [engine.submit(p, greedy) for p in prompts]
        got = [f.result().token_ids for f in futures]
    assert got == [reference_tokens(model, p, 12) for p in prompts]
    assert any(rows > 1 for rows in one_call)
    monkeypatch.setenv("KVTIER_WEIGHT_CODES", "0")
    plain_model = LlamaModel(model)
    assert plain_model.layers[0].qkv.codes is None and plain_model.codes_line() == ""


@needs_kernels
def test_the_bf16_mode_multiplies_few_rows_on_bf16_code_panels(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In bf16 mode a coded model keeps bf16 code panels beside its bf16 panels: decode steps
    of up to ``CODES_ROWS_MAX_BF16`` rows multiply the exact weights (x rounded), so their
    log-probabilities stay as close to the float32 engine's as the bf16 panels' do."""
    model = coded_model(tokenizer, seed=7)
    MEASURED_ROWS[model] = {torch.get_num_threads(): 64}
    llama = LlamaModel(model, torch.bfloat16)
    linears = [x for layer in llama.layers for x in layer.projections()] + [llama.lm_head]
    assert all(x.codes is not None and x.codes.dim() == 5 for x in linears)
    assert all(x.panels is not None and x.panels.dtype == torch.bfloat16 for x in linears)
    assert llama.codes_rows_max == CODES_ROWS_MAX_BF16 and llama.decode_codes is not None
    one_call = record_one_call_steps(monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    prompts = [list(range(200 + 11 * i, 200 + 11 * i + n)) for i, n in enumerate((9, 40))]
    runs = {}
    for dtype in (None, "bfloat16"):
        config = dataclasses.replace(engine_config(), runner="kvtier", matmul_dtype=dtype)
        one_call.clear()
        with Engine(model, tokenizer, config) as engine:
            futures = [engine.submit(p, params) for p in prompts]
            runs[dtype] = [f.result() for f in futures]
            assert isinstance(engine.runner, LlamaRunner)
            most = CODES_ROWS_MAX if dtype is None else CODES_ROWS_MAX_BF16
            assert engine.runner.llama.codes_rows_max == most
        assert one_call  # decode steps in one call, on the code panels (at most 2 rows)
    for exact, low in zip(runs[None], runs["bfloat16"], strict=True):
        first = exact.logprobs[0].logprob, low.logprobs[0].logprob
        assert abs(first[0] - first[1]) < 0.05
    assert runs[None][0].token_ids == reference_tokens(model, prompts[0], 8)
