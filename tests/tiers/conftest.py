"""A factory that builds every kind of tier, so contract tests run over all of them."""

from __future__ import annotations

import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvtier.kv import KVLayout
from kvtier.tiers import Tier, device_tier, host_tier

TIER_KINDS = ["device", "host", "disk", "remote"]

TierFactory = Callable[..., Tier]


def build_tier(
    kind: str,
    layout: KVLayout,
    num_slots: int,
    folder: Path,
    policy: str = "lru",
    redis_url: str | None = None,
) -> Tier:
    capacity_bytes = num_slots * layout.chunk_nbytes
    if kind == "device":
        return device_tier(layout, capacity_bytes, "cpu", eviction_policy=policy)
    if kind == "host":
        return host_tier(layout, capacity_bytes, pin_memory=False, eviction_policy=policy)
    if kind == "disk":
        from kvtier.tiers.disk import DiskTier

        return DiskTier(layout, str(folder), capacity_bytes, eviction_policy=policy)
    if kind == "remote":
        from kvtier.config import RemoteConfig
        from kvtier.tiers.remote import RemoteTier

        assert redis_url is not None
        prefix = f"test{uuid.uuid4().hex[:12]}"  # each tier its own keys on the one cluster
        # A timeout far above a loaded machine's latency: these contracts are not about it.
        config = RemoteConfig(url=redis_url, key_prefix=prefix, cluster=True, timeout_s=5.0)
        return RemoteTier(layout, config)
    raise ValueError(kind)


def needs_slots(tier: Tier) -> None:
    """Skip a contract about slots (capacity, pins, eviction order) on the shared tier:
    Redis is its index, and Redis's TTL and ``maxmemory`` policy evict."""
    if tier.name == "remote":
        pytest.skip("the remote tier has no slots, pins or eviction order of its own")


@pytest.fixture(params=TIER_KINDS)
def tier_factory(request: pytest.FixtureRequest, layout: KVLayout) -> Iterator[TierFactory]:
    """Yields ``make(num_slots, policy="lru") -> Tier`` for one tier kind; closes them all."""
    made: list[Tier] = []
    dirs: list[tempfile.TemporaryDirectory[str]] = []

    url = request.getfixturevalue("redis_cluster").url if request.param == "remote" else None

    def make(num_slots: int, policy: str = "lru") -> Tier:
        folder = tempfile.TemporaryDirectory(prefix="kvtier-tier-")
        dirs.append(folder)
        tier = build_tier(request.param, layout, num_slots, Path(folder.name), policy, url)
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()
    for folder in dirs:
        folder.cleanup()
