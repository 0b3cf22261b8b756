"""The batched decode of seated sequences equals each sequence's own attention.

Four seated sequences of different lengths (no resident chunk; one; two; one and a tail
that fills in this step) plus an idle seat between them decode one token per step; the
same tokens go through unseated caches and the per-sequence path (``write`` and
``attend_packed``). Outputs match to float32 rounding and the tails and sealed chunks are
the same.
"""

from __future__ import annotations

import pytest
import torch

from kvtier import native
from kvtier.config import HostConfig, ManagerConfig, TieredCacheConfig
from kvtier.kv import KVLayout
from kvtier.manager import KVManager
from kvtier.runtime import DecodeBatch, PackedKV, SeatSlab, SequenceKV, attend_packed
from kvtier.tiers.pool import PoolTier

LAYERS, HKV, G, DIM, T = 2, 2, 3, 8, 16
SCALE = DIM**-0.5


def _manager(dtype: torch.dtype = torch.float32) -> KVManager:
    layout = KVLayout(LAYERS, HKV, DIM, dtype=dtype, chunk_tokens=T)
    config = ManagerConfig(chunk_tokens=T, host=HostConfig(capacity_bytes=64 * layout.chunk_nbytes))
    return KVManager(layout, "decode-batch-test", config)


def _run(
    kvs: list[SequenceKV], lengths: list[int], steps: int, seated: bool
) -> tuple[list[torch.Tensor], bool]:
    """Prefill each sequence to its length (one pass each), then decode ``steps`` tokens
    per sequence, all packed in one step: the attention outputs of every decode step, and
    whether the decode batch took kvtier's kernel."""
    gen = torch.Generator().manual_seed(0)
    for kv, n in zip(kvs, lengths, strict=True):
        keys = torch.randn(LAYERS, 1, HKV, n, DIM, generator=gen)
        values = torch.randn(LAYERS, 1, HKV, n, DIM, generator=gen)
        kv.begin_forward(n, 1)
        for layer in range(LAYERS):
            kv.write(layer, keys[layer], values[layer])
        kv.end_forward()
    outs = []
    spans = [(i, 1) for i in range(len(kvs))]
    for _ in range(steps):
        n = len(kvs)
        q = torch.randn(LAYERS, 1, HKV * G, n, DIM, generator=gen)
        k = torch.randn(LAYERS, 1, HKV, n, DIM, generator=gen)
        v = torch.randn(LAYERS, 1, HKV, n, DIM, generator=gen)
        for kv in kvs:
            kv.begin_forward(1, 1)
        batch, rest = DecodeBatch.collect(kvs, spans) if seated else (None, list(range(n)))
        assert (batch is None) == (not seated) and (rest == []) == seated
        kernel = batch is not None and batch.ops is not None
        step = []
        for layer in range(LAYERS):
            out = torch.full((1, n, HKV * G, DIM), float("nan"))
            if batch is not None:
                batch.attend(layer, q[layer], k[layer], v[layer], SCALE, out)
            else:
                views = [
                    kv.write(layer, k[layer][:, :, i : i + 1], v[layer][:, :, i : i + 1])
                    for i, kv in enumerate(kvs)
                ]
                attend_packed(PackedKV(layer, views, spans), q[layer], SCALE, out)
            step.append(out)
        for kv in kvs:
            kv.end_forward()
        outs.append(torch.stack(step))
    return outs, kernel


@pytest.mark.parametrize(
    ("seats", "lengths"),
    [
        ([0, 1, 3, 5], [5, T + 3, 2 * T + 7, 2 * T - 2]),  # idle seats 2 and 4 between
        ([0, 1, 2], [T + 4, T + 4, T + 4]),  # dense: no gather, no mask
        ([0, 1, 2], [2 * T + 1, T + 1, 2 * T - 3]),  # dense, different lengths (masks)
        ([0], [3 * T + 5]),  # one seat, several resident chunks
    ],
)
@pytest.mark.parametrize("kernels", ["native", "torch"])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_a_decode_batch_equals_each_sequences_attention(
    seats: list[int],
    lengths: list[int],
    kernels: str,
    kv_dtype: torch.dtype,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Idle seats between decoding ones, a tail filling mid-run (the 2T-2 one on step 2),
    no resident chunk (length 5), and the dense case (rows 0..R-1 on seats 0..R-1); with
    kvtier's CPU kernel and with torch's (``KVTIER_NATIVE=0``); KV in float32 and in bf16
    (the engine's bf16 mode: both paths store the rounded K/V and attend in float32)."""
    monkeypatch.setenv(native.ENV_SWITCH, "1" if kernels == "native" else "0")
    manager = _manager(kv_dtype)
    budget = 4 * manager.layout.chunk_nbytes  # a tail and 3 resident chunks per sequence
    config = TieredCacheConfig(device_budget_bytes=budget)
    slab = SeatSlab(manager.layout, 6, budget, torch.device("cpu"))
    device = torch.device("cpu")
    windows = [None] * LAYERS
    seated = [SequenceKV(manager, windows, config, device, seat=(slab, s)) for s in seats]
    plain = [SequenceKV(_manager(kv_dtype), windows, config, device) for _ in seats]
    got, kernel = _run(seated, lengths, 4, seated=True)
    assert kernel == (kernels == "native")
    want, _ = _run(plain, lengths, 4, seated=False)
    for a, b in zip(got, want, strict=True):
        assert not a.isnan().any()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(seated, plain, strict=True):
        assert a.seq_len == b.seq_len and a.state.tail_len == b.state.tail_len
        tail = a.state.tail_len
        assert a.arena.tails is not None and b.arena.tails is not None
        torch.testing.assert_close(a.arena.tails[..., :tail, :], b.arena.tails[..., :tail, :])
        assert len(a.state.refs[0]) == len(b.state.refs[0])  # chunks sealed (private keys)
        assert a.sealed_chunks == b.sealed_chunks


def test_a_seat_needs_full_attention_and_the_budgets_slot_count() -> None:
    manager = _manager()
    budget = 4 * manager.layout.chunk_nbytes
    config = TieredCacheConfig(device_budget_bytes=budget)
    slab = SeatSlab(manager.layout, 2, budget, torch.device("cpu"))
    with pytest.raises(ValueError, match="full attention"):
        SequenceKV(manager, [None, 8], config, torch.device("cpu"), seat=(slab, 0))
    other = TieredCacheConfig(device_budget_bytes=3 * manager.layout.chunk_nbytes)
    with pytest.raises(ValueError, match="slots"):
        SequenceKV(manager, [None] * LAYERS, other, torch.device("cpu"), seat=(slab, 0))
    with pytest.raises(ValueError, match="below the minimum"):
        SeatSlab(manager.layout, 2, manager.layout.chunk_nbytes - 1, torch.device("cpu"))
    assert SeatSlab(manager.layout, 2, manager.layout.chunk_nbytes, torch.device("cpu")).slots == 0


def test_a_pool_on_given_storage_checks_its_shape() -> None:
    layout = _manager().layout
    with pytest.raises(ValueError, match="storage"):
        PoolTier(
            "device", layout, 2 * layout.chunk_nbytes, layer_major=True, storage=torch.zeros(3)
        )
