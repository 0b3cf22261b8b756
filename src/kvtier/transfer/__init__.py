"""Links between adjacent tiers: copy steps, per-layer readiness handles, throttling."""

from __future__ import annotations

from kvtier.transfer.handle import TransferError, TransferHandle
from kvtier.transfer.link import Link
from kvtier.transfer.link_stats import LinkStats
from kvtier.transfer.steps import CopyStep
from kvtier.transfer.throttle import Throttle, ThrottleClock, sleep_until

__all__ = [
    "CopyStep",
    "Link",
    "LinkStats",
    "Throttle",
    "ThrottleClock",
    "TransferError",
    "TransferHandle",
    "sleep_until",
]
