"""``LinkStats``: the counters a ``kvtier.transfer.link.Link`` reports. Plain data."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields


@dataclass
class LinkStats:
    """Counters of one link. Read them through ``Link.stats()`` (a consistent copy).

    Attributes:
        transfers: transfers finished (including failed ones).
        failed: transfers in which a step raised.
        steps: steps that ran without raising.
        bytes: sum of ``nbytes`` of those steps.
        busy_s: seconds the link spent executing steps, throttle sleeps included (on CUDA:
            device time from a transfer's first to its last copy).
        wait_s: seconds callers spent blocked in ``wait``/``wait_layer`` (stall time).
        submit_blocked_s: seconds ``submit`` callers spent blocked by back-pressure.
        max_inflight_bytes_seen: the most bytes submitted but not finished at once.
    """

    transfers: int = 0
    failed: int = 0
    steps: int = 0
    bytes: int = 0
    busy_s: float = 0.0
    wait_s: float = 0.0
    submit_blocked_s: float = 0.0
    max_inflight_bytes_seen: int = 0

    @property
    def achieved_gbps(self) -> float:
        """Bytes moved per busy second, in GB/s (1e9 bytes/s); 0 before any work."""
        return self.bytes / self.busy_s / 1e9 if self.busy_s > 0 else 0.0

    @classmethod
    def total(cls, items: Iterable[LinkStats]) -> LinkStats:
        """Several links as one: counters and seconds add up, the in-flight peak is the
        largest (each link bounds its own)."""
        out = cls()
        for item in items:
            for f in fields(cls):
                mine, theirs = getattr(out, f.name), getattr(item, f.name)
                merged = max(mine, theirs) if f.name == "max_inflight_bytes_seen" else mine + theirs
                setattr(out, f.name, merged)
        return out
