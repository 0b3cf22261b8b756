"""A sequence's own sealed chunk lost from every tier mid-sequence: ``ChunkLostError``,
with nothing left pinned and the loss counted, and a resume through ``reuse_prefix``
recomputes exactly what was lost."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvtier.config import HostConfig, ManagerConfig, TieredCacheConfig
from kvtier.hf import TieredCache
from kvtier.kv import KVLayout
from kvtier.manager import KVManager
from kvtier.models import model_identity, random_model
from kvtier.tiers import ChunkLostError

CHUNK = 16


def test_lost_chunk_raises_chunk_lost_and_a_resume_recomputes_it() -> None:
    model = random_model("llama", seed=3)
    layout = KVLayout.from_model_config(model.config, torch.float32, CHUNK)
    manager = KVManager(
        layout,
        model_identity(model),
        ManagerConfig(chunk_tokens=CHUNK, host=HostConfig(capacity_bytes=64 * layout.chunk_nbytes)),
    )
    # Two resident chunks: one tail, one sink; the rest stream from host.
    config = TieredCacheConfig(
        device_budget_bytes=2 * layout.chunk_nbytes, staging_bytes=2 * layout.layer_nbytes
    )
    ids = torch.randint(3, 256, (1, 81), generator=torch.Generator().manual_seed(5))
    cache = TieredCache(model, config, manager)
    with torch.no_grad():
        model(ids[:, :80], cache=cache)  # five sealed chunks
        assert len(cache.kv.state.refs[0]) == 5
        lost = cache.kv.state.refs[0][2]
        assert manager.host.remove([lost]) == 1  # gone from every tier (never on disk)
        assert not any(pool.contains(lost) for pool in cache.kv.arena.pools)
        with pytest.raises(ChunkLostError) as caught:
            model(ids[:, 80:81], cache=cache)
        assert caught.value.cause == "missing" and caught.value.num_chunks == 3
        assert not any(
            manager.host.is_pinned(r.key) for r in cache.kv.state.refs[0]
        )  # none left pinned
        assert manager.stats().recomputed_chunks_by_cause == {"corrupt": 0, "missing": 1}

        cache.reset()  # the resume: adopt what is left, recompute the rest
        assert cache.reuse_prefix(ids) == 2 * CHUNK
        logits = model(ids[:, 2 * CHUNK :], cache=cache).logits[:, -1]
        reference = model(ids, cache=DynamicCache(config=model.config)).logits[:, -1]
    torch.testing.assert_close(logits, reference, atol=1e-4, rtol=1e-4)
    manager.close()
