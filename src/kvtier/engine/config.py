"""Engine configuration: admission, context and the KV tiers it serves from."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.config import HostConfig, ManagerConfig, MiB, TieredCacheConfig


@dataclass(frozen=True)
class EngineConfig:
    """The serving engine.

    Attributes:
        max_queued: requests waiting for admission (the running one not counted); a
            ``submit`` beyond this raises ``QueueFullError``.
        max_model_len: longest sequence (prompt + output) accepted; None takes the model
            config's ``max_position_embeddings``.
        cache: the per-sequence device cache (device budget, staging, device⇄host link).
        manager: the shared tiers below the device (host, disk), chunk size and write
            policy: the KV every request can reuse.
    """

    max_queued: int = 64
    max_model_len: int | None = None
    cache: TieredCacheConfig = field(
        default_factory=lambda: TieredCacheConfig(device_budget_bytes=256 * MiB)
    )
    manager: ManagerConfig = field(
        default_factory=lambda: ManagerConfig(host=HostConfig(capacity_bytes=1024 * MiB))
    )

    def __post_init__(self) -> None:
        if isinstance(self.max_queued, bool) or not isinstance(self.max_queued, int):
            raise ValueError(f"max_queued: must be an integer >= 1, got {self.max_queued!r}")
        if self.max_queued < 1:
            raise ValueError(f"max_queued: must be an integer >= 1, got {self.max_queued!r}")
        if self.max_model_len is not None and (
            not isinstance(self.max_model_len, int) or self.max_model_len < 2
        ):
            raise ValueError(
                f"max_model_len: must be an integer >= 2 or None (the model's), "
                f"got {self.max_model_len!r}"
            )
