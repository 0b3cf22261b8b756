"""A factory that builds every kind of tier, so contract tests run over all of them."""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvtier.kv import KVLayout
from kvtier.tiers import Tier, device_tier, host_tier

TIER_KINDS = ["device", "host", "disk"]

TierFactory = Callable[..., Tier]


def build_tier(
    kind: str, layout: KVLayout, num_slots: int, folder: Path, policy: str = "lru"
) -> Tier:
    capacity_bytes = num_slots * layout.chunk_nbytes
    if kind == "device":
        return device_tier(layout, capacity_bytes, "cpu", eviction_policy=policy)
    if kind == "host":
        return host_tier(layout, capacity_bytes, pin_memory=False, eviction_policy=policy)
    if kind == "disk":
        from kvtier.tiers.disk import DiskTier

        return DiskTier(layout, str(folder), capacity_bytes, eviction_policy=policy)
    raise ValueError(kind)


@pytest.fixture(params=TIER_KINDS)
def tier_factory(request: pytest.FixtureRequest, layout: KVLayout) -> Iterator[TierFactory]:
    """Yields ``make(num_slots, policy="lru") -> Tier`` for one tier kind; closes them all."""
    made: list[Tier] = []
    dirs: list[tempfile.TemporaryDirectory[str]] = []

    def make(num_slots: int, policy: str = "lru") -> Tier:
        folder = tempfile.TemporaryDirectory(prefix="kvtier-tier-")
        dirs.append(folder)
        tier = build_tier(request.param, layout, num_slots, Path(folder.name), policy)
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()
    for folder in dirs:
        folder.cleanup()
