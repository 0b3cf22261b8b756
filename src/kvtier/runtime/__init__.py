"""The framework-free core between the tiers and the adapters.

``SequenceKV`` holds one batch's KV (sequence state, device arena, forward plan, staging
ring); a forward pass is ``begin_forward`` → ``write`` per layer → ``end_forward``, and
attention reads each layer's ``LayerKV`` through ``attend`` / ``attend_packed``. Nothing
here imports transformers: ``kvtier.hf`` adapts it to transformers' ``Cache`` API, and the
engine drives it directly.
"""

from __future__ import annotations

from kvtier.runtime.decode import DecodeBatch
from kvtier.runtime.dispatch import attend, attend_packed
from kvtier.runtime.groups import LayerGroup, layer_groups
from kvtier.runtime.plan import ChunkRange, Decision, ForwardPlan
from kvtier.runtime.seats import SeatSlab
from kvtier.runtime.sequence import SequenceKV
from kvtier.runtime.stats import CacheStats
from kvtier.runtime.view import LayerKV, PackedKV

__all__ = [
    "CacheStats",
    "ChunkRange",
    "Decision",
    "DecodeBatch",
    "ForwardPlan",
    "LayerGroup",
    "LayerKV",
    "PackedKV",
    "SeatSlab",
    "SequenceKV",
    "attend",
    "attend_packed",
    "layer_groups",
]
