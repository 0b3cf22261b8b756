"""Configuration: frozen dataclasses, one per part, validated on construction.

Every validation error is a ``ValueError`` that names the field and the accepted values,
so a bad CLI flag or config reads as one actionable line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from kvtier.policy.registry import EVICTION_POLICIES
from kvtier.validate import check_int

GiB = 1 << 30
MiB = 1 << 20

WRITE_POLICIES = ("write_through", "write_back")
CODEC_NAMES = ("raw", "fp8", "int8", "int4")
"""The chunk codecs a tier may store in (``kvtier.codec.CODECS``; named here so the
config stays free of torch). Only ``raw`` is exact; the others change tokens a little."""
CODEC_HELP = (
    "raw is exact; fp8/int8/int4 store 1/4 to 1/8 of the bytes and change tokens a little "
    "(docs/benchmarks.md, bench codec)"
)
"""The command lines' help for a tier's ``--*-codec`` flag."""


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


@dataclass(frozen=True, kw_only=True)
class TierConfig:
    """One tier of the manager's stack. Subclasses set ``kind``, the key of the tier
    registry (``kvtier.tiers.registry.TIER_KINDS``) that builds the tier; the tier is called
    by its kind in lookups, stats and ``KVManager.tier``.

    Attributes:
        capacity_bytes: the tier's byte budget (of stored bytes: a compressed tier holds
            more chunks in it).
        eviction_policy: registry name of the eviction policy.
        codec: the format chunks are stored in (``kvtier.codec``): ``raw`` (exact, the
            default), ``fp8``, ``int8`` or ``int4`` (a quarter to an eighth of the bytes, at
            a measured cost in tokens: ``kvtier bench codec``). Encoded as chunks are
            written in, decoded as they are read out (below host: on the link's worker); a
            chunk stored with another codec is not read (a miss: recomputed).
    """

    kind: ClassVar[str] = ""
    capacity_bytes: int = 0
    eviction_policy: str = "lru"
    codec: str = "raw"

    def __post_init__(self) -> None:
        check_int(f"{self.kind}.capacity_bytes", self.capacity_bytes)
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ValueError(
                f"{self.kind}.eviction_policy: unknown policy {self.eviction_policy!r}; "
                f"accepted: {sorted(EVICTION_POLICIES)}"
            )
        if self.codec not in CODEC_NAMES:
            raise ValueError(
                f"{self.kind}.codec: unknown {self.codec!r}; accepted: {list(CODEC_NAMES)}"
            )


@dataclass(frozen=True, kw_only=True)
class LowerTierConfig(TierConfig):
    """A tier below host, with the link that joins it to the tier above.

    Attributes:
        link: the link between the tier above and this one (its worker runs every copy
            between them: promotions up, write-through and write-back down).
        write_queue_chunks: chunks evicted from the tier above that may wait for the link
            at once (each waits in a spare chunk-sized buffer); when the queue is full the
            oldest waiting write is dropped and counted (``ManagerStats.write_backs_dropped``)
            and that chunk is recomputed if it is needed again. 0: evicted chunks are dropped.
    """

    link: LinkConfig = field(default_factory=LinkConfig)
    write_queue_chunks: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int(f"{self.kind}.write_queue_chunks", self.write_queue_chunks)


@dataclass(frozen=True, kw_only=True)
class HostConfig(TierConfig):
    """The host DRAM tier, always the first. ``pin_memory=None`` pins when CUDA is available.

    A lossy ``codec`` here holds 3.8x (int8) to 7x (int4) more chunks in the same DRAM and
    moves that many fewer bytes over the device link (decoded on the link's worker into the
    staging ring), but host attention needs float32 in place: with it, ``placement``
    ``host`` is refused and ``auto`` streams.
    """

    kind: ClassVar[str] = "host"
    capacity_bytes: int = 4 * GiB
    pin_memory: bool | None = None


@dataclass(frozen=True, kw_only=True)
class DiskConfig(LowerTierConfig):
    """The local disk tier.

    Attributes:
        path: directory of the segment files (created if missing).
        capacity_bytes: bytes of chunk data; at least one chunk (checked when the tier is
            built, which knows the chunk size).
        fsync: make every write durable against power loss (``fdatasync``); without it a
            landed write still survives the process being killed.
    """

    kind: ClassVar[str] = "disk"
    path: str
    capacity_bytes: int = 32 * GiB
    fsync: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path.strip():
            raise ValueError(f"disk.path: must be a directory path, got {self.path!r}")
        super().__post_init__()


@dataclass(frozen=True, kw_only=True)
class RemoteConfig(LowerTierConfig):
    """A tier in Redis that every kvtier instance pointed at it shares
    (``kvtier.tiers.remote``): a Redis Cluster, or one server.

    Every chunk host stores is also queued for the store (write-through, whatever the
    manager's write policy); a miss in host and disk reads through to it.

    Attributes:
        url: ``redis://[user:password@]host:port`` (``rediss://`` for TLS); for a cluster,
            one or more nodes, ``host:port,host:port``: any one that answers leads the
            client to the rest. AUTH comes from the URL.
        cluster: True: Redis Cluster (``RedisCluster``); False: one server; None: ask the
            server (``CLUSTER INFO``) at start.
        key_prefix: every key starts with ``{key_prefix}:`` (an ACL user can be limited to
            ``~{key_prefix}:*``).
        ttl_s: a chunk expires this long after it was written; None: never (the store's
            own ``maxmemory`` policy then bounds it).
        timeout_s: each call to the store gives up after this long; the chunk is then
            recomputed.
        retry_after_s: after a failed call the tier is skipped this long (calls return at
            once as misses), then one call tries again.
        write_behind_chunks: chunks host stored that wait to be written to the store (their
            refs; the bytes are read from host when written); when full, the oldest waiting
            write is dropped and counted (``TierStats.writes_dropped``).
        tls_ca_certs: a CA bundle file for ``rediss://`` (None: the system's).
        capacity_bytes: the most bytes of values this instance keeps in the store (what it
            wrote; past it, its least recently used values are deleted). The store as a
            whole is bounded by the sum of its instances' caps, the TTL, and Redis's
            ``maxmemory``.
    """

    kind: ClassVar[str] = "remote"
    url: str
    cluster: bool | None = None
    key_prefix: str = "kvtier"
    ttl_s: float | None = 24 * 3600.0
    timeout_s: float = 0.5
    retry_after_s: float = 2.0
    write_behind_chunks: int = 64
    tls_ca_certs: str | None = None
    capacity_bytes: int = 64 * GiB

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url.startswith(("redis://", "rediss://")):
            raise ValueError(
                f"remote.url: must be redis://host:port or rediss://…, got {self.url!r}"
            )
        if not self.key_prefix or any(c in self.key_prefix for c in " :{}*?"):
            raise ValueError(
                f"remote.key_prefix: a non-empty name without spaces, ':', '{{}}', '*' or '?', "
                f"got {self.key_prefix!r}"
            )
        for name, value in (("timeout_s", self.timeout_s), ("retry_after_s", self.retry_after_s)):
            if not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"remote.{name}: must be > 0 seconds, got {value!r}")
        check_int("remote.write_behind_chunks", self.write_behind_chunks, 1)
        if self.ttl_s is not None and not self.ttl_s >= 0.001:
            raise ValueError(f"remote.ttl_s: must be >= 0.001 s or None, got {self.ttl_s!r}")
        super().__post_init__()


@dataclass(frozen=True)
class ManagerConfig:
    """The KV manager: chunking, the tier stack and the write policy.

    The stack is ``tiers``: host first, then ``lower_tiers`` in order, each slower and
    larger than the one above, with one link between each adjacent pair::

        ManagerConfig(
            chunk_tokens=256,
            host=HostConfig(capacity_bytes=4 * GiB),
            lower_tiers=(DiskConfig(path="/var/kv", link=LinkConfig(gbps=2.0)),),
        )

    Attributes:
        chunk_tokens: tokens per chunk.
        write_policy: ``write_through`` copies each sealed chunk down the whole stack when
            it is stored; ``write_back`` copies a chunk one tier down only when it is
            evicted.
        tenant_salt: isolates tenants: KV is never reused across different salts.
        host: the host tier (always present: sealed chunks land there).
        lower_tiers: the tiers below host, fastest first (e.g. disk); kinds are unique.
    """

    chunk_tokens: int = 256
    write_policy: str = "write_back"
    tenant_salt: str = ""
    host: HostConfig = field(default_factory=HostConfig)
    lower_tiers: tuple[LowerTierConfig, ...] = ()

    def __post_init__(self) -> None:
        check_int("chunk_tokens", self.chunk_tokens, 1)
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(
                f"write_policy: unknown {self.write_policy!r}; accepted: {list(WRITE_POLICIES)}"
            )
        if not isinstance(self.host, HostConfig):
            raise ValueError(f"host: must be a HostConfig, got {type(self.host).__name__}")
        object.__setattr__(self, "lower_tiers", tuple(self.lower_tiers))
        kinds = ["host"]
        for i, tier in enumerate(self.lower_tiers):
            if not isinstance(tier, LowerTierConfig):
                raise ValueError(
                    f"lower_tiers[{i}]: must be a tier config below host (e.g. DiskConfig), "
                    f"got {type(tier).__name__}"
                )
            if tier.kind in kinds:
                raise ValueError(f"lower_tiers[{i}].kind: {tier.kind!r} is in the stack twice")
            kinds.append(tier.kind)

    @property
    def tiers(self) -> tuple[TierConfig, ...]:
        """The whole stack, fastest first: host, then ``lower_tiers``."""
        return (self.host, *self.lower_tiers)

    def lower_tier(self, kind: str) -> LowerTierConfig | None:
        """The config of the lower tier of this kind, or None when the stack has none."""
        return next((t for t in self.lower_tiers if t.kind == kind), None)


def lower_tiers_of(
    disk_dir: str | None,
    disk_mb: int,
    remote: str | None,
    remote_prefix: str,
    remote_ttl_s: float,
    remote_timeout_s: float,
    remote_mb: int,
    disk_codec: str = "raw",
    remote_codec: str = "raw",
    eviction_policy: str = "lru",
) -> tuple[LowerTierConfig, ...]:
    """The tiers below host that ``kvtier serve``'s flags (and the vLLM connector's keys of
    the same names) ask for: a disk tier in ``disk_dir``, then the shared one at ``remote``
    (``remote_ttl_s`` 0: chunks never expire), each in its codec; the disk tier evicts by
    ``eviction_policy``. Raises ``ValueError`` as the configs do."""
    tiers: list[LowerTierConfig] = []
    if disk_dir is not None:
        tiers.append(
            DiskConfig(
                path=disk_dir,
                capacity_bytes=disk_mb * MiB,
                codec=disk_codec,
                eviction_policy=eviction_policy,
            )
        )
    if remote is not None:
        tiers.append(
            RemoteConfig(
                url=remote,
                key_prefix=remote_prefix,
                ttl_s=remote_ttl_s or None,
                timeout_s=remote_timeout_s,
                capacity_bytes=remote_mb * MiB,
                codec=remote_codec,
            )
        )
    return tuple(tiers)


@dataclass(frozen=True)
class PlacementRates:
    """Measured rates the choice is made from (GB/s are 1e9 bytes per second).

    Attributes:
        link_gbps: host→device copies over the link.
        host_attention_gbps: KV bytes per second attention reads on the host.
        device_attention_gbps: KV bytes per second attention reads on the device.
        compute_s: the rest of a pass on the device (projections, MLP, resident
            attention), behind which streaming hides.
        concurrent: host attention runs beside the device's work (the device is a GPU);
            False: on the same cores (a CPU-only machine).
    """

    link_gbps: float
    host_attention_gbps: float
    device_attention_gbps: float
    compute_s: float = 0.0
    concurrent: bool = False

    def __post_init__(self) -> None:
        for name in ("link_gbps", "host_attention_gbps", "device_attention_gbps"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"{name}: must be > 0 GB/s, got {value!r}")
        if not self.compute_s >= 0:
            raise ValueError(f"compute_s: must be >= 0, got {self.compute_s!r}")


PLACEMENTS = ("stream", "host", "auto")
"""``TieredCacheConfig.placement``'s values."""


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
        page_tokens: the granularity of reuse inside a chunk: a sequence's last partial
            chunk is stored with its first whole pages (``SequenceKV.seal_partial``), so a
            prefix hit recomputes fewer than ``page_tokens`` tokens past the last whole chunk
            (the lower tiers still move whole chunks). ``chunk_tokens`` or more: whole chunks
            only.
        query_block_tokens: queries attended per block in a long prefill, bounding the
            score matrix to ``heads × block × keys`` (off the CPU; the CPU's fused flash
            kernel tiles the queries itself and takes them in one block).
        link: the device⇄host link (throttle it to reproduce PCIe on a CPU-only machine).
        device: where the device tier lives; None picks CUDA when available, else the CPU.
        placement: where a pass reads the chunks that are not resident: ``stream`` them
            over the link (the default), attend them in the ``host`` pool where they lie
            (the query goes to the host; the output and its log-sum-exp come back and merge
            exactly), or ``auto``: per pass and layer group, as many on the host as the
            cost model (``kvtier.runtime.cost``) predicts fastest from ``rates``.
        rates: the measured rates ``auto`` chooses from; None: the engine and
            ``TieredCache`` read this machine's ``kvtier calibrate`` profile of the model
            (``kvtier.calibrate.resolve_rates``). A ``link`` throttle caps the link rate.
    """

    device_budget_bytes: int = 1 * GiB
    staging_bytes: int = 64 * MiB
    lookahead: int = 2
    prefetch: bool = True
    sink_chunks: int = 1
    query_block_tokens: int = 512
    page_tokens: int = 16
    link: LinkConfig = field(default_factory=LinkConfig)
    device: str | None = None
    placement: str = "stream"
    rates: PlacementRates | None = None

    def __post_init__(self) -> None:
        check_int("device_budget_bytes", self.device_budget_bytes)
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement: unknown {self.placement!r}; accepted: {list(PLACEMENTS)}")
        check_int("staging_bytes", self.staging_bytes, 1)
        check_int("lookahead", self.lookahead)
        check_int("sink_chunks", self.sink_chunks)
        check_int("query_block_tokens", self.query_block_tokens, 1)
        check_int("page_tokens", self.page_tokens, 1)
