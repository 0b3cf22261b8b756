"""``SequenceKV.adopt_loaded``: chunks that host holds are adopted after the sealed ones,
only where they continue the sequence's chain, and never after a tail."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvtier.config import HostConfig, ManagerConfig, TieredCacheConfig
from kvtier.kv import ChunkRef, KVLayout
from kvtier.manager import KVManager
from kvtier.runtime import SequenceKV

LAYERS, HKV, DIM, T = 2, 2, 8, 16
IDS = torch.arange(100, 100 + 3 * T + 1).unsqueeze(0)  # [1, 3T + 1]


def _cache(manager: KVManager) -> SequenceKV:
    config = TieredCacheConfig(device_budget_bytes=8 * manager.layout.chunk_nbytes)
    return SequenceKV(manager, [None] * LAYERS, config, torch.device("cpu"))


def _prefill(kv: SequenceKV, ids: torch.Tensor, seed: int = 0) -> None:
    """One pass over ``ids [1, N]`` with random K/V."""
    gen = torch.Generator().manual_seed(seed)
    n = ids.shape[1]
    kv.begin_forward(n, 1, ids)
    for layer in range(LAYERS):
        keys = torch.randn(1, HKV, n, DIM, generator=gen)
        kv.write(layer, keys, torch.randn(1, HKV, n, DIM, generator=gen))
    kv.end_forward()


@pytest.fixture
def sealed() -> Iterator[tuple[KVManager, list[ChunkRef]]]:
    """A manager whose host holds the 3 chunks of ``IDS``, and their refs."""
    layout = KVLayout(LAYERS, HKV, DIM, chunk_tokens=T)
    host = HostConfig(capacity_bytes=32 * layout.chunk_nbytes)
    with KVManager(layout, "adopt-test", ManagerConfig(chunk_tokens=T, host=host)) as manager:
        first = _cache(manager)
        _prefill(first, IDS)  # seals 3 chunks into host
        refs = list(first.state.refs[0])
        first.close()
        yield manager, refs


def test_loaded_chunks_follow_the_sealed_ones_of_their_chain(
    sealed: tuple[KVManager, list[ChunkRef]],
) -> None:
    manager, refs = sealed
    kv = _cache(manager)
    assert kv.adopt_loaded(IDS, refs[1:]) == 0  # chunk 1 does not start an empty chain
    assert kv.adopt_loaded(IDS, refs[:1]) == T
    assert kv.adopt_loaded(IDS, refs[2:]) == 0  # chunk 2 does not follow chunk 0
    assert kv.adopt_loaded(IDS, refs[1:]) == 2 * T
    assert kv.state.refs[0] == refs and kv.seq_len == 3 * T
    assert kv.reused_tokens == 3 * T
    assert torch.equal(kv.state.token_ids, IDS[:, : 3 * T])
    kv.close()


def test_nothing_is_adopted_after_a_tail_or_when_host_lacks_the_chunk(
    sealed: tuple[KVManager, list[ChunkRef]],
) -> None:
    manager, refs = sealed
    kv = _cache(manager)
    _prefill(kv, IDS[:, : T + 3])  # one chunk computed, and a tail of 3 tokens
    assert kv.adopt_loaded(IDS, refs[1:]) == 0
    kv.close()
    kv = _cache(manager)
    manager.host.remove([refs[1]])
    assert kv.adopt_loaded(IDS, refs[:3]) == T  # the leading run host holds
    assert kv.seq_len == T
    kv.close()
