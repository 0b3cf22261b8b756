"""kvtier's CPU kernels (``kvtier.native``) against torch's ops on the same inputs, their
input checks, and the on-disk cache that spares a second process the compile."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvtier import native

pytestmark = pytest.mark.skipif(native.ops() is None, reason=native.status().line())


def _ops():  # type: ignore[no-untyped-def]
    ops = native.ops()
    assert ops is not None
    return ops


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _decode_dots(kv_dtype: torch.dtype, dim: int) -> bool:
    """Whether decode_attend and attend_slots round queries and probabilities to bf16 (bf16
    KV, head dim 64 or 128, a CPU with bf16 dot products) or run float32 arithmetic."""
    return kv_dtype == torch.bfloat16 and dim in (64, 128) and bool(native.bf16_prefill())


def _assert_attention(
    out: torch.Tensor,
    lse: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    dots: bool,
) -> None:
    """out [..., D] and lse [...] against softmax(q k^T scale) v for queries q [..., D] over
    float32 keys and values k, v [..., K, D] (batch dims broadcast): float32 tolerances,
    or (dots) float64 attention of the rounded queries within the probabilities' rounding
    (2^-8 of each weight)."""
    if dots:
        q, k, v, scale = (q * scale).bfloat16().double(), k.double(), v.double(), 1.0
    scores = (q.unsqueeze(-2) @ k.transpose(-1, -2)).squeeze(-2) * scale  # [..., K]
    want = (scores.softmax(-1).unsqueeze(-2) @ v).squeeze(-2)
    if dots:
        assert (out.double() - want).abs().max().item() < 2**-8 * v.abs().max().item()
        torch.testing.assert_close(lse.double(), scores.logsumexp(-1), rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(out, want)
        torch.testing.assert_close(lse, scores.logsumexp(-1))


def test_rms_norm_with_and_without_the_residual_add() -> None:
    gen = torch.Generator().manual_seed(0)
    x, res = torch.randn(9, 576, generator=gen), torch.randn(9, 576, generator=gen)
    w = torch.randn(576, generator=gen)
    torch.testing.assert_close(_ops().rms_norm(x, w, 1e-5), _norm(x, w, 1e-5))
    summed = x.clone()
    y = _ops().add_rms_norm(summed, res, w, 1e-6)
    assert torch.equal(summed, x + res)  # the residual stream is updated in place
    torch.testing.assert_close(y, _norm(x + res, w, 1e-6))


def test_rope_in_place_on_a_strided_view() -> None:
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(5, 15 * 64, generator=gen)
    cos, sin = torch.randn(5, 64, generator=gen), torch.randn(5, 64, generator=gen)
    k = qkv[:, 9 * 64 : 12 * 64].view(5, 3, 64)  # a column range: strided rows
    half = torch.cat((-k[..., 32:], k[..., :32]), dim=-1)
    want = k * cos[:, None] + half * sin[:, None]
    untouched = qkv[:, 12 * 64 :].clone()
    _ops().rope_(k, cos, sin)
    torch.testing.assert_close(k, want)
    assert torch.equal(qkv[:, 12 * 64 :], untouched)


def test_silu_mul_over_the_whole_range() -> None:
    gate_up = torch.linspace(-120, 120, 2 * 3 * 512).view(3, 1024)
    want = F.silu(gate_up[:, :512]) * gate_up[:, 512:]
    torch.testing.assert_close(_ops().silu_mul(gate_up), want)


def test_norms_and_silu_mul_in_bf16_round_what_float32_gives() -> None:
    """bf16 mode's activations: a norm may take a bf16 residual (widened exactly) and round
    its output to bf16, silu_mul takes and gives bf16; each equals the float32 op on the
    widened input, rounded to nearest even as torch rounds."""
    gen = torch.Generator().manual_seed(3)
    x, res = torch.randn(40, 576, generator=gen), torch.randn(40, 576, generator=gen)
    w = torch.randn(576, generator=gen)
    assert torch.equal(_ops().rms_norm(x, w, 1e-5, True), _ops().rms_norm(x, w, 1e-5).bfloat16())
    low, wide = res.bfloat16(), res.bfloat16().float()
    summed_low, summed_wide = x.clone(), x.clone()
    y = _ops().add_rms_norm(summed_low, low, w, 1e-6, True)
    want = _ops().add_rms_norm(summed_wide, wide, w, 1e-6)
    assert torch.equal(summed_low, summed_wide) and torch.equal(y, want.bfloat16())
    for width in (1536, 150):  # 150: 4 steps of 32, then 22 (the scalar remainder)
        gate_up = (torch.randn(7, 2 * width, generator=gen) * 4).bfloat16()
        out = _ops().silu_mul(gate_up)
        assert out.dtype == torch.bfloat16
        assert torch.equal(out, _ops().silu_mul(gate_up.float()).bfloat16())


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("dim", [16, 64, 128])  # any head dim; 64, 128: kernels compiled for them
def test_decode_attend_stores_the_new_token_and_attends_each_rows_keys(
    groups: int, dim: int, kv_dtype: torch.dtype
) -> None:
    """Rows on seats 2 and 0 (not in seat order), one with a pool range longer than a
    work block, one with none; out rows not named stay untouched. A bf16 slab stores the
    new K/V rounded to nearest even; where the CPU has bf16 dot products (and the head dim
    is 64 or 128) the queries times the scale and the probabilities are rounded too
    (against float64 attention of the rounded queries, within the probabilities' rounding,
    2^-8 of each weight), else float32 arithmetic on the rounded K/V."""
    gen = torch.Generator().manual_seed(2)
    seats_n, layers, heads, slots, tokens = 3, 2, 2, 3, 256
    slab = torch.randn(seats_n, layers, 2, heads, 1 + slots, tokens, dim, generator=gen)
    slab = slab.to(kv_dtype)
    want_slab = slab.clone()
    n = 4
    query = torch.randn(heads * groups, n, dim, generator=gen)
    new_k, new_v = torch.randn(2, heads, n, dim, generator=gen)
    out = torch.full((n, heads * groups, dim), 7.0)
    lse = torch.full((n, heads * groups), 5.0)
    seats, rows = torch.tensor([2, 0]), torch.tensor([3, 1])
    tail_pos = torch.tensor([0, 200])
    lo, hi = torch.tensor([tokens, 2 * tokens]), torch.tensor([4 * tokens, 2 * tokens])
    _ops().decode_attend(slab, 1, seats, tail_pos, lo, hi, rows, query, new_k, new_v, out, lse, 0.3)
    for r in range(2):
        seat, row, pos = int(seats[r]), int(rows[r]), int(tail_pos[r])
        want_slab[seat, 1, 0, :, 0, pos] = new_k[:, row].to(kv_dtype)
        want_slab[seat, 1, 1, :, 0, pos] = new_v[:, row].to(kv_dtype)
        keys = want_slab[seat, 1, 0].reshape(heads, -1, dim).float()
        values = want_slab[seat, 1, 1].reshape(heads, -1, dim).float()
        visible = torch.cat([torch.arange(pos + 1), torch.arange(int(lo[r]), int(hi[r]))])
        q = query[:, row].reshape(heads, groups, dim)  # over k, v [Hkv, 1, K, D]
        k, v = keys[:, None, visible], values[:, None, visible]
        got, got_lse = out[row].view(heads, groups, dim), lse[row].view(heads, groups)
        _assert_attention(got, got_lse, q, k, v, 0.3, _decode_dots(kv_dtype, dim))
    assert torch.equal(slab, want_slab)
    assert (out[[0, 2]] == 7.0).all() and (lse[[0, 2]] == 5.0).all()


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "earlier", "new"),
    [
        (9, 3, 64, 0, 256),
        (9, 3, 64, 300, 70),
        (8, 2, 128, 64, 17),
        (4, 4, 64, 5, 1),
        (9, 3, 64, 0, 1061),  # a long pass, not a whole number of 128-key blocks
        (9, 3, 64, 2500, 300),  # many earlier keys, odd counts
        (8, 2, 128, 0, 333),  # head dim 128, 4 query heads a KV head
        (4, 2, 128, 129, 2),  # a 2-token pass, 14 idle lanes
        (16, 2, 64, 40, 33),  # 8 query heads a KV head: score tiles of 3, 3 and 2 vectors
        (7, 1, 64, 17, 150),  # 7 query heads a KV head: tiles of 3, 3 and 1
    ],
)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_attend_prefill_equals_masked_sdpa_on_strided_views(
    heads: int, kv_heads: int, dim: int, earlier: int, new: int, kv_dtype: torch.dtype
) -> None:
    """Earlier keys all visible, the pass's own keys causal; the query and the output are
    views with a row stride (as the runner passes them). bf16 K/V (strided too): float32
    arithmetic on their values."""
    torch.manual_seed(0)
    width = (heads + 2 * kv_heads) * dim
    q = torch.randn(new, width)[:, : heads * dim].view(new, heads, dim).transpose(0, 1)
    k_old, v_old = torch.randn(2, kv_heads, earlier + 3, dim).to(kv_dtype)[:, :, :earlier]
    k_new, v_new = torch.randn(2, kv_heads, new, dim).to(kv_dtype)
    out = torch.full((new + 1, heads + 1, dim), 7.0)
    _ops().attend_prefill(q, k_old, v_old, k_new, v_new, out[:new, :heads], dim**-0.5)
    mask = torch.ones(new, earlier + new, dtype=torch.bool)
    mask[:, earlier:] = torch.ones(new, new, dtype=torch.bool).tril()
    k, v = torch.cat([k_old, k_new], 1).float(), torch.cat([v_old, v_new], 1).float()
    want = F.scaled_dot_product_attention(
        q[None], k[None], v[None], attn_mask=mask, scale=dim**-0.5, enable_gqa=True
    )[0].transpose(0, 1)
    torch.testing.assert_close(out[:new, :heads], want, atol=2e-6, rtol=1e-5)
    assert (out[new:] == 7.0).all() and (out[:, heads:] == 7.0).all()  # nothing else written


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "earlier", "tail", "new"),
    [
        (9, 3, 64, 3840, 240, 16),  # a next turn: chunks, then the tail's 240 tokens, 16 new
        (9, 3, 64, 512, 100, 300),  # a pass longer than the tail before it
        (8, 2, 128, 0, 129, 2),  # no chunks: the tail's keys alone before the pass
        (4, 4, 64, 256, 1, 77),
    ],
)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_attend_prefill_sees_the_tails_earlier_keys_too(
    heads: int, kv_heads: int, dim: int, earlier: int, tail: int, new: int, kv_dtype: torch.dtype
) -> None:
    """k_new holds P keys before the pass (all visible) and then the pass's own: query i
    sees k_old, k_new[:P] and k_new[P : P + i + 1]."""
    torch.manual_seed(1)
    q = torch.randn(new, heads, dim).transpose(0, 1)
    k_old, v_old = torch.randn(2, kv_heads, earlier, dim).to(kv_dtype)
    k_new, v_new = torch.randn(2, kv_heads, tail + new, dim).to(kv_dtype)
    out = torch.empty(new, heads, dim)
    _ops().attend_prefill(q, k_old, v_old, k_new, v_new, out, dim**-0.5)
    mask = torch.ones(new, earlier + tail + new, dtype=torch.bool)
    mask[:, earlier + tail :] = torch.ones(new, new, dtype=torch.bool).tril()
    k, v = torch.cat([k_old, k_new], 1).float(), torch.cat([v_old, v_new], 1).float()
    want = F.scaled_dot_product_attention(
        q[None], k[None], v[None], attn_mask=mask, scale=dim**-0.5, enable_gqa=True
    )[0].transpose(0, 1)
    torch.testing.assert_close(out, want, atol=2e-6, rtol=1e-5)


@pytest.mark.skipif(not native.bf16_prefill(), reason="this CPU (or build) has no bf16 dots")
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "earlier", "tail", "new"),
    [
        (9, 3, 64, 0, 0, 256),
        (9, 3, 64, 300, 0, 70),  # runs ending inside a tile and a 128-key block
        (9, 3, 64, 0, 0, 1061),
        (9, 3, 64, 2500, 17, 300),  # chunks, a tail before the pass, the pass
        (8, 2, 128, 64, 0, 333),  # head dim 128: the P.V tiles in two turns
        (4, 4, 64, 5, 129, 77),
        (16, 2, 64, 40, 0, 33),  # 8 query heads a KV head
        (7, 1, 64, 17, 3, 2),  # a 2-token pass: 14 idle lanes
    ],
)
def test_attend_prefill_bf16_is_attention_of_the_rounded_operands(
    heads: int, kv_heads: int, dim: int, earlier: int, tail: int, new: int
) -> None:
    """bf16 K/V on AMX tiles or vdpbf16ps (whichever this CPU has): the queries (times the
    scale and log2(e): the softmax runs in base 2) and the probabilities rounded to bf16,
    sums in float32; against float64 attention of the rounded queries, within the
    probabilities' rounding (2^-8 of each weight)."""
    torch.manual_seed(2)
    q = torch.randn(new, heads + 1, dim)[:, :heads].transpose(0, 1)  # strided, as the runner's
    k_old, v_old = torch.randn(2, kv_heads, earlier, dim).bfloat16()
    k_new, v_new = torch.randn(2, kv_heads, tail + new, dim).bfloat16()
    out = torch.full((new, heads + 1, dim), 7.0)
    assert _ops().attend_prefill_bf16(q, k_old, v_old, k_new, v_new, out[:, :heads], dim**-0.5)
    mask = torch.ones(new, earlier + tail + new, dtype=torch.bool)
    mask[:, earlier + tail :] = torch.ones(new, new, dtype=torch.bool).tril()
    k, v = torch.cat([k_old, k_new], 1).double(), torch.cat([v_old, v_new], 1).double()
    rounded = (q * dim**-0.5 * math.log2(math.e)).bfloat16().double() * math.log(2)
    want = F.scaled_dot_product_attention(
        rounded[None], k[None], v[None], attn_mask=mask, scale=1.0, enable_gqa=True
    )[0].transpose(0, 1)
    err = (out[:, :heads].double() - want).abs().max().item()
    assert err < 2**-8 * v.abs().max().item()
    assert (out[:, heads:] == 7.0).all()  # nothing else written


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("kv_heads", "groups", "dim", "tokens"), [(3, 3, 64, 256), (2, 2, 16, 300)]
)
def test_attend_slots_reads_chunks_where_they_lie(
    kv_heads: int, groups: int, dim: int, tokens: int, kv_dtype: torch.dtype
) -> None:
    """Output and log-sum-exp over the named slots of a slot-major pool, as a plain softmax
    over their keys end to end gives them."""
    torch.manual_seed(1)
    pool = torch.randn(6, 3, 2, kv_heads, tokens, dim).to(kv_dtype)  # [slots, L, 2, H, T, D]
    slots, layer, rows = [4, 1, 2], 2, 3
    q = torch.randn(kv_heads * groups, rows, dim)
    out, lse = torch.empty(rows, kv_heads * groups, dim), torch.empty(rows, kv_heads * groups)
    _ops().attend_slots(pool, layer, torch.tensor(slots), q, out, lse, dim**-0.5)
    k = torch.cat([pool[s, layer, 0] for s in slots], 1).repeat_interleave(groups, 0).float()
    v = torch.cat([pool[s, layer, 1] for s in slots], 1).repeat_interleave(groups, 0).float()
    got, got_lse = out.transpose(0, 1), lse.t()  # [Hq, N, D], [Hq, N]
    dots = _decode_dots(kv_dtype, dim)
    _assert_attention(got, got_lse, q, k[:, None], v[:, None], dim**-0.5, dots)


def test_bad_inputs_raise_a_clear_error() -> None:
    slab = torch.zeros(1, 1, 2, 1, 2, 4, 8)
    one = torch.zeros(1, dtype=torch.long)
    q, kv, out = torch.zeros(1, 1, 8), torch.zeros(1, 1, 8), torch.zeros(1, 1, 8)
    with pytest.raises(RuntimeError, match="tail position out of range"):
        _ops().decode_attend(
            slab, 0, one, one + 4, one + 4, one + 4, one, q, kv, kv, out, None, 1.0
        )
    with pytest.raises(RuntimeError, match="contiguous float32"):
        _ops().rms_norm(torch.zeros(2, 4, dtype=torch.float64), torch.zeros(4), 1e-5)
    q, kv, out = torch.zeros(3, 4, 64), torch.zeros(2, 4, 64), torch.zeros(4, 3, 64)
    with pytest.raises(RuntimeError, match="not a multiple of KV heads"):
        _ops().attend_prefill(q, kv, kv, kv, kv, out, 1.0)
    pool, q, out, lse = (
        torch.zeros(2, 1, 2, 1, 4, 8),
        torch.zeros(1, 1, 8),
        torch.zeros(1, 1, 8),
        torch.zeros(1, 1),
    )
    with pytest.raises(RuntimeError, match="slot out of range"):
        _ops().attend_slots(pool, 0, torch.tensor([2]), q, out, lse, 1.0)
    q, kv, out = torch.zeros(3, 4, 64), torch.zeros(1, 4, 64), torch.zeros(4, 3, 64)
    with pytest.raises(RuntimeError, match="k_old must be a BFloat16 CPU"):  # K/V: one dtype
        _ops().attend_prefill(q, kv, kv, kv.bfloat16(), kv.bfloat16(), out, 1.0)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        _ops().decode_attend(
            slab.half(),
            0,
            one,
            one,
            one + 4,
            one + 4,
            one,
            q[:1, :1, :8],
            kv[:, :1, :8],
            kv[:, :1, :8],
            out[:1, :1, :8],
            None,
            1.0,
        )
    with pytest.raises(RuntimeError, match="attend_prefill_bf16: K/V must be bfloat16"):
        _ops().attend_prefill_bf16(q, kv, kv, kv, kv, out, 1.0)
    q, kv, out = torch.zeros(2, 4, 32), torch.zeros(1, 4, 32), torch.zeros(4, 2, 32)
    with pytest.raises(RuntimeError, match="head dim 32 is not 64 or 128"):
        _ops().attend_prefill(q, kv, kv, kv, kv, out, 1.0)


@pytest.mark.slow  # a full compile of the kernels (~20 s)
def test_a_cold_folder_compiles_and_the_next_process_loads_it(tmp_path: Path) -> None:
    """The real cold start (compile into an empty ``KVTIER_NATIVE_DIR``), then a warm one."""
    assert native.status().how in ("compiled", "cached")
    code = "from kvtier import native; s = native.status(); print(s.how, s.available)"
    env = {**os.environ, native.ENV_DIR: str(tmp_path)}
    runs = [
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            timeout=300,
            env=env,
        ).stdout.split()
        for _ in range(2)
    ]
    assert runs == [["compiled", "True"], ["cached", "True"]]
    assert list(tmp_path.glob("kvtier_cpu_*/kvtier_cpu_*.so"))


def test_the_switch_turns_the_kernels_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    assert native.ops() is None
    assert native.status().how == "off"


@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 16, 17, 33, 64, 65, 130])
@pytest.mark.parametrize("out_features", [1, 21, 48, 64, 100])
def test_linear_panels_equals_f_linear(rows: int, out_features: int) -> None:
    """Tiles of 8 rows and their remainder, past 8 rows taking turns over 64 values of k
    (the input's 150: three turns, the last part-filled), past 64 rows a further pass;
    blocks of 3 panels and of 1 or 2, a last panel part-filled; with and without a bias."""
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, 150, generator=gen)
    w, b = torch.randn(out_features, 150, generator=gen), torch.randn(out_features, generator=gen)
    panels = _ops().pack_panels(w)
    assert panels.shape == ((out_features + 15) // 16, 150, 16)
    torch.testing.assert_close(_ops().linear_panels(x, panels, None, out_features), F.linear(x, w))
    torch.testing.assert_close(_ops().linear_panels(x, panels, b, out_features), F.linear(x, w, b))


def test_linear_panels_rows_do_not_change_each_others_bits() -> None:
    """Every tile (up to 8 rows x 3 panels; past 8 rows the groups take turns over k) sums
    each output over the input in order, so a row's output is the same bits whatever rows
    share its call: a sequence's decode does not depend on its batch."""
    gen = torch.Generator().manual_seed(5)
    w, b = torch.randn(100, 150, generator=gen), torch.randn(100, generator=gen)
    panels = _ops().pack_panels(w)
    x = torch.randn(80, 150, generator=gen)
    alone = torch.cat([_ops().linear_panels(x[i : i + 1], panels, b, 100) for i in range(80)])
    for rows in (3, 8, 9, 16, 25, 40, 65, 80):
        assert torch.equal(_ops().linear_panels(x[:rows], panels, b, 100), alone[:rows])


@pytest.mark.parametrize("rows", [1, 7, 16, 17, 33, 64])
@pytest.mark.parametrize(("out_features", "in_features"), [(100, 150), (21, 63), (96, 576)])
def test_bf16_panels_multiply_the_rounded_input(
    rows: int, out_features: int, in_features: int
) -> None:
    """bf16 panels hold pairs of k (an odd I padded with a zero k); the input is rounded to
    bf16 and the products summed in float32: on AMX tiles where the CPU has them and I / 2
    is a multiple of 16 (576), on the vector tiles otherwise (150, 63)."""
    gen = torch.Generator().manual_seed(rows * 1000 + in_features)
    x = torch.randn(rows, in_features, generator=gen)
    w = torch.randn(out_features, in_features, generator=gen).bfloat16()
    b = torch.randn(out_features, generator=gen)
    panels = _ops().pack_panels(w)
    assert panels.shape == ((out_features + 15) // 16, (in_features + 1) // 2, 16, 2)
    assert torch.equal(panels[0, 0, :, 0], w[:16, 0]) and torch.equal(panels[0, 0, :, 1], w[:16, 1])
    want = F.linear(x.bfloat16().double(), w.double(), b.double()).float()
    got = _ops().linear_panels(x, panels, b, out_features)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert not torch.equal(got, F.linear(x, w.float(), b))  # x was rounded


def test_bf16_panels_rows_do_not_change_each_others_bits() -> None:
    gen = torch.Generator().manual_seed(6)
    for in_features in (150, 576):
        w = torch.randn(100, in_features, generator=gen).bfloat16()
        panels = _ops().pack_panels(w)
        x = torch.randn(40, in_features, generator=gen)
        alone = torch.cat(
            [_ops().linear_panels(x[i : i + 1], panels, None, 100) for i in range(40)]
        )
        for rows in (3, 16, 17, 40):
            assert torch.equal(_ops().linear_panels(x[:rows], panels, None, 100), alone[:rows])


@pytest.mark.parametrize("rows", [1, 7, 16, 17, 64])
def test_int8_panels_multiply_the_integers_times_each_outputs_scale(rows: int) -> None:
    """int8 panels (the LM head's greedy screen) share the float32 layout; each line is
    widened exactly and each output's sum multiplied by its scale; rows keep their bits."""
    gen = torch.Generator().manual_seed(rows)
    q = torch.randint(-127, 128, (100, 150), generator=gen, dtype=torch.int8)
    scales = torch.rand(100, generator=gen) / 100
    panels = _ops().pack_panels(q)
    assert panels.shape == (7, 150, 16) and panels.dtype == torch.int8
    x = torch.randn(rows, 150, generator=gen)
    want = F.linear(x.double(), q.double() * scales.double()[:, None]).float()
    got = _ops().linear_panels(x, panels, None, 100, scales)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    alone = torch.cat(
        [_ops().linear_panels(x[i : i + 1], panels, None, 100, scales) for i in range(rows)]
    )
    assert torch.equal(got, alone)
    with pytest.raises(RuntimeError, match="int8 panels take scales"):
        _ops().linear_panels(x, panels, None, 100)
    with pytest.raises(RuntimeError, match="int8 panels take scales"):
        _ops().linear_panels(x, _ops().pack_panels(q.float()), None, 100, scales)
    with pytest.raises(RuntimeError, match="scales must be"):
        _ops().linear_panels(x, panels, None, 100, scales[:50])


def test_linear_panels_refuses_mismatched_inputs() -> None:
    panels = _ops().pack_panels(torch.zeros(20, 90))
    with pytest.raises(RuntimeError, match="must match x's I"):
        _ops().linear_panels(torch.zeros(1, 91), panels, None, 20)
    with pytest.raises(RuntimeError, match="must match x's I"):
        _ops().linear_panels(torch.zeros(1, 90), panels, None, 40)
    with pytest.raises(RuntimeError, match="bias must be"):
        _ops().linear_panels(torch.zeros(1, 90), panels, torch.zeros(3), 20)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        _ops().linear_panels(torch.zeros(1, 90, dtype=torch.float64), panels, None, 20)
