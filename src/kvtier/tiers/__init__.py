"""Tiers: device, host and disk behind one interface (``Tier``).

The stack the manager builds comes from config through ``kvtier.tiers.registry``.
"""

from __future__ import annotations

from kvtier.tiers.base import ChunkLostError, PutResult, Tier, TierFullError, TierStats
from kvtier.tiers.disk import DiskFullError, DiskTier
from kvtier.tiers.pool import PoolTier, device_tier, host_tier

__all__ = [
    "ChunkLostError",
    "DiskFullError",
    "DiskTier",
    "PoolTier",
    "PutResult",
    "Tier",
    "TierFullError",
    "TierStats",
    "device_tier",
    "host_tier",
]
