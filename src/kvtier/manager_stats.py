"""The manager's named results: what a lookup found and what moved where.

Pure values, built by ``kvtier.manager.KVManager`` and handed to the caller, who owns them
(``stats()`` returns a fresh snapshot every call). No state, no locks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.kv.chunk import ChunkRef
from kvtier.tiers.types import TierStats
from kvtier.transfer import LinkStats

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
        tiers: by tier name, fastest first.
        links: by link name (``"host<->disk"``), one per adjacent pair of tiers.
        recomputed_chunks_by_cause: chunks a lookup had found that were recomputed
            instead, by cause (``RECOMPUTE_CAUSES``).
        write_through_dropped: sealed chunks whose write-through copy down was dropped
            (link full, or the lower tier takes no writes); they go down only if evicted.
        write_backs_queued: evicted chunks queued to be written one tier down (write-back),
            on the lower link's worker.
        write_backs_dropped: queued write-backs dropped because the write-back queue was
            full (the oldest waiting one goes) or the link had no room; such a chunk is
            recomputed if it is needed again, never served wrong.
        eviction_policies: by tier name, the registry name of the policy its config asks
            for (``kvtier.policy.registry``; the shared tier's own size cap deletes the
            values this instance wrote least recently used first).
    """

    tiers: dict[str, TierStats]
    links: dict[str, LinkStats]
    lookups: int
    lookup_tokens: int
    hit_tokens: int
    recomputed_chunks_by_cause: dict[str, int] = field(default_factory=dict)
    write_through_dropped: int = 0
    write_backs_queued: int = 0
    write_backs_dropped: int = 0
    eviction_policies: dict[str, str] = field(default_factory=dict)

    def table(self) -> str:
        """A plain-text table of what moved where."""
        head = f"{'tier':<8}{'chunks in':>10}{'MB in':>10}{'hits':>8}{'misses':>8}"
        head += f"{'MB out':>10}{'evicted':>9}{'corrupt':>9}{'GB/s in':>9}{'GB/s out':>9}"
        rows = [head + "  eviction"]
        for name, s in self.tiers.items():
            rows.append(
                f"{name:<8}{s.puts:>10}{s.bytes_in / 1e6:>10.1f}{s.hits:>8}{s.misses:>8}"
                f"{s.bytes_out / 1e6:>10.1f}{s.evictions:>9}{s.corrupt_dropped:>9}"
                f"{s.put_gbps:>9.2f}{s.get_gbps:>9.2f}  {self.eviction_policies.get(name, '-')}"
            )
        for name, ls in self.links.items():
            rows.append(
                f"link {name}: {ls.transfers} transfers, {ls.bytes / 1e6:.1f} MB, "
                f"{ls.achieved_gbps:.2f} GB/s achieved, waited {ls.wait_s * 1e3:.1f} ms"
            )
        if self.write_backs_queued or self.write_backs_dropped:
            rows.append(
                f"write-back on eviction: {self.write_backs_queued} chunks queued, "
                f"{self.write_backs_dropped} dropped (queue full; recomputed if needed)"
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
