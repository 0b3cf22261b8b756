"""What one ``SequenceKV`` (or an engine's many) moved where: ``CacheStats``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.runtime.ledger import DecisionCost
from kvtier.tiers.base import TierStats
from kvtier.transfer import LinkStats


@dataclass(frozen=True)
class CacheStats:
    """What moved where, for reports."""

    device: TierStats
    host: TierStats
    link: LinkStats
    link_description: str
    device_budget_bytes: int
    device_nbytes: int
    staging_nbytes: int
    reused_tokens: int
    sealed_chunks: int
    decisions: dict[str, DecisionCost] = field(default_factory=dict)  # by Decision value

    @property
    def decided_chunks(self) -> dict[str, int]:
        """Chunk reads by decision, summed over passes (a chunk read by 10 passes: 10)."""
        return {name: cost.chunks for name, cost in self.decisions.items()}

    @classmethod
    def total(cls, items: Sequence[CacheStats]) -> CacheStats:
        """Several caches over one manager as one (an engine's sequences): device tiers,
        links, budgets and counts add up; the host tier is the shared one."""
        if not items:
            raise ValueError("items: no cache stats to add up")
        return cls(
            device=TierStats.total(c.device for c in items),
            host=items[0].host,
            link=LinkStats.total(c.link for c in items),
            link_description=f"{len(items)} × {items[0].link_description}",
            device_budget_bytes=sum(c.device_budget_bytes for c in items),
            device_nbytes=sum(c.device_nbytes for c in items),
            staging_nbytes=sum(c.staging_nbytes for c in items),
            reused_tokens=sum(c.reused_tokens for c in items),
            sealed_chunks=sum(c.sealed_chunks for c in items),
            decisions=DecisionCost.total(c.decisions for c in items),
        )

    def table(self) -> str:
        rows = [
            f"{'tier':<8}{'chunks in':>10}{'MB in':>10}{'hits':>8}{'MB out':>10}{'evicted':>9}",
        ]
        for name, s in (("device", self.device), ("host", self.host)):
            rows.append(
                f"{name:<8}{s.puts:>10}{s.bytes_in / 1e6:>10.1f}{s.hits:>8}"
                f"{s.bytes_out / 1e6:>10.1f}{s.evictions:>9}"
            )
        link = self.link
        rows.append(
            f"link host->device ({self.link_description}): {link.bytes / 1e6:.1f} MB in "
            f"{link.transfers} pieces, {link.achieved_gbps:.2f} GB/s, compute waited "
            f"{link.wait_s:.3f} s"
        )
        rows.append(
            f"device: {self.device_nbytes / 1e6:.1f} MB held of a "
            f"{self.device_budget_bytes / 1e6:.1f} MB budget, + {self.staging_nbytes / 1e6:.1f} "
            f"MB staging; {self.reused_tokens} prompt tokens reused"
        )
        if self.decisions:
            rows.append(
                f"{'decision':<10}{'chunk reads':>12}{'MB':>10}{'predicted s':>13}"
                f"{'measured s':>12}"
            )
            for name, cost in sorted(self.decisions.items()):
                rows.append(
                    f"{name:<10}{cost.chunks:>12}{cost.nbytes / 1e6:>10.1f}"
                    f"{_seconds(cost.predicted_s):>13}{_seconds(cost.measured_s):>12}"
                )
        return "\n".join(rows)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
