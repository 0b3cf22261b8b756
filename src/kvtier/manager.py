"""The KV manager: where every chunk is, and the bookkeeping of the moves between tiers.

The manager builds its stack from ``ManagerConfig.tiers`` (host first, then the lower
tiers in order) through the tier registry, with one ``Hop`` (a link, its write-back queue)
per adjacent pair. It answers "longest cached prefix of these token ids, and which tier
holds each chunk", stores sealed chunks in host, promotes chunks up on read, and keeps
every tier within its budget. It knows no tier kind by name: what a tier can do (durable
``sync``, degrading on I/O errors) comes through the ``Tier`` interface, and every copy is
a ``kvtier.moves.Move`` or a write-back, run on a link's worker.

Write paths down the stack (DESIGN §3: never on the compute thread under a lock)::

    path           when                        how                          queue full
    write-through  ``store`` of sealed chunks  Move on the link, hop by hop  dropped, counted
    write-back     a tier evicts a chunk       WriteBackQueue on the link   oldest dropped

A chunk whose write-back is queued counts as held by the tier below (``locate``); one
dropped from a full queue is in no tier, so its user recomputes it (never wrong KV).

Storage faults degrade, never fail a caller: a tier that hits an I/O error stops taking
writes (``TierStats.writes_disabled``) and every write path carries on without it; a chunk
that turns out corrupt or gone is recomputed by its user (``count_recompute``).

Thread-safety: every method is thread-safe (the tiers and queues lock themselves; the
manager's own lock guards its counters and the list of pending transfers, and is never
held while another lock is taken). Lookups are a snapshot: a chunk found by ``lookup`` can
be evicted before it is promoted, and ``promote`` then reports it missing; pin it in host
to prevent that.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvtier.config import LinkConfig, ManagerConfig
from kvtier.kv.chunk import Chunk, ChunkRef, chunk_refs
from kvtier.kv.keys import KeyHasher, Namespace
from kvtier.kv.layout import KVLayout
from kvtier.manager_stats import RECOMPUTE_CAUSES, LookupResult, ManagerStats
from kvtier.moves import Hop, Move
from kvtier.promotion import Promotions
from kvtier.tiers.base import Tier
from kvtier.tiers.pool import PoolTier
from kvtier.tiers.registry import build_tier
from kvtier.transfer import CopyStep, Link, Throttle, TransferHandle
from kvtier.writeback import WriteBackQueue

__all__ = ["RECOMPUTE_CAUSES", "KVManager", "LookupResult", "ManagerStats"]

log = logging.getLogger(__name__)


def _link(name: str, config: LinkConfig) -> Link:
    throttle = Throttle(config.gbps, config.latency_ms) if config.gbps is not None else None
    return Link(name, config.max_inflight_bytes, throttle)


class KVManager:
    """Knows where every chunk is; stores, finds, promotes and evicts across tiers.

    Args:
        layout: the KV layout of the model.
        model_id: identity of the weights (part of every chunk key's namespace).
        config: the tier stack, its links and the write policy.
        digest_bytes: chunk key length; shorten only to force collisions in tests.

    Raises:
        ValueError: the config does not match the layout, or a tier cannot be built (the
            message names the config field).
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
        self._lock = threading.Lock()  # counters and _pending; never held with another lock
        self._pending: list[TransferHandle] = []
        self._closed = False
        self.tiers: list[Tier] = []
        self.hops: list[Hop] = []
        try:
            for tier_config in self.config.tiers:
                self.tiers.append(build_tier(tier_config, layout))
            for upper, lower, lower_config in zip(
                self.tiers, self.tiers[1:], self.config.lower_tiers, strict=False
            ):
                link = _link(f"{upper.name}<->{lower.name}", lower_config.link)
                queue = WriteBackQueue(
                    lower, link, layout, lower_config.write_queue_chunks, self._track
                )
                upper.set_evict_hook(queue.offer)
                self.hops.append(Hop(upper, lower, link, queue, layout))
        except BaseException:
            self._close_parts()
            raise
        self._write_behind = [t for t in self.tiers[1:] if t.takes_write_behind]
        self._promotions = Promotions(
            self.host, self.hops, self._levels, self._track, lambda: self.count_recompute("corrupt")
        )
        self._lookups = 0
        self._lookup_tokens = 0
        self._hit_tokens = 0
        self._recomputed = dict.fromkeys(RECOMPUTE_CAUSES, 0)
        self._write_through_dropped = 0

    # ---- the stack ------------------------------------------------------------------------

    @property
    def host(self) -> PoolTier:
        """The host tier (the first of the stack), a memory pool."""
        host = self.tiers[0]
        assert isinstance(host, PoolTier)
        return host

    @property
    def disk(self) -> Tier | None:
        """The disk tier, or None when the stack has none (a convenience for callers)."""
        return next((t for t in self.tiers if t.name == "disk"), None)

    @property
    def links(self) -> list[Link]:
        """One link per adjacent pair of tiers: ``links[i]`` joins tiers ``i`` and ``i+1``."""
        return [hop.link for hop in self.hops]

    def tier(self, name: str) -> Tier:
        """The tier called ``name``; ``KeyError`` lists the ones configured."""
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(f"no tier {name!r}; configured: {[t.name for t in self.tiers]}")

    def _levels(self, refs: Sequence[ChunkRef]) -> list[int | None]:
        """Index of the fastest tier holding each ref (a queued write-back counts as held
        by the tier it goes to), or None. Each tier is asked once for the refs the ones
        above it lack (``contains_many``: one round trip to the shared tier)."""
        levels: list[int | None] = [0 if self.tiers[0].contains(r) else None for r in refs]
        for i, hop in enumerate(self.hops):
            todo = [j for j, level in enumerate(levels) if level is None]
            if not todo:
                break
            for j, held in zip(todo, hop.holds_many([refs[j] for j in todo]), strict=True):
                if held:
                    levels[j] = i + 1
        return levels

    def locate(self, ref: ChunkRef) -> Tier | None:
        """The fastest tier holding ``ref`` with matching token ids, or None.

        A chunk whose write-back to a tier is queued counts as held by that tier.
        """
        (level,) = self._levels([ref])
        return None if level is None else self.tiers[level]

    # ---- keys and lookup ------------------------------------------------------------------

    def refs_for(self, token_ids: Sequence[int] | np.ndarray, salt: str = "") -> list[ChunkRef]:
        """References of every full chunk of ``token_ids`` (a partial tail has none), keyed
        under the tenant ``salt`` (empty: the shared namespace)."""
        return chunk_refs(self.hasher, token_ids, salt)

    def lookup(self, token_ids: Sequence[int] | np.ndarray, salt: str = "") -> LookupResult:
        """The longest prefix of ``token_ids`` whose chunks are all cached in some tier,
        among the chunks keyed under the tenant ``salt``.

        Token ids are compared on every hit, so a key collision ends the prefix rather
        than returning another sequence's KV. Mutates the lookup counters only.
        """
        refs: list[ChunkRef] = []
        names: list[str] = []
        every = self.refs_for(token_ids, salt)
        for ref, level in zip(every, self._levels(every), strict=True):
            if level is None:
                break
            refs.append(ref)
            names.append(self.tiers[level].name)
        hit_tokens = len(refs) * self.layout.chunk_tokens
        with self._lock:
            self._lookups += 1
            self._lookup_tokens += len(token_ids)
            self._hit_tokens += hit_tokens
        return LookupResult(hit_tokens, refs, names)

    # ---- writes down ------------------------------------------------------------------------

    def store(self, chunks: Sequence[Chunk]) -> None:
        """Store sealed chunks in host and, with ``write_through``, queue them down.

        Blocks for the copies into host (which may evict: evicted chunks queue for the
        tier below without waiting); the caller keeps ``chunk.data``. With
        ``write_through`` each chunk is then copied down the stack, hop by hop, on the
        links; a hop whose link has no room or whose lower tier takes no writes drops the
        copy and counts it (``write_through_dropped``): the chunk still goes down if it is
        evicted later. With ``write_back`` a chunk goes down only when evicted. A tier that
        ``takes_write_behind`` (the shared tier) gets every chunk queued, whatever the
        policy (``Tier.write_behind``; never blocks).
        """
        self.host.put(chunks)
        for tier in self._write_behind:
            tier.write_behind([c.ref for c in chunks], self.host, self._read_left_host)
        if self.hops and self.config.write_policy == "write_through":
            self._copy_down(0, [c.ref for c in chunks], block=False)

    def _read_left_host(self, ref: ChunkRef, out: torch.Tensor) -> bool:
        """``ChunkReader`` for write-behind: a chunk that left host before the shared tier's
        writer read it, from a write-back queue or a tier between host and that tier (not
        counted as a use). Runs on the writer's thread."""
        for hop in self.hops:
            if hop.lower.takes_write_behind:
                return False
            if hop.queue.read_into(ref, out) or hop.lower.get_into([ref], [out], as_use=False)[0]:
                return True
        return False

    def _copy_down(self, index: int, refs: Sequence[ChunkRef], block: bool) -> None:
        """Queue copies of ``refs`` from tier ``index`` to the tier below, on their link.

        ``block=False`` drops (and counts) them when the link has no room instead of
        waiting. Nothing is pinned while queued: a chunk evicted first goes down through
        its write-back instead, and its queued copy then finds nothing to do.
        """
        hop = self.hops[index]
        todo = [r for r, held in zip(refs, hop.holds_many(refs), strict=True) if not held]
        if not todo:
            return
        if hop.lower.writes_disabled:
            self._count_dropped(len(todo))
            return
        then = self._then_copy_down(index + 1)
        moves = [Move(hop, r, hop.upper, hop.lower, as_use=False, then=then) for r in todo]
        nbytes = hop.lower.stored_chunk_nbytes  # what crosses the link: the codec's bytes
        steps = [CopyStep(nbytes, range(0), m, skip=m.landed) for m in moves]
        handle = hop.link.submit(steps, 0) if block else hop.link.try_submit(steps, 0)
        if handle is None:  # the link is full: drop rather than stall the caller
            self._count_dropped(len(todo))
            return
        self._track(handle)

    def _then_copy_down(self, index: int) -> Callable[[ChunkRef], None] | None:
        """Write-through continues below a tier once a chunk landed there (None at the
        bottom of the stack, or under write-back)."""
        if index >= len(self.hops) or self.config.write_policy != "write_through":
            return None
        return lambda ref: self._copy_down(index, [ref], block=False)

    def _count_dropped(self, num_chunks: int) -> None:
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
        """Wait until every copy queued on a link so far has landed (not made durable),
        including the write-backs and copies those copies caused further down."""
        while True:
            with self._lock:
                pending, self._pending = self._pending, []
            if not pending:
                return
            for handle in pending:
                handle.wait()

    def flush(self) -> None:
        """Wait until every queued copy has landed, then make every tier durable.

        Never raises for a tier that failed: its writes are off and it says so in stats.
        """
        self.wait_writes()
        for t in self.tiers:
            try:
                t.sync()
            except OSError as exc:
                t.disable_writes(exc)

    # ---- promotion up -----------------------------------------------------------------------

    def prefetch_to_host(
        self, refs: Sequence[ChunkRef], wait_for_room: bool = True
    ) -> list[TransferHandle]:
        """Start promoting chunks held below host into host, one transfer each, in the
        order given; see ``kvtier.promotion.Promotions.prefetch``."""
        return self._promotions.prefetch(refs, wait_for_room)

    def promote(self, refs: Sequence[ChunkRef]) -> list[str]:
        """Bring chunks into host (from the tier below holding each) and say where each
        one stands (``"host"``, ``"corrupt"`` or ``"missing"``); blocks until they landed.
        See ``kvtier.promotion.Promotions.promote``."""
        return self._promotions.promote(refs)

    # ---- lifecycle and stats ----------------------------------------------------------------

    def stats(self) -> ManagerStats:
        """A snapshot of every tier's, link's and queue's counters. Thread-safe."""
        links = {hop.link.name: hop.link.stats() for hop in self.hops}
        tiers = {t.name: t.stats() for t in self.tiers}  # outside the manager lock
        queue_counts = [hop.queue.counts() for hop in self.hops]
        with self._lock:
            return ManagerStats(
                tiers=tiers,
                links=links,
                lookups=self._lookups,
                lookup_tokens=self._lookup_tokens,
                hit_tokens=self._hit_tokens,
                recomputed_chunks_by_cause=dict(self._recomputed),
                write_through_dropped=self._write_through_dropped,
                write_backs_queued=sum(queued for queued, _ in queue_counts),
                write_backs_dropped=sum(dropped for _, dropped in queue_counts),
                eviction_policies={t.kind: t.eviction_policy for t in self.config.tiers},
            )

    def close(self, flush_host_to_disk: bool = False) -> None:
        """Stop the links and close the tiers; idempotent.

        Args:
            flush_host_to_disk: first copy every host chunk into the tier below (waiting for
                link room), so a durable tier there keeps them across a restart.
        """
        with self._lock:
            closed, self._closed = self._closed, True
        if closed:
            return
        if flush_host_to_disk and self.hops:
            self._copy_down(0, self.host.refs(), block=True)
        self.flush()
        self._close_parts()

    def _close_parts(self) -> None:
        for hop in self.hops:
            hop.link.close()
        for t in self.tiers:
            t.close()

    def __enter__(self) -> KVManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
