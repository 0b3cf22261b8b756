"""The codecs' native kernels (``kvtier.native``'s ``codec_ops.cpp``) against their torch
path (``KVTIER_NATIVE=0``): the same stored bytes from encode and the same bits from decode,
on random chunks with the edge cases quantisation meets (constant and zero groups, values
past fp16's range, e4m3's subnormals, codes exactly half a step between two levels)."""

from __future__ import annotations

import pytest
import torch

from kvtier import native
from kvtier.codec import get_codec
from kvtier.kv.layout import KVLayout

LOSSY = ["int8", "int4", "fp8"]
LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=40, chunk_tokens=24)  # D: 2.5 vectors

needs_native = pytest.mark.skipif(native.ops() is None, reason=native.status().line())


def edge_chunk(layout: KVLayout = LAYOUT, seed: int = 0) -> torch.Tensor:
    """Random keys and values with an outlier channel, and one edge case per (layer, head)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(layout.chunk_shape, generator=gen) * 3
    x[:, 0, :, :, 1] += 40.0  # an outlier key channel
    x[0, :, 0] = 0.0  # an all-zero block, half of it -0.0 (stored as +0 either way)
    x[0, :, 0, ::2] = -0.0
    x[0, :, 1] = 1.5  # a constant block
    x[1, 0, 0, :, 3] = -2.25  # a constant key channel
    x[1, 1, 0, 5] = 7.0  # a constant value token
    x[1, :, 1, 2] *= 1e30  # past fp16's range: offsets and steps clamp
    x[1, :, 1, 3, :4] = torch.tensor([-7e4, 7e4, 65504.0, -65504.0])
    x[2, :, 0] *= 1e-6  # e4m3 subnormals after scaling, steps at their floor
    # Codes exactly half a step between two levels: 0, 1/2 .. 255/2 over a group of 0 .. 255.
    x[2, 1, 1, :, :] = torch.arange(layout.head_dim, dtype=torch.float32) * 0.5
    x[2, 1, 1, :, 0] = 0.0
    x[2, 1, 1, :, -1] = 255.0
    return x


def encode_both(name: str, x: torch.Tensor, monkeypatch: pytest.MonkeyPatch) -> tuple:
    codec = get_codec(name)
    fast = codec.encode(x, LAYOUT)
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    slow = codec.encode(x, LAYOUT)
    monkeypatch.delenv(native.ENV_SWITCH)
    return fast, slow


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)  # -0.0 and 0.0 differ here


@needs_native
@pytest.mark.parametrize("name", LOSSY)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_native_encode_stores_the_torch_paths_bytes(
    name: str, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    x = edge_chunk(seed=seed)
    fast, slow = encode_both(name, x, monkeypatch)
    assert torch.equal(fast, slow)


@needs_native
@pytest.mark.parametrize("name", LOSSY)
def test_native_decode_gives_the_torch_paths_bits(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    codec = get_codec(name)
    encoded = codec.encode(edge_chunk(), LAYOUT)
    fast = torch.full(LAYOUT.chunk_shape, float("nan"))
    codec.decode_into(encoded, fast)
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    slow = torch.full(LAYOUT.chunk_shape, float("nan"))
    codec.decode_into(encoded, slow)
    assert torch.equal(bits(fast), bits(slow))


@needs_native
@pytest.mark.parametrize("name", LOSSY)
def test_native_kernels_read_and_write_strided_pool_slots(name: str) -> None:
    codec = get_codec(name)
    x = edge_chunk()
    pool = torch.zeros((3, 2, 2, 3, 24, 40))  # a layer-major pool: a slot is a strided view
    pool[:, :, :, 1] = x
    encoded = codec.encode(pool[:, :, :, 1], LAYOUT)
    assert torch.equal(encoded, codec.encode(x, LAYOUT))
    codec.decode_into(encoded, pool[:, :, :, 2])
    expected = torch.empty_like(x)
    codec.decode_into(encoded, expected)
    assert torch.equal(bits(pool[:, :, :, 2]), bits(expected))
    assert (pool[:, :, :, 0] == 0).all()


@needs_native
def test_the_native_kernels_are_what_the_codecs_call_on_cpu_float32() -> None:
    from kvtier.codec.base import native_ops

    x = edge_chunk()
    assert native_ops(x) is native.ops()
    assert native_ops(x.half()) is None  # half precision: torch's path
    assert native_ops(x.transpose(3, 4)) is None  # the last stride is not 1


def test_torch_path_alone_round_trips(monkeypatch: pytest.MonkeyPatch) -> None:
    """``KVTIER_NATIVE=0``: every lossy codec still encodes and decodes (torch's ops)."""
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    assert native.ops() is None
    x = edge_chunk()
    for name in LOSSY:
        codec = get_codec(name)
        out = torch.full_like(x, float("nan"))
        codec.decode_into(codec.encode(x, LAYOUT), out)
        assert torch.isfinite(out).all()
        ordinary = (slice(0, 1), slice(None), slice(None), slice(None), slice(None))
        tol = 0.08 * float(x[ordinary].abs().max())
        assert (out[ordinary] - x[ordinary]).abs().max() <= tol


@needs_native
def test_native_kernels_refuse_wrong_sections() -> None:
    ops = native.ops()
    x = edge_chunk()
    codec = get_codec("int8")
    with pytest.raises(RuntimeError, match="float32"):
        ops.kivi_encode(x.double(), *torch.empty(5, dtype=torch.uint8).split(1), 8)
    encoded = codec.encode(x, LAYOUT)
    k_min, v_min, k_step, v_step, codes = encoded.split(  # the sections in order
        [4 * 3 * 2 * 40, 4 * 3 * 2 * 24, 2 * 3 * 2 * 40, 2 * 3 * 2 * 24, 3 * 2 * 2 * 24 * 40]
    )
    with pytest.raises(RuntimeError, match="section"):  # raw bytes, not fp32 views
        ops.kivi_decode(k_min, v_min, k_step, v_step, codes, 8, torch.empty_like(x))
