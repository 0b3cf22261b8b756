"""TieredCache: exact greedy equality with DynamicCache, budgets, reuse, on tiny models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from kvtier.config import DiskConfig, HostConfig, ManagerConfig, TieredCacheConfig
from kvtier.hf import TieredCache
from kvtier.hf.generate import generate
from kvtier.kv import KVLayout
from kvtier.manager import KVManager
from kvtier.models import model_identity, random_model

CHUNK = 16
ARCHS = ["llama", "qwen2", "mistral"]


def tiny(arch: str, seed: int = 1) -> torch.nn.Module:
    return random_model(arch, seed=seed)


def layout_of(model: torch.nn.Module) -> KVLayout:
    return KVLayout.from_model_config(model.config, torch.float32, CHUNK)


def budget_config(model: torch.nn.Module, chunks: int, **kw: object) -> TieredCacheConfig:
    lay = layout_of(model)
    return TieredCacheConfig(
        device_budget_bytes=chunks * lay.chunk_nbytes, staging_bytes=2 * lay.layer_nbytes, **kw
    )


def reference(model: torch.nn.Module, ids: torch.Tensor, **kw: object) -> torch.Tensor:
    return model.generate(ids, cache=DynamicCache(config=model.config), **kw)


GREEDY = dict(max_new_tokens=24, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("budget_chunks", [1, 3, 64])
def test_greedy_tokens_equal_dynamic_cache(arch: str, budget_chunks: int) -> None:
    model = tiny(arch)
    ids = torch.randint(3, 256, (1, 83), generator=torch.Generator().manual_seed(3))
    expected = reference(model, ids, **GREEDY)
    cache = TieredCache(model, budget_config(model, budget_chunks), chunk_tokens=CHUNK)
    got = model.generate(ids, cache=cache, **GREEDY)
    assert torch.equal(got, expected)
    lay = layout_of(model)
    # The budget holds: resident chunks + one tail per row, from the cache's own accounting.
    pools = cache.kv.arena.pools
    assert pools and all(p.used_bytes <= p.capacity_bytes for p in pools)
    assert cache.peak_device_nbytes <= cache.config.device_budget_bytes
    assert cache.staging_nbytes <= cache.config.staging_bytes
    assert cache.stats().sealed_chunks == (83 + 24 - 1) // CHUNK
    if budget_chunks == 64:  # everything fits: a sealed chunk goes to host once, never back
        assert cache.stats().link.bytes == 0
        assert cache.kv.arena.open is not None and cache.kv.arena.open.device == cache.kv.device
    if budget_chunks == 1:  # only the tail fits: every sealed chunk streams every step
        assert cache.stats().link.bytes > 0
        assert sum(p.capacity_bytes for p in pools) == 0
    assert cache.device_nbytes <= budget_chunks * lay.chunk_nbytes


@pytest.mark.parametrize("prefetch", [True, False])
def test_batch_with_left_padding_and_sampling(prefetch: bool) -> None:
    model = tiny("llama", seed=2)
    ids = torch.randint(3, 256, (3, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 40, dtype=torch.long)
    mask[0, :7] = 0
    mask[2, :19] = 0
    kw = dict(attention_mask=mask, **GREEDY)
    cache = TieredCache(model, budget_config(model, 5, prefetch=prefetch), chunk_tokens=CHUNK)
    assert torch.equal(model.generate(ids, cache=cache, **kw), reference(model, ids, **kw))
    sample = dict(kw, do_sample=True, top_k=20, temperature=0.9)
    torch.manual_seed(5)
    expected = reference(model, ids, **sample)
    torch.manual_seed(5)
    cache = TieredCache(model, budget_config(model, 5, prefetch=prefetch), chunk_tokens=CHUNK)
    assert torch.equal(model.generate(ids, cache=cache, **sample), expected)


def test_direct_forward_calls_match_dynamic_cache() -> None:
    model = tiny("qwen2")
    ids = torch.randint(3, 256, (2, 50), generator=torch.Generator().manual_seed(1))
    dyn = DynamicCache(config=model.config)
    cache = TieredCache(model, budget_config(model, 4), chunk_tokens=CHUNK)
    with torch.no_grad():
        for start, stop in [(0, 23), (23, 24), (24, 50)]:
            a = model(ids[:, start:stop], cache=dyn).logits
            b = model(ids[:, start:stop], cache=cache).logits
            torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
    assert cache.get_seq_length() == dyn.get_seq_length() == 50


def test_attached_model_still_works_with_dynamic_cache() -> None:
    model = tiny("llama")
    ids = torch.randint(3, 256, (1, 30), generator=torch.Generator().manual_seed(4))
    expected = reference(model, ids, **GREEDY)
    TieredCache(model, budget_config(model, 3), chunk_tokens=CHUNK)  # switches attention
    assert torch.equal(reference(model, ids, **GREEDY), expected)


def shared_manager(model: torch.nn.Module, tmp_path: Path | None = None) -> KVManager:
    lay = layout_of(model)
    disk = (DiskConfig(path=str(tmp_path / "disk")),) if tmp_path else ()
    config = ManagerConfig(
        chunk_tokens=CHUNK, host=HostConfig(capacity_bytes=64 * lay.chunk_nbytes), lower_tiers=disk
    )
    return KVManager(lay, model_identity(model), config)


def test_next_turn_reuses_the_first_turns_kv_from_host() -> None:
    model = tiny("llama")
    manager = shared_manager(model)
    ids = torch.randint(3, 256, (1, 70), generator=torch.Generator().manual_seed(6))
    first = generate(model, TieredCache(model, budget_config(model, 2), manager), ids, **GREEDY)
    assert first.reused_tokens == 0
    follow_up = torch.randint(3, 256, (1, 9), generator=torch.Generator().manual_seed(7))
    turn2 = torch.cat([first.sequences, follow_up], dim=1)
    expected = reference(model, turn2, **GREEDY)
    cache = TieredCache(model, budget_config(model, 2), manager)
    second = generate(model, cache, turn2, **GREEDY)
    # Prompt and answer of turn 1 were sealed under content keys: every chunk it sealed
    # (its cache held all but the last generated token) is reused.
    assert second.reused_tokens == ((first.sequences.shape[1] - 1) // CHUNK) * CHUNK
    assert torch.equal(second.sequences, expected)
    assert manager.stats().tiers["host"].hits > 0


def test_reuse_from_disk_after_host_was_cleared(tmp_path: Path) -> None:
    model = tiny("qwen2")
    ids = torch.randint(3, 256, (1, 60), generator=torch.Generator().manual_seed(8))
    with shared_manager(model, tmp_path) as manager:
        generate(model, TieredCache(model, budget_config(model, 2), manager), ids, **GREEDY)
        manager.close(flush_host_to_disk=True)
    with shared_manager(model, tmp_path) as manager:  # a restart: host empty, disk warm
        cache = TieredCache(model, budget_config(model, 2), manager)
        result = generate(model, cache, ids, **GREEDY)
        assert result.reused_tokens == 48
        assert torch.equal(result.sequences, reference(model, ids, **GREEDY))
        assert manager.stats().tiers["disk"].hits >= 3


def test_different_weights_never_share_kv() -> None:
    a, b = tiny("llama", seed=1), tiny("llama", seed=9)
    assert model_identity(a) != model_identity(b)


def test_budget_below_one_tail_is_a_clear_error() -> None:
    model = tiny("llama")
    cache = TieredCache(model, TieredCacheConfig(device_budget_bytes=10), chunk_tokens=CHUNK)
    with pytest.raises(ValueError, match="device_budget_bytes"):
        model.generate(torch.ones(1, 5, dtype=torch.long), cache=cache, **GREEDY)
