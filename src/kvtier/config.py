"""Configuration: frozen dataclasses, one per part, validated on construction.

Every validation error is a ``ValueError`` that names the field and the accepted values,
so a bad CLI flag or config reads as one actionable line.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.policy.eviction import EVICTION_POLICIES
from kvtier.validate import check_int

GiB = 1 << 30
MiB = 1 << 20

WRITE_POLICIES = ("write_through", "write_back")


def _check_policy(name: str, value: str) -> None:
    if value not in EVICTION_POLICIES:
        raise ValueError(f"{name}: unknown policy {value!r}; accepted: {sorted(EVICTION_POLICIES)}")


@dataclass(frozen=True)
class LinkConfig:
    """A copy link between two adjacent tiers.

    Attributes:
        gbps: throttle to this bandwidth (GB/s, 1e9 bytes); None runs at the real speed.
        latency_ms: added per transfer step when throttled.
        max_inflight_bytes: back-pressure bound on bytes submitted but not yet copied.
    """

    gbps: float | None = None
    latency_ms: float = 0.0
    max_inflight_bytes: int = 256 * MiB

    def __post_init__(self) -> None:
        if self.gbps is not None and not self.gbps > 0:
            raise ValueError(f"link.gbps: must be > 0 GB/s or None (unthrottled), got {self.gbps}")
        if not self.latency_ms >= 0:
            raise ValueError(f"link.latency_ms: must be >= 0, got {self.latency_ms}")
        check_int("link.max_inflight_bytes", self.max_inflight_bytes, 1)


@dataclass(frozen=True)
class DeviceConfig:
    """The device tier. ``device=None`` picks CUDA when available, else a CPU RAM budget."""

    budget_bytes: int = 1 * GiB
    device: str | None = None
    eviction_policy: str = "lru"

    def __post_init__(self) -> None:
        check_int("device.budget_bytes", self.budget_bytes)
        _check_policy("device.eviction_policy", self.eviction_policy)


@dataclass(frozen=True)
class HostConfig:
    """The host DRAM tier. ``pin_memory=None`` pins when CUDA is available."""

    capacity_bytes: int = 4 * GiB
    pin_memory: bool | None = None
    eviction_policy: str = "lru"

    def __post_init__(self) -> None:
        check_int("host.capacity_bytes", self.capacity_bytes)
        _check_policy("host.eviction_policy", self.eviction_policy)


@dataclass(frozen=True)
class DiskConfig:
    """The local disk tier; ``path=None`` disables it.

    Attributes:
        path: directory of the segment files (created if missing); None: no disk tier.
        capacity_bytes: bytes of chunk data; at least one chunk (checked when the tier is
            built, which knows the chunk size).
        fsync: make every write durable against power loss (``fdatasync``); without it a
            landed write still survives the process being killed.
        eviction_policy: registry name of the eviction policy.
        write_buffers: spare host chunks that carry chunks evicted from host to disk on
            the host⇄disk link, so eviction does not write to disk on the compute thread;
            0 writes every evicted chunk synchronously.
    """

    path: str | None = None
    capacity_bytes: int = 32 * GiB
    fsync: bool = True
    eviction_policy: str = "lru"
    write_buffers: int = 4

    def __post_init__(self) -> None:
        if self.path is not None and not str(self.path).strip():
            raise ValueError("disk.path: must be a directory path or None (no disk tier)")
        check_int("disk.capacity_bytes", self.capacity_bytes)
        check_int("disk.write_buffers", self.write_buffers)
        _check_policy("disk.eviction_policy", self.eviction_policy)


@dataclass(frozen=True)
class ManagerConfig:
    """The KV manager: chunking, tiers, links and write policy.

    Attributes:
        chunk_tokens: tokens per chunk.
        write_policy: ``write_through`` writes each sealed chunk to disk when it is stored;
            ``write_back`` writes it to disk only when the host evicts it.
        tenant_salt: isolates tenants: KV is never reused across different salts.
        device: the device tier, or None when the caller keeps device KV itself.
        host: the host tier.
        disk: the disk tier.
        host_disk_link: the link that carries host⇄disk copies.
    """

    chunk_tokens: int = 256
    write_policy: str = "write_back"
    tenant_salt: str = ""
    device: DeviceConfig | None = None
    host: HostConfig = field(default_factory=HostConfig)
    disk: DiskConfig = field(default_factory=DiskConfig)
    host_disk_link: LinkConfig = field(default_factory=LinkConfig)

    def __post_init__(self) -> None:
        check_int("chunk_tokens", self.chunk_tokens, 1)
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(
                f"write_policy: unknown {self.write_policy!r}; accepted: {list(WRITE_POLICIES)}"
            )


@dataclass(frozen=True)
class TieredCacheConfig:
    """The transformers drop-in cache.

    Attributes:
        device_budget_bytes: bytes of KV the device may hold: resident sealed chunks plus one
            tail chunk per sequence. Streaming staging comes on top (``staging_bytes``).
        staging_bytes: fixed device allowance for chunks streamed in from the host, split
            into ``lookahead + 1`` ring slots.
        lookahead: pieces (a layer's non-resident chunks, or part of them) in flight ahead
            of the layer being computed.
        prefetch: stream ahead of need; False fetches each piece only when a layer needs it
            (the synchronous baseline).
        sink_chunks: leading chunks of each sequence pinned on the device (attention sinks).
        query_block_tokens: queries attended per block in a long prefill, bounding the
            score matrix to ``heads × block × keys`` (off the CPU; the CPU's fused flash
            kernel tiles the queries itself and takes them in one block).
        link: the device⇄host link (throttle it to reproduce PCIe on a CPU-only machine).
        device: where the device tier lives; None picks CUDA when available, else the CPU.
    """

    device_budget_bytes: int = 1 * GiB
    staging_bytes: int = 64 * MiB
    lookahead: int = 2
    prefetch: bool = True
    sink_chunks: int = 1
    query_block_tokens: int = 512
    link: LinkConfig = field(default_factory=LinkConfig)
    device: str | None = None

    def __post_init__(self) -> None:
        check_int("device_budget_bytes", self.device_budget_bytes)
        check_int("staging_bytes", self.staging_bytes, 1)
        check_int("lookahead", self.lookahead)
        check_int("sink_chunks", self.sink_chunks)
        check_int("query_block_tokens", self.query_block_tokens, 1)
