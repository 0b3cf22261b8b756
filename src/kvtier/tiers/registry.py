"""The tier registry: from a tier config's ``kind`` to the code that builds the tier.

``KVManager`` builds its stack from ``ManagerConfig.tiers`` through ``build_tier`` and
knows no kind by name. A new kind of tier is one module (its ``LowerTierConfig`` subclass,
its ``Tier`` subclass and a build function) plus one entry in ``TIER_KINDS``.

The registry is a module constant, filled at import and read-only afterwards.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from kvtier.config import DiskConfig, HostConfig, RemoteConfig, TierConfig
from kvtier.kv.layout import KVLayout
from kvtier.tiers.base import Tier
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.pool import host_tier

ConfigT = TypeVar("ConfigT", bound=TierConfig)


@dataclass(frozen=True)
class TierKind(Generic[ConfigT]):
    """One registered kind of tier.

    Attributes:
        config_type: the config class of this kind (its ``kind`` is the registry key).
        build: makes the tier from its config and the chunk layout; may raise
            ``ValueError`` naming a config field (e.g. a path it cannot use).
    """

    config_type: type[ConfigT]
    build: Callable[[ConfigT, KVLayout], Tier]


def _build_host(config: HostConfig, layout: KVLayout) -> Tier:
    return host_tier(
        layout, config.capacity_bytes, config.pin_memory, config.eviction_policy, config.codec
    )


def _build_disk(config: DiskConfig, layout: KVLayout) -> Tier:
    return DiskTier(
        layout,
        config.path,
        config.capacity_bytes,
        eviction_policy=config.eviction_policy,
        fsync=config.fsync,
        codec=config.codec,
    )


def _build_remote(config: RemoteConfig, layout: KVLayout) -> Tier:
    from kvtier.tiers.remote import RemoteTier  # redis-py is imported only when used

    return RemoteTier(layout, config)


TIER_KINDS: dict[str, TierKind[Any]] = {
    HostConfig.kind: TierKind(HostConfig, _build_host),
    DiskConfig.kind: TierKind(DiskConfig, _build_disk),
    RemoteConfig.kind: TierKind(RemoteConfig, _build_remote),
}


def build_tier(config: TierConfig, layout: KVLayout) -> Tier:
    """The tier ``config`` describes, named by its kind.

    Raises:
        ValueError: no kind is registered under ``config.kind``, the config is not that
            kind's config class, or the kind's builder refused the config.
    """
    entry = TIER_KINDS.get(config.kind)
    if entry is None:
        raise ValueError(
            f"{type(config).__name__}.kind: no tier kind {config.kind!r} is registered; "
            f"known: {sorted(TIER_KINDS)}"
        )
    if not isinstance(config, entry.config_type):
        raise ValueError(
            f"{config.kind}: expected a {entry.config_type.__name__}, got {type(config).__name__}"
        )
    tier = entry.build(config, layout)
    if tier.name != config.kind:
        raise ValueError(f"{config.kind}: its builder made a tier named {tier.name!r}")
    return tier
