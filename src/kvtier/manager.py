"""The KV manager: where every chunk is, and the bookkeeping of the moves between tiers.

The manager owns an ordered list of tiers, fastest first (``device`` optional, ``host``,
``disk`` optional). It answers "longest cached prefix of these token ids, and which tier
holds each chunk", stores sealed chunks, promotes chunks on read, and keeps every tier
within its budget: a tier that evicts a chunk writes it to the next tier down first when
that tier does not hold it yet (so write-back loses nothing and write-through never writes
twice). The bytes themselves move in ``kvtier.moves`` (evict hooks and link steps).

Storage faults degrade, never fail a caller: a disk tier that hits an I/O error stops
taking writes (``TierStats.writes_disabled``) and every write path here (``store``, the
write-through queue, eviction write-down) carries on without it; a chunk that turns out
corrupt or gone is recomputed by its user, who reports it with ``count_recompute``.

Write paths between host and disk (DESIGN §3: never on the compute thread under a lock)::

    path           when                        how                      link or queue full
    write-through  ``store`` of sealed chunks  queued on the link       dropped, counted
    write-back     host evicts a chunk         spare buffer, then link  written in place

Thread-safety: every method is thread-safe (the tiers lock themselves; the manager's own
lock is never held while a tier lock is taken). Lookups are a snapshot: a chunk found by
``lookup`` can be evicted before it is fetched, and ``fetch_into`` then reports a miss for
it; pin chunks to prevent that.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvtier.config import ManagerConfig
from kvtier.kv.chunk import Chunk, ChunkRef
from kvtier.kv.keys import ChunkKey, KeyHasher, Namespace
from kvtier.kv.layout import KVLayout
from kvtier.moves import DiskWrite, DiskWriteDown, Promote, WriteDown
from kvtier.tiers.base import Tier, TierStats
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.pool import device_tier, host_tier
from kvtier.transfer import CopyStep, Link, LinkStats, Throttle, TransferHandle

log = logging.getLogger(__name__)

RECOMPUTE_CAUSES = ("corrupt", "missing")
"""Why a cached chunk (found by a lookup, or sealed by a running sequence) is recomputed:
its stored bytes failed their checks when it was promoted (counted there, once per chunk),
or it was in no tier when needed (counted by the cache that needed it)."""


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
    """Per-tier and per-link stats plus lookup counters (a consistent snapshot per part).

    Attributes:
        recomputed_chunks_by_cause: chunks a lookup had found that were recomputed
            instead, by cause (``RECOMPUTE_CAUSES``).
        write_through_dropped: sealed chunks whose write-through disk copy was dropped
            (queue full, or disk writes disabled); they reach disk only if evicted later.
        write_downs_async: evicted chunks written to disk on the link (write-back).
        write_downs_sync: evicted chunks written to disk under the host lock because no
            spare buffer or link room was free.
    """

    tiers: dict[str, TierStats]
    links: dict[str, LinkStats]
    lookups: int
    lookup_tokens: int
    hit_tokens: int
    recomputed_chunks_by_cause: dict[str, int] = field(default_factory=dict)
    write_through_dropped: int = 0
    write_downs_async: int = 0
    write_downs_sync: int = 0

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
        recomputed = sum(self.recomputed_chunks_by_cause.values())
        if recomputed or self.write_through_dropped:
            causes = ", ".join(f"{k} {v}" for k, v in self.recomputed_chunks_by_cause.items())
            rows.append(
                f"recomputed chunks: {recomputed} ({causes or 'none'}); write-through "
                f"copies dropped: {self.write_through_dropped}"
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
        link_cfg = cfg.host_disk_link
        throttle = (
            Throttle(link_cfg.gbps, link_cfg.latency_ms) if link_cfg.gbps is not None else None
        )
        self.host_disk_link: Link | None = None
        if self.disk is not None:
            self.host_disk_link = Link("host<->disk", link_cfg.max_inflight_bytes, throttle)
        self._lock = threading.Lock()  # never held while taking a tier lock
        self._pending: list[TransferHandle] = []
        # One staging chunk for disk->host promotion; only the link's worker thread uses it.
        self._staging: torch.Tensor | None = None
        # Spare chunks that carry evicted host chunks to disk on the link (write-back).
        self._spare: list[torch.Tensor] = []
        # Chunks evicted from host whose disk write is queued: they count as on disk (the
        # link is FIFO, so a promotion queued after the write finds them there).
        self._writing: dict[ChunkKey, ChunkRef] = {}
        if self.disk is not None:
            self._spare = [layout.empty_chunk().zero_() for _ in range(cfg.disk.write_buffers)]
        self._lookups = 0
        self._lookup_tokens = 0
        self._hit_tokens = 0
        self._recomputed = dict.fromkeys(RECOMPUTE_CAUSES, 0)
        self._write_through_dropped = 0
        self._write_downs_async = 0
        self._write_downs_sync = 0
        for upper, lower in zip(self.tiers, self.tiers[1:], strict=False):
            upper.set_evict_hook(self._write_down_hook(lower))

    # ---- keys and lookup ------------------------------------------------------------------

    def refs_for(self, token_ids: Sequence[int] | np.ndarray, salt: str = "") -> list[ChunkRef]:
        """References of every full chunk of ``token_ids`` (a partial tail has none), keyed
        under the tenant ``salt`` (empty: the shared namespace)."""
        ids = np.asarray(token_ids, dtype=np.int64)
        size = self.layout.chunk_tokens
        keys = self.hasher.chain(ids, salt)
        return [ChunkRef.of(key, ids[i * size : (i + 1) * size]) for i, key in enumerate(keys)]

    def tier(self, name: str) -> Tier:
        """The tier called ``name``; ``KeyError`` lists the ones configured."""
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(f"no tier {name!r}; configured: {[t.name for t in self.tiers]}")

    def locate(self, ref: ChunkRef) -> Tier | None:
        """The fastest tier holding ``ref`` with matching token ids, or None.

        A chunk on its way from host to disk (write-back) counts as on disk.
        """
        for t in self.tiers:
            if t.contains(ref):
                return t
        return self.disk if self._is_writing(ref) else None

    def _on_disk(self, ref: ChunkRef) -> bool:
        """Held by disk, or queued to be written there."""
        return self.disk is not None and (self.disk.contains(ref) or self._is_writing(ref))

    def _is_writing(self, ref: ChunkRef) -> bool:
        with self._lock:
            queued = self._writing.get(ref.key)
        return queued is not None and queued.token_ids == ref.token_ids

    def lookup(self, token_ids: Sequence[int] | np.ndarray, salt: str = "") -> LookupResult:
        """The longest prefix of ``token_ids`` whose chunks are all cached in some tier,
        among the chunks keyed under the tenant ``salt``.

        Token ids are compared on every hit, so a key collision ends the prefix rather
        than returning another sequence's KV.
        """
        refs: list[ChunkRef] = []
        names: list[str] = []
        for ref in self.refs_for(token_ids, salt):
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
        the disk copy is queued on the host⇄disk link and never waits: when the link has
        no room (``host_disk_link.max_inflight_bytes``), or the disk takes no writes, the
        copy is dropped and counted (``write_through_dropped``); such a chunk still reaches
        disk if the host evicts it. With ``write_back`` the disk sees a chunk only when the
        host evicts it. Blocks for the copies into ``tier``
        and host; the caller keeps ``chunk.data``.
        """
        start = self.tier(tier)
        start.put(chunks)
        if start is self.device:
            self.host.put(chunks)
        if self.disk is not None and self.config.write_policy == "write_through":
            self._queue_to_disk([c.ref for c in chunks], block=False)

    def _queue_to_disk(self, refs: Sequence[ChunkRef], block: bool) -> TransferHandle | None:
        """Queue disk copies of host chunks on the link; ``block=False`` drops them (counted)
        when the link has no room instead of waiting for it.

        Nothing is pinned while queued: a chunk the host evicts first goes to disk through
        the eviction write-down instead, and its queued copy then finds nothing to do.
        """
        assert self.disk is not None and self.host_disk_link is not None
        todo = [r for r in refs if not self._on_disk(r)]
        if not todo or self.disk.writes_disabled:
            if not block:
                self._count_dropped(len(todo))
            return None
        steps = [CopyStep(self.layout.chunk_nbytes, range(0), DiskWrite(self, r)) for r in todo]
        link = self.host_disk_link
        handle = link.submit(steps, 0) if block else link.try_submit(steps, 0)
        if handle is None:  # the link is full: drop rather than stall the caller
            self._count_dropped(len(todo))
            return None
        return self._track(handle)

    def _count_dropped(self, num_chunks: int) -> None:
        if num_chunks:
            with self._lock:
                self._write_through_dropped += num_chunks

    def count_recompute(self, cause: str, num_chunks: int = 1) -> None:
        """Record that ``num_chunks`` cached chunks are recomputed instead (see
        ``RECOMPUTE_CAUSES``). Mutates the stats only; thread-safe.

        Raises:
            ValueError: ``cause`` is not one of ``RECOMPUTE_CAUSES``.
        """
        if cause not in self._recomputed:
            raise ValueError(f"cause: unknown {cause!r}; accepted: {list(RECOMPUTE_CAUSES)}")
        with self._lock:
            self._recomputed[cause] += num_chunks

    def _track(self, handle: TransferHandle) -> TransferHandle:
        with self._lock:
            self._pending = [h for h in self._pending if not h.done()]
            self._pending.append(handle)
        return handle

    def wait_writes(self) -> None:
        """Wait until every host⇄disk copy queued so far has landed (not made durable)."""
        with self._lock:
            pending, self._pending = self._pending, []
        for handle in pending:
            handle.wait()

    def flush(self) -> None:
        """Wait until every queued host⇄disk copy has landed, then make the disk durable.

        Never raises for a disk that failed: its writes are off and it says so in stats.
        """
        self.wait_writes()
        if isinstance(self.disk, DiskTier):
            try:
                self.disk.sync()
            except OSError as exc:
                self.disk.disable_writes(exc)

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
            if name is None and self.disk is not None and self._is_writing(ref):
                self.wait_writes()  # it was on its way to disk
                name = "disk" if self.disk.get_into([ref], [out])[0] else None
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
        todo = [r for r in refs if not self.host.contains(r) and self._on_disk(r)]
        if not todo:
            return None
        steps = [CopyStep(self.layout.chunk_nbytes, range(0), Promote(self, r)) for r in todo]
        return self._track(self.host_disk_link.submit(steps, num_layers=0))

    def promote(self, refs: Sequence[ChunkRef]) -> list[str]:
        """Bring chunks into host (from disk where needed) and say where each one stands.

        Blocks until the promotions have landed (and for link back-pressure). Mutates host
        (promoted chunks, evictions) and disk (a chunk found corrupt is dropped).

        Returns:
            For each ref: ``"host"`` (host holds it now; pin it before it can be evicted
            again), ``"corrupt"`` (its disk copy failed its checks) or ``"missing"`` (in no
            tier, unreadable, or no host slot was free).
        """
        outcomes = ["host" if self.host.contains(r) else "missing" for r in refs]
        if self.disk is None or self.host_disk_link is None:
            return outcomes
        todo = [i for i, r in enumerate(refs) if outcomes[i] != "host" and self._on_disk(r)]
        if todo:
            nbytes = self.layout.chunk_nbytes
            steps = [CopyStep(nbytes, range(0), Promote(self, refs[i], outcomes, i)) for i in todo]
            self._track(self.host_disk_link.submit(steps, num_layers=0)).wait()
        return outcomes

    # ---- lifecycle and stats ----------------------------------------------------------------

    def stats(self) -> ManagerStats:
        links = {}
        if self.host_disk_link is not None:
            links[self.host_disk_link.name] = self.host_disk_link.stats()
        tiers = {t.name: t.stats() for t in self.tiers}  # outside the manager lock
        with self._lock:
            return ManagerStats(
                tiers=tiers,
                links=links,
                lookups=self._lookups,
                lookup_tokens=self._lookup_tokens,
                hit_tokens=self._hit_tokens,
                recomputed_chunks_by_cause=dict(self._recomputed),
                write_through_dropped=self._write_through_dropped,
                write_downs_async=self._write_downs_async,
                write_downs_sync=self._write_downs_sync,
            )

    def close(self, flush_host_to_disk: bool = False) -> None:
        """Stop the links and close the tiers; optionally save host chunks to disk first."""
        if flush_host_to_disk and self.disk is not None:
            self._queue_to_disk(self.host.refs(), block=True)
        self.flush()
        if self.host_disk_link is not None:
            self.host_disk_link.close()
        for t in self.tiers:
            t.close()

    def __enter__(self) -> KVManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _write_down_hook(self, lower: Tier) -> WriteDown | DiskWriteDown:
        return DiskWriteDown(self) if lower is self.disk else WriteDown(lower)

    def _take_spare(self) -> torch.Tensor | None:
        with self._lock:
            return self._spare.pop() if self._spare else None

    def _give_spare(self, buffer: torch.Tensor) -> None:
        with self._lock:
            self._spare.append(buffer)

    def _count_write_down(self, asynchronous: bool) -> None:
        with self._lock:
            if asynchronous:
                self._write_downs_async += 1
            else:
                self._write_downs_sync += 1
