"""Pluggable policies: eviction (and later the cost model)."""

from __future__ import annotations

from kvtier.policy.eviction import EvictionPolicy, LRUPolicy
from kvtier.policy.registry import EVICTION_POLICIES, make_policy

__all__ = ["EVICTION_POLICIES", "EvictionPolicy", "LRUPolicy", "make_policy"]
