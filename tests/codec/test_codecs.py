"""Every codec: sizes, round trips within its error bound, strided buffers, bad input."""

from __future__ import annotations

import pytest
import torch

from kvtier.codec import CODECS, get_codec
from kvtier.kv.layout import KVLayout

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=16, chunk_tokens=32)

# Worst error relative to each group's spread: half a step for the integer codes (plus the
# fp16 step's rounding), e4m3's 3-bit mantissa for fp8 (relative to the block's largest).
BOUNDS = {"raw": 0.0, "fp8": 1 / 16 + 1e-6, "int8": 0.5 / 255 + 1e-3, "int4": 0.5 / 15 + 1e-3}


def sample(layout: KVLayout = LAYOUT, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(layout.chunk_shape, generator=gen) * 3
    x[:, 0, :, :, 1] += 40.0  # an outlier key channel, as real keys have
    return x.to(layout.dtype)


@pytest.mark.parametrize("name", sorted(CODECS))
def test_round_trip_within_bound(name: str) -> None:
    codec = get_codec(name)
    x = sample()
    encoded = codec.encode(x, LAYOUT)
    assert encoded.dtype == torch.uint8 and encoded.numel() == codec.encoded_nbytes(LAYOUT)
    out = torch.full_like(x, float("nan"))
    codec.decode_into(encoded, out)
    assert torch.isfinite(out).all()
    if codec.exact:
        assert torch.equal(out, x)
        return
    err = (out - x).abs()
    keys, values = x[:, 0], x[:, 1]
    if name == "fp8":
        scale = x.abs().amax(dim=(3, 4), keepdim=True)
        assert (err <= BOUNDS[name] * scale).all()
    else:  # per channel for keys (over tokens), per token for values (over channels)
        k_spread = keys.amax(dim=2, keepdim=True) - keys.amin(dim=2, keepdim=True)
        v_spread = values.amax(dim=3, keepdim=True) - values.amin(dim=3, keepdim=True)
        assert (err[:, 0] <= BOUNDS[name] * k_spread + 1e-5).all()
        assert (err[:, 1] <= BOUNDS[name] * v_spread + 1e-5).all()
    assert not torch.equal(out, x)  # it is lossy: the bench measures by how much


def test_sizes_shrink_in_order() -> None:
    layout = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64)  # the embedded model
    ratios = {name: codec.ratio(layout) for name, codec in CODECS.items()}
    assert ratios["raw"] == 1.0
    assert ratios["int8"] <= 0.27  # issue 25's bound for int8 over fp32
    assert ratios["int4"] < ratios["fp8"] < ratios["int8"] < ratios["raw"]


@pytest.mark.parametrize("name", sorted(CODECS))
def test_strided_and_half_precision_chunks(name: str) -> None:
    codec = get_codec(name)
    layout = KVLayout(2, 2, 8, torch.float16, 16)
    x = sample(layout)
    pool = torch.zeros((2, 2, 2, 3, 16, 8), dtype=torch.float16)  # a layer-major pool
    pool[:, :, :, 1] = x
    encoded = codec.encode(pool[:, :, :, 1], layout)
    contiguous = codec.encode(x, layout)
    assert torch.equal(encoded, contiguous)
    codec.decode_into(encoded, pool[:, :, :, 2])
    expected = torch.empty_like(x)
    codec.decode_into(contiguous, expected)
    assert torch.equal(pool[:, :, :, 2], expected)
    assert (pool[:, :, :, 0] == 0).all()  # its neighbours untouched


@pytest.mark.parametrize("name", ["int8", "int4", "fp8"])
def test_constant_and_zero_chunks_decode_exactly(name: str) -> None:
    codec = get_codec(name)
    for value in (0.0, 1.5):
        x = torch.full(LAYOUT.chunk_shape, value)
        out = torch.empty_like(x)
        codec.decode_into(codec.encode(x, LAYOUT), out)
        torch.testing.assert_close(out, x, atol=1e-5, rtol=0)


def test_wrong_buffers_are_refused() -> None:
    codec = get_codec("int8")
    x = sample()
    with pytest.raises(ValueError, match="flat uint8"):
        codec.encode_into(x, torch.empty(codec.encoded_nbytes(LAYOUT), dtype=torch.int8))
    with pytest.raises(ValueError, match="needs"):
        codec.encode_into(x, torch.empty(codec.encoded_nbytes(LAYOUT) + 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="accepted"):
        get_codec("zstd")
