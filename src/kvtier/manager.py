"""The KV manager: where every chunk is, and the moves between tiers.

The manager owns an ordered list of tiers, fastest first (``device`` optional, ``host``,
``disk`` optional). It answers "longest cached prefix of these token ids, and which tier
holds each chunk", stores sealed chunks, promotes chunks on read, and keeps every tier
within its budget: a tier that evicts a chunk writes it to the next tier down first when
that tier does not hold it yet (so write-back loses nothing and write-through never writes
twice).

Thread-safety: every method is thread-safe (the tiers lock themselves). Lookups are a
snapshot: a chunk found by ``lookup`` can be evicted before it is fetched, and ``fetch_into``
then reports a miss for it; pin chunks to prevent that.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvtier.config import ManagerConfig
from kvtier.kv.chunk import Chunk, ChunkRef
from kvtier.kv.keys import KeyHasher, Namespace
from kvtier.kv.layout import KVLayout
from kvtier.tiers.base import Tier, TierStats
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.pool import device_tier, host_tier
from kvtier.transfer import CopyStep, Link, LinkStats, Throttle, TransferHandle


@dataclass(frozen=True)
class LookupResult:
    """The longest cached prefix of a token sequence.

    Attributes:
        hit_tokens: tokens covered by the cached chunks (a multiple of ``chunk_tokens``).
        refs: the cached chunks, in sequence order.
        tiers: for each chunk, the name of the fastest tier that holds it.
    """

    hit_tokens: int
    refs: list[ChunkRef] = field(default_factory=list)
    tiers: list[str] = field(default_factory=list)

    @property
    def by_tier(self) -> dict[str, int]:
        """Chunks served by each tier."""
        counts: dict[str, int] = {}
        for name in self.tiers:
            counts[name] = counts.get(name, 0) + 1
        return counts


@dataclass(frozen=True)
class ManagerStats:
    """Per-tier and per-link stats plus lookup counters (a consistent snapshot per part)."""

    tiers: dict[str, TierStats]
    links: dict[str, LinkStats]
    lookups: int
    lookup_tokens: int
    hit_tokens: int

    def table(self) -> str:
        """A plain-text table of what moved where."""
        head = f"{'tier':<8}{'chunks in':>10}{'MB in':>10}{'hits':>8}{'misses':>8}"
        head += f"{'MB out':>10}{'evicted':>9}{'corrupt':>9}{'GB/s in':>9}{'GB/s out':>9}"
        rows = [head]
        for name, s in self.tiers.items():
            rows.append(
                f"{name:<8}{s.puts:>10}{s.bytes_in / 1e6:>10.1f}{s.hits:>8}{s.misses:>8}"
                f"{s.bytes_out / 1e6:>10.1f}{s.evictions:>9}{s.corrupt_dropped:>9}"
                f"{s.put_gbps:>9.2f}{s.get_gbps:>9.2f}"
            )
        for name, ls in self.links.items():
            rows.append(
                f"link {name}: {ls.transfers} transfers, {ls.bytes / 1e6:.1f} MB, "
                f"{ls.achieved_gbps:.2f} GB/s achieved, waited {ls.wait_s * 1e3:.1f} ms"
            )
        if self.lookup_tokens:
            rows.append(
                f"prefix lookups: {self.lookups}, {self.hit_tokens}/{self.lookup_tokens} "
                f"tokens found cached ({100 * self.hit_tokens / self.lookup_tokens:.1f}%)"
            )
        return "\n".join(rows)


class KVManager:
    """Knows where every chunk is; stores, finds, promotes and evicts across tiers.

    Args:
        layout: the KV layout of the model.
        model_id: identity of the weights (part of every chunk key's namespace).
        config: tiers, links and policies.
        digest_bytes: chunk key length; shorten only to force collisions in tests.
    """

    def __init__(
        self,
        layout: KVLayout,
        model_id: str,
        config: ManagerConfig | None = None,
        digest_bytes: int = 16,
    ) -> None:
        self.config = config or ManagerConfig(chunk_tokens=layout.chunk_tokens)
        if self.config.chunk_tokens != layout.chunk_tokens:
            raise ValueError(
                f"chunk_tokens: config says {self.config.chunk_tokens} but the layout has "
                f"{layout.chunk_tokens}; build both with the same chunk size"
            )
        self.layout = layout
        self.hasher = KeyHasher(Namespace(model_id, layout, self.config.tenant_salt), digest_bytes)
        cfg = self.config
        self.device: Tier | None = None
        if cfg.device is not None:
            self.device = device_tier(
                layout, cfg.device.budget_bytes, cfg.device.device, cfg.device.eviction_policy
            )
        self.host: Tier = host_tier(
            layout, cfg.host.capacity_bytes, cfg.host.pin_memory, cfg.host.eviction_policy
        )
        self.disk: Tier | None = None
        if cfg.disk.path is not None:
            self.disk = DiskTier(
                layout,
                cfg.disk.path,
                cfg.disk.capacity_bytes,
                eviction_policy=cfg.disk.eviction_policy,
                fsync=cfg.disk.fsync,
            )
        self.tiers: list[Tier] = [t for t in (self.device, self.host, self.disk) if t is not None]
        for upper, lower in zip(self.tiers, self.tiers[1:], strict=False):
            upper.set_evict_hook(self._write_down_hook(lower))
        link_cfg = cfg.host_disk_link
        throttle = (
            Throttle(link_cfg.gbps, link_cfg.latency_ms) if link_cfg.gbps is not None else None
        )
        self.host_disk_link: Link | None = None
        if self.disk is not None:
            self.host_disk_link = Link("host<->disk", link_cfg.max_inflight_bytes, throttle)
        self._lock = threading.Lock()
        self._pending: list[TransferHandle] = []
        # One staging chunk for disk->host promotion; only the link's worker thread uses it.
        self._staging: torch.Tensor | None = None
        self._lookups = 0
        self._lookup_tokens = 0
        self._hit_tokens = 0

    # ---- keys and lookup ------------------------------------------------------------------

    def refs_for(self, token_ids: Sequence[int] | np.ndarray) -> list[ChunkRef]:
        """References of every full chunk of ``token_ids`` (a partial tail has none)."""
        ids = np.asarray(token_ids, dtype=np.int64)
        size = self.layout.chunk_tokens
        keys = self.hasher.chain(ids)
        return [ChunkRef.of(key, ids[i * size : (i + 1) * size]) for i, key in enumerate(keys)]

    def tier(self, name: str) -> Tier:
        """The tier called ``name``; ``KeyError`` lists the ones configured."""
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(f"no tier {name!r}; configured: {[t.name for t in self.tiers]}")

    def locate(self, ref: ChunkRef) -> Tier | None:
        """The fastest tier holding ``ref`` with matching token ids, or None."""
        for t in self.tiers:
            if t.contains(ref):
                return t
        return None

    def lookup(self, token_ids: Sequence[int] | np.ndarray) -> LookupResult:
        """The longest prefix of ``token_ids`` whose chunks are all cached in some tier.

        Token ids are compared on every hit, so a key collision ends the prefix rather
        than returning another sequence's KV.
        """
        refs: list[ChunkRef] = []
        names: list[str] = []
        for ref in self.refs_for(token_ids):
            where = self.locate(ref)
            if where is None:
                break
            refs.append(ref)
            names.append(where.name)
        hit_tokens = len(refs) * self.layout.chunk_tokens
        with self._lock:
            self._lookups += 1
            self._lookup_tokens += len(token_ids)
            self._hit_tokens += hit_tokens
        return LookupResult(hit_tokens, refs, names)

    # ---- store and fetch ------------------------------------------------------------------

    def store(self, chunks: Sequence[Chunk], tier: str = "host") -> None:
        """Store sealed chunks in ``tier`` and (write-through) every tier below it.

        Sealed chunks below the device are always written to host. With ``write_through``
        the disk copy is queued on the host⇄disk link (the host copy stays pinned until it
        lands); with ``write_back`` the disk sees a chunk only when the host evicts it.
        Blocks for the copies into ``tier`` and host; the caller keeps ``chunk.data``.
        """
        start = self.tier(tier)
        start.put(chunks)
        if start is self.device:
            self.host.put(chunks)
        if self.disk is not None and self.config.write_policy == "write_through":
            self._queue_to_disk([c.ref for c in chunks])

    def _queue_to_disk(self, refs: Sequence[ChunkRef]) -> TransferHandle | None:
        assert self.disk is not None and self.host_disk_link is not None
        todo = [r for r in refs if not self.disk.contains(r)]
        # Pin the host copies so they stay readable until the disk write has landed.
        todo = [r for r, held in zip(todo, self.host.pin(todo), strict=True) if held]
        if not todo:
            return None
        steps = [CopyStep(self.layout.chunk_nbytes, range(0), _DiskWrite(self, r)) for r in todo]
        return self._track(self.host_disk_link.submit(steps, num_layers=0))

    def _track(self, handle: TransferHandle) -> TransferHandle:
        with self._lock:
            self._pending = [h for h in self._pending if not h.done()]
            self._pending.append(handle)
        return handle

    def flush(self) -> None:
        """Wait until every queued host⇄disk copy has landed, then make the disk durable."""
        with self._lock:
            pending, self._pending = self._pending, []
        for handle in pending:
            handle.wait()
        if isinstance(self.disk, DiskTier):
            self.disk.sync()

    def fetch_into(
        self, refs: Sequence[ChunkRef], outs: Sequence[torch.Tensor], promote: bool = True
    ) -> list[str | None]:
        """Copy chunks into caller-owned buffers from the fastest tier holding each.

        A chunk read from disk is promoted into host (when ``promote``). Returns the name
        of the tier that served each chunk, or None for a miss. Blocks for the copies.
        """
        served: list[str | None] = []
        for ref, out in zip(refs, outs, strict=True):
            name: str | None = None
            for t in self.tiers:
                if t.get_into([ref], [out])[0]:
                    name = t.name
                    break
            if name == "disk" and promote:
                self.host.put([Chunk(ref, out)])
            served.append(name)
        return served

    def prefetch_to_host(self, refs: Sequence[ChunkRef]) -> TransferHandle | None:
        """Start promoting disk-resident chunks into host on the host⇄disk link.

        Returns the transfer handle (None when nothing needs to move). Chunks already in
        host are skipped. Does not block except for link back-pressure.
        """
        if self.disk is None or self.host_disk_link is None:
            return None
        todo = [r for r in refs if not self.host.contains(r) and self.disk.contains(r)]
        if not todo:
            return None
        steps = [CopyStep(self.layout.chunk_nbytes, range(0), _Promote(self, r)) for r in todo]
        return self._track(self.host_disk_link.submit(steps, num_layers=0))

    # ---- lifecycle and stats ----------------------------------------------------------------

    def stats(self) -> ManagerStats:
        links = {}
        if self.host_disk_link is not None:
            links[self.host_disk_link.name] = self.host_disk_link.stats()
        with self._lock:
            return ManagerStats(
                tiers={t.name: t.stats() for t in self.tiers},
                links=links,
                lookups=self._lookups,
                lookup_tokens=self._lookup_tokens,
                hit_tokens=self._hit_tokens,
            )

    def close(self, flush_host_to_disk: bool = False) -> None:
        """Stop the links and close the tiers; optionally save host chunks to disk first."""
        if flush_host_to_disk and self.disk is not None:
            self._queue_to_disk(self.host.refs())
        self.flush()
        if self.host_disk_link is not None:
            self.host_disk_link.close()
        for t in self.tiers:
            t.close()

    def __enter__(self) -> KVManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _write_down_hook(self, lower: Tier) -> _WriteDown:
        return _WriteDown(lower)


class _WriteDown:
    """Evict hook: write a victim to the next tier down unless it already holds it."""

    def __init__(self, lower: Tier) -> None:
        self.lower = lower

    def __call__(self, victim: Chunk) -> None:
        if not self.lower.contains(victim.ref):
            self.lower.put([victim])


class _DiskWrite:
    """Link step: copy one pinned host chunk to disk, then unpin it."""

    def __init__(self, manager: KVManager, ref: ChunkRef) -> None:
        self.manager = manager
        self.ref = ref

    def __call__(self) -> None:
        host = self.manager.host
        try:
            view = host.view(self.ref)  # type: ignore[attr-defined]
            if view is not None and self.manager.disk is not None:
                self.manager.disk.put([Chunk(self.ref, view)])
        finally:
            host.unpin([self.ref])


class _Promote:
    """Link step: copy one chunk from disk into host."""

    def __init__(self, manager: KVManager, ref: ChunkRef) -> None:
        self.manager = manager
        self.ref = ref

    def __call__(self) -> None:
        manager = self.manager
        if manager.host.contains(self.ref) or manager.disk is None:
            return
        if manager._staging is None:
            manager._staging = manager.layout.empty_chunk().zero_()
        staging = manager._staging
        if manager.disk.get_into([self.ref], [staging])[0]:
            manager.host.put([Chunk(self.ref, staging)])
