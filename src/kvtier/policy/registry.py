"""The eviction policies by name, as ``TierConfig.eviction_policy`` and the CLI spell them.

Every base policy also comes as ``NAME+prefix``: the same order under the prefix-aware
rule (``kvtier.policy.prefix``: a chunk whose children are held leaves after them).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from kvtier.policy.arc import ARCPolicy
from kvtier.policy.eviction import EvictionPolicy, FIFOPolicy, LRUPolicy
from kvtier.policy.prefix import PrefixAwarePolicy
from kvtier.policy.s3fifo import S3FIFOPolicy

PREFIX_SUFFIX = "+prefix"

BASE_POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LRUPolicy,
    "fifo": FIFOPolicy,
    "s3fifo": S3FIFOPolicy,
    "arc": ARCPolicy,
}


def _prefix_aware(base: Callable[[], EvictionPolicy]) -> EvictionPolicy:
    return PrefixAwarePolicy(base())


EVICTION_POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    **BASE_POLICIES,
    **{name + PREFIX_SUFFIX: partial(_prefix_aware, make) for name, make in BASE_POLICIES.items()},
}


def make_policy(name: str) -> EvictionPolicy:
    """A new policy by registry name; ``ValueError`` names the accepted values."""
    try:
        return EVICTION_POLICIES[name]()
    except KeyError:
        raise ValueError(
            f"eviction_policy: unknown policy {name!r}; accepted: {sorted(EVICTION_POLICIES)}"
        ) from None
