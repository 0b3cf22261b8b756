"""Two engines on one Redis Cluster share KV: the second finds the first's chunks in the
shared tier (counted by tier), with identical tokens; tenants' salts hold across them."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from kvbench.redis_cluster import RedisCluster, available
from kvtier.engine import Engine, EngineConfig, SamplingParams
from tests.engine.tiny import CHUNK, engine_config, reference_tokens, with_remote

pytestmark = pytest.mark.skipif(available() is not None, reason=f"no Redis: {available()}")

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT = list(range(500, 500 + 6 * CHUNK + 3))


def shared(cluster: RedisCluster, prefix: str) -> EngineConfig:
    """The tiny engine with the shared tier below host (no disk)."""
    return with_remote(engine_config(), cluster.url, prefix)


def test_a_second_instance_reuses_the_first_ones_kv_through_the_cluster(
    model: Any, tokenizer: Any, redis_cluster: RedisCluster
) -> None:
    prefix = f"test{uuid.uuid4().hex[:12]}"
    with Engine(model, tokenizer, shared(redis_cluster, prefix)) as a:
        first = a.submit(PROMPT, GREEDY, cache_salt="tenant-a").result()
    assert first.reused_tokens == 0
    with Engine(model, tokenizer, shared(redis_cluster, prefix)) as b:  # its host is empty
        again = b.submit(PROMPT, GREEDY, cache_salt="tenant-a").result()
        other = b.submit(PROMPT, GREEDY, cache_salt="tenant-b").result()
        stats = b.stats()
    expected = reference_tokens(model, PROMPT, GREEDY.max_tokens)
    assert first.token_ids == again.token_ids == other.token_ids == expected
    assert again.reused_tokens == 6 * CHUNK
    assert stats.reused_tokens_by_tier == {"remote": 6 * CHUNK}
    assert other.reused_tokens == 0  # another tenant's salt: nothing crosses
    assert stats.manager is not None
    remote = stats.manager.tiers["remote"]
    assert remote.hits == 6 and remote.corrupt_dropped == 0
