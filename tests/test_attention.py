from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor

from kvtier.attention import (
    SegmentResult,
    attend_own_keys,
    attend_segment,
    empty_result,
    merge,
)

HOST = torch.device("cpu")


@dataclass(frozen=True)
class KVSegment:
    """A range of one layer's KV for the tests: ``key``/``value [B, Hkv, Sk, D]`` from
    absolute position ``start_pos``; ``on_host`` segments are attended on the CPU."""

    key: Tensor
    value: Tensor
    start_pos: int = 0
    valid_mask: Tensor | None = None
    on_host: bool = False

    @property
    def end_pos(self) -> int:
        return self.start_pos + int(self.key.shape[2])


def segmented_attention(
    query: Tensor,
    segments: list[KVSegment],
    scale: float,
    *,
    query_positions: Tensor | int | None = None,
    causal: bool = True,
    mask: Tensor | None = None,
    return_lse: bool = False,
    softcap: float | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """The segments' attention from ``attend_segment`` and ``merge`` (host ones on the CPU,
    their merged result shipped back), as the runtime composes them."""
    positions: Tensor | int | None = None
    if causal:
        if query_positions is None:
            newest = max((s.end_pos for s in segments), default=query.shape[2])
            query_positions = newest - query.shape[2]
        positions = query_positions

    def one(s: KVSegment, device: torch.device) -> SegmentResult:
        q = query.to(device)
        pos = positions.to(device) if isinstance(positions, Tensor) else positions
        m = mask.to(device) if mask is not None else None
        if m is not None and m.shape[-1] != 1:
            m = m[..., s.start_pos : s.end_pos]
        valid = s.valid_mask.to(device) if s.valid_mask is not None else None
        return attend_segment(
            q,
            s.key.to(device),
            s.value.to(device),
            scale,
            query_positions=pos,
            key_start=s.start_pos,
            valid_mask=valid,
            mask=m,
            softcap=softcap,
        )

    partial = [one(s, query.device) for s in segments if not s.on_host]
    hosted = [one(s, HOST) for s in segments if s.on_host]
    if hosted:
        host = merge(hosted)
        partial.append(SegmentResult(host.out.to(query.device), host.lse.to(query.device)))
    result = merge(partial) if partial else empty_result(query)
    out = result.out.to(query.dtype)
    return (out, result.lse) if return_lse else out


def reference(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    scale: float,
    query_positions: Tensor,
    valid: Tensor | None = None,
    softcap: float | None = None,
) -> Tensor:
    """Plain full attention in float64 over concatenated KV (position p = column p),
    with the scores soft-capped as transformers' eager attention does (``softcap``).

    Rows that see no key give 0 (the segmented convention).
    """
    b, hq, sq, _ = query.shape
    groups = hq // key.shape[1]
    k = key.double().repeat_interleave(groups, dim=1)
    v = value.double().repeat_interleave(groups, dim=1)
    scores = torch.matmul(query.double(), k.transpose(-1, -2)) * scale  # [B, Hq, Sq, Sk]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    k_pos = torch.arange(key.shape[2])
    q_pos = query_positions.expand(b, sq) if query_positions.dim() == 1 else query_positions
    allowed = (k_pos <= q_pos.unsqueeze(-1))[:, None]  # [B, 1, Sq, Sk]
    if valid is not None:
        allowed = allowed & valid[:, None, None, :]
    scores = scores.masked_fill(~allowed, -math.inf)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.matmul(probs, v)


def split(key: Tensor, value: Tensor, lengths: list[int], valid: Tensor | None = None):
    segments, start = [], 0
    for i, length in enumerate(lengths):
        end = start + length
        segments.append(
            KVSegment(
                key[:, :, start:end],
                value[:, :, start:end],
                start_pos=start,
                valid_mask=None if valid is None else valid[:, start:end],
                on_host=i % 2 == 1,
            )
        )
        start = end
    return segments


def random_lengths(gen: torch.Generator, total: int, num_segments: int) -> list[int]:
    cuts = sorted(torch.randperm(total - 1, generator=gen)[: num_segments - 1].add(1).tolist())
    bounds = [0, *cuts, total]
    return [b - a for a, b in itertools.pairwise(bounds)]


def make_qkv(batch: int, hq: int, hkv: int, sq: int, sk: int, d: int = 16, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, hq, sq, d, generator=gen)
    key = torch.randn(batch, hkv, sk, d, generator=gen) * 2  # peaked softmax
    value = torch.randn(batch, hkv, sk, d, generator=gen)
    return query, key, value, gen


@pytest.mark.parametrize("sq", [1, 7])
@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (4, 2), (9, 3)])
@pytest.mark.parametrize("num_segments", [1, 2, 3, 5])
def test_matches_full_attention(sq: int, hq: int, hkv: int, num_segments: int) -> None:
    total = 23
    query, key, value, gen = make_qkv(2, hq, hkv, sq, total, seed=num_segments * 100 + sq)
    segments = split(key, value, random_lengths(gen, total, num_segments))
    scale = 16**-0.5
    out = segmented_attention(query, segments, scale)
    q_pos = torch.arange(total - sq, total)
    expected = reference(query, key, value, scale, q_pos)
    assert out.dtype == query.dtype
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sq", [1, 7])
@pytest.mark.parametrize("num_segments", [1, 3])
def test_soft_capped_segments_match_capped_full_attention(sq: int, num_segments: int) -> None:
    """Gemma 2's cap ``c · tanh(s / c)`` per score: segments merged give the capped full
    attention, which a cap of 2 on these scores (std ~2) visibly changes."""
    total, cap = 23, 2.0
    query, key, value, gen = make_qkv(2, 9, 3, sq, total, seed=num_segments * 10 + sq)
    segments = split(key, value, random_lengths(gen, total, num_segments))
    q_pos = torch.arange(total - sq, total)
    expected = reference(query, key, value, 0.25, q_pos, softcap=cap)
    uncapped = reference(query, key, value, 0.25, q_pos)
    assert (expected - uncapped).abs().max() > 0.05  # the cap bites
    out = segmented_attention(query, segments, 0.25, softcap=cap)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_soft_capped_lse_is_the_logsumexp_of_the_capped_scores() -> None:
    query, key, value, _ = make_qkv(2, 4, 2, 3, 9, seed=7)
    result = attend_segment(query, key, value, 0.25, softcap=1.5)
    k = key.repeat_interleave(2, dim=1)
    scores = torch.matmul(query, k.transpose(-1, -2)) * 0.25
    expected = torch.logsumexp(torch.tanh(scores / 1.5) * 1.5, dim=-1)
    torch.testing.assert_close(result.lse, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (9, 3)])
def test_attend_own_keys_soft_caps_its_scores(hq: int, hkv: int) -> None:
    query, key, value, _ = make_qkv(2, hq, hkv, 37, 37, seed=3)
    result = attend_own_keys(query, key, value, 0.25, softcap=2.0)
    expected = reference(query, key, value, 0.25, torch.arange(37), softcap=2.0)
    torch.testing.assert_close(result.out.double(), expected, atol=1e-5, rtol=1e-5)
    uncapped = attend_own_keys(query, key, value, 0.25)
    assert (result.out - uncapped.out).abs().max() > 0.05


def test_left_padding_and_per_row_positions() -> None:
    # Row 0 has 3 padding slots, row 1 none; the prompt is the last 6 slots, causal inside.
    total, sq = 20, 6
    query, key, value, _ = make_qkv(2, 4, 2, sq, total, seed=3)
    valid = torch.ones(2, total, dtype=torch.bool)
    valid[0, :3] = False
    segments = split(key, value, [2, 5, 7, 6], valid)
    scale = 0.3
    q_pos = torch.arange(total - sq, total)
    expected = reference(query, key, value, scale, q_pos, valid)
    torch.testing.assert_close(
        segmented_attention(query, segments, scale).double(), expected, atol=1e-5, rtol=1e-5
    )
    # The same positions given as a [B, Sq] tensor.
    rows = q_pos.expand(2, sq)
    out = segmented_attention(query, segments, scale, query_positions=rows)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_per_row_positions_differ() -> None:
    total, sq = 12, 3
    query, key, value, _ = make_qkv(2, 2, 1, sq, total, seed=4)
    q_pos = torch.tensor([[5, 6, 7], [9, 10, 11]])
    segments = split(key, value, [4, 4, 4])
    out = segmented_attention(query, segments, 0.25, query_positions=q_pos)
    expected = reference(query, key, value, 0.25, q_pos)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_fully_masked_rows_merge_without_nan() -> None:
    total, sq = 10, 1
    query, key, value, _ = make_qkv(3, 4, 2, sq, total, seed=5)
    valid = torch.ones(3, total, dtype=torch.bool)
    valid[0, :6] = False  # row 0 sees nothing in the first segment
    valid[2, :] = False  # row 2 sees nothing at all
    segments = split(key, value, [6, 4], valid)
    first = attend_segment(
        query, key[:, :, :6], value[:, :, :6], 0.25, valid_mask=valid[:, :6], query_positions=9
    )
    assert torch.isneginf(first.lse[0]).all() and (first.out[0] == 0).all()
    assert torch.isfinite(first.lse[1]).all()
    out, lse = segmented_attention(query, segments, 0.25, return_lse=True)
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.isneginf(lse[2]).all() and (out[2] == 0).all()
    expected = reference(query, key, value, 0.25, torch.tensor([9]), valid)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_future_segment_is_skipped() -> None:
    query, key, value, _ = make_qkv(1, 2, 2, 2, 5, seed=6)
    result = attend_segment(query, key, value, 0.5, query_positions=3, key_start=10)
    assert torch.isneginf(result.lse).all() and (result.out == 0).all()
    # Tensor positions take the masking path and agree.
    tensor_pos = attend_segment(
        query, key, value, 0.5, query_positions=torch.tensor([3, 4]), key_start=10
    )
    assert torch.isneginf(tensor_pos.lse).all() and (tensor_pos.out == 0).all()


def test_lse_matches_logsumexp() -> None:
    query, key, value, _ = make_qkv(2, 4, 2, 3, 9, seed=7)
    result = attend_segment(query, key, value, 0.25)
    k = key.repeat_interleave(2, dim=1)
    expected = torch.logsumexp(torch.matmul(query, k.transpose(-1, -2)) * 0.25, dim=-1)
    torch.testing.assert_close(result.lse, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (9, 3)])
def test_attend_own_keys_is_causal_attention_with_its_lse(hq: int, hkv: int) -> None:
    query, key, value, _ = make_qkv(2, hq, hkv, 37, 37, seed=3)
    result = attend_own_keys(query, key, value, 0.25)
    expected = attend_segment(query, key, value, 0.25, query_positions=0, key_start=0)
    torch.testing.assert_close(result.out, expected.out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(result.lse, expected.lse, atol=1e-5, rtol=1e-5)
    full = reference(query, key, value, 0.25, torch.arange(37))
    torch.testing.assert_close(result.out.double(), full, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="query's length"):
        attend_own_keys(query, key[:, :, :5], value[:, :, :5], 0.25)


def test_merge_is_associative_and_has_identity() -> None:
    query, key, value, _ = make_qkv(2, 4, 2, 3, 15, seed=8)
    parts = [
        attend_segment(query, key[:, :, a:b], value[:, :, a:b], 0.25)
        for a, b in [(0, 4), (4, 9), (9, 15)]
    ]
    whole = attend_segment(query, key, value, 0.25)
    left = merge([merge(parts[:2]), parts[2]])
    right = merge([parts[0], merge(parts[1:])])
    flat = merge(parts)
    for result in (left, right, flat, merge([*parts, empty_result(query)])):
        torch.testing.assert_close(result.out, whole.out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(result.lse, whole.lse, atol=1e-5, rtol=1e-5)
    assert merge([parts[0]]) is parts[0]
    with pytest.raises(ValueError, match="at least one"):
        merge([])


def test_merge_all_empty() -> None:
    query = torch.randn(1, 2, 3, 4)
    merged = merge([empty_result(query), empty_result(query)])
    assert torch.isneginf(merged.lse).all() and (merged.out == 0).all()
    out = segmented_attention(query, [], 0.5)
    assert (out == 0).all()


def test_host_path_equals_device_path() -> None:
    total, sq = 17, 4
    query, key, value, _ = make_qkv(2, 6, 3, sq, total, seed=9)
    valid = torch.ones(2, total, dtype=torch.bool)
    valid[1, :5] = False
    lengths = [5, 3, 6, 3]
    on_device = [
        KVSegment(s.key, s.value, s.start_pos, s.valid_mask, on_host=False)
        for s in split(key, value, lengths, valid)
    ]
    on_host = [
        KVSegment(s.key, s.value, s.start_pos, s.valid_mask, on_host=True)
        for s in split(key, value, lengths, valid)
    ]
    mixed = split(key, value, lengths, valid)
    assert any(s.on_host for s in mixed) and not all(s.on_host for s in mixed)
    expected = segmented_attention(query, on_device, 0.3, return_lse=True)
    for segments in (on_host, mixed):
        got = segmented_attention(query, segments, 0.3, return_lse=True)
        torch.testing.assert_close(got[0], expected[0], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(got[1], expected[1], atol=1e-6, rtol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_segments_with_cuda_query() -> None:
    total, sq = 64, 1
    query, key, value, _ = make_qkv(2, 8, 2, sq, total, seed=10)
    lengths = [16, 16, 16, 16]
    host = split(key, value, lengths)  # odd segments on the host
    cuda = [s if s.on_host else KVSegment(s.key.cuda(), s.value.cuda(), s.start_pos) for s in host]
    out = segmented_attention(query.cuda(), cuda, 0.25)
    assert out.device.type == "cuda"
    expected = reference(query, key, value, 0.25, torch.tensor([total - 1]))
    torch.testing.assert_close(out.cpu().double(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype: torch.dtype) -> None:
    total, sq = 40, 5
    query, key, value, gen = make_qkv(2, 4, 2, sq, total, seed=11)
    query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    segments = split(key, value, random_lengths(gen, total, 3))
    out = segmented_attention(query, segments, 0.25)
    assert out.dtype == dtype
    expected = reference(query, key, value, 0.25, torch.arange(total - sq, total))
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_extra_mask(kind: str) -> None:
    total, sq = 12, 3
    query, key, value, gen = make_qkv(2, 4, 2, sq, total, seed=12)
    keep = torch.rand(2, 4, sq, total, generator=gen) > 0.3  # per head
    keep[..., 0] = True  # every row sees at least one key
    mask = keep if kind == "bool" else torch.zeros(keep.shape).masked_fill(~keep, -math.inf)
    segments = split(key, value, [5, 7])
    out = segmented_attention(query, segments, 0.25, causal=False, mask=mask)
    k = key.double().repeat_interleave(2, dim=1)
    v = value.double().repeat_interleave(2, dim=1)
    scores = (torch.matmul(query.double(), k.transpose(-1, -2)) * 0.25).masked_fill(
        ~keep, -math.inf
    )
    expected = torch.matmul(torch.softmax(scores, dim=-1), v)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_segment_result_is_named() -> None:
    query, key, value, _ = make_qkv(1, 2, 1, 1, 3)
    result = attend_segment(query, key, value, 1.0)
    assert isinstance(result, SegmentResult)
    assert result.out.shape == (1, 2, 1, 16) and result.lse.shape == (1, 2, 1)
    assert result.out.dtype == torch.float32


def _segmented_hf_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: object,
) -> tuple[Tensor, None]:
    """A transformers attention function over three segments of the cache, one on the host.

    ``attention_mask`` is the 2D padding mask over cache slots (see ``_padding_mask``).
    """
    total = key.shape[2]
    bounds = sorted({0, total // 3, (2 * total) // 3, total})
    segments = [
        KVSegment(
            key[:, :, a:b],
            value[:, :, a:b],
            start_pos=a,
            valid_mask=None if attention_mask is None else attention_mask[:, a:b],
            on_host=i == 1,
        )
        for i, (a, b) in enumerate(itertools.pairwise(bounds))
    ]
    out = segmented_attention(query, segments, scaling)  # [B, Hq, Sq, D]
    return out.transpose(1, 2).contiguous(), None


def _padding_mask(attention_mask: Tensor | None = None, **kwargs: object) -> Tensor | None:
    """Mask builder for transformers: hand the 2D ``[B, kv_length]`` padding mask through."""
    return attention_mask


@pytest.fixture(scope="module")
def segmented_impl() -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    name = "kvtier_test_segmented"
    AttentionInterface.register(name, _segmented_hf_attention)
    AttentionMaskInterface.register(name, _padding_mask)
    return name


def test_llama_layer_matches_eager(segmented_impl: str) -> None:
    from kvtier.models import random_model

    eager = random_model("llama", seed=1, attn_implementation="eager", initializer_range=0.2)
    ours = random_model("llama", seed=1, attn_implementation=segmented_impl, initializer_range=0.2)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 256, (3, 11), generator=gen)
    mask = torch.ones(3, 11, dtype=torch.long)
    mask[0, :4] = 0  # left padding
    mask[2, :1] = 0
    expected = eager(ids, attention_mask=mask).logits
    got = ours(ids, attention_mask=mask).logits
    keep = mask.bool()
    torch.testing.assert_close(got[keep], expected[keep], atol=1e-4, rtol=1e-4)

    greedy = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(ids, **greedy), eager.generate(ids, **greedy))
