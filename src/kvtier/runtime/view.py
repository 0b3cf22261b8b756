"""What one layer's attention reads during a pass: a narrow, read-only view.

``SequenceKV.write`` returns a ``LayerKV`` per layer; an engine that packs several
sequences into one row hands attention a ``PackedKV`` over theirs. Attention
(``kvtier.runtime.dispatch``) reads the views and mutates nothing; the one protocol it
follows is the staging ring's ``acquire``/``release`` of each streamed piece. A view is
valid until its sequence's ``end_forward``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvtier.runtime.staging import Piece, StagingRing
from kvtier.tiers.pool import PoolTier


@dataclass(frozen=True)
class LayerKV:
    """One layer of one batch's KV for the current pass.

    Attributes:
        layer_idx: the layer.
        window: the layer's sliding window (None: full attention).
        query_start: absolute position of the pass's first new token.
        chunk_tokens: tokens per chunk.
        recent_key: ``[B, Hkv, R, D]``: the unsealed tail before this pass plus the new
            tokens (a view of the tail when they fit in it).
        recent_value: same shape.
        recent_start: absolute position of ``recent_key``'s first token.
        recent_valid: ``[B, R]`` padding mask of the recent tokens; None: all real.
        resident_key: ``[Hkv, n*T, D]``: the resident chunks' keys, end to end (a view of
            the device pool), or None when none is resident.
        resident_value: same shape.
        resident_valid: ``[B, n*T]`` which resident keys each row may see; None: all.
        resident_chunks: chunk index of each of the ``n`` resident slots (-1: unused).
        pieces: the streamed pieces of this layer, ``(index, piece, valid [B, n*T])``.
        staging: the ring the pieces arrive in.
        query_block_tokens: queries attended per block off the CPU.
        hosted: the chunks attended in the host pool where they lie, or None.
    """

    layer_idx: int
    window: int | None
    query_start: int
    chunk_tokens: int
    recent_key: torch.Tensor
    recent_value: torch.Tensor
    recent_start: int
    recent_valid: torch.Tensor | None
    resident_key: torch.Tensor | None
    resident_value: torch.Tensor | None
    resident_valid: torch.Tensor | None
    resident_chunks: tuple[int, ...]
    pieces: tuple[tuple[int, Piece, torch.Tensor | None], ...]
    staging: StagingRing
    query_block_tokens: int
    hosted: Hosted | None = None

    @property
    def all_resident(self) -> bool:
        """Nothing streams, nothing is on the host, nothing is padded: the resident chunks
        and the recent tokens are the whole KV, every key visible to the newest query."""
        return (
            not self.pieces
            and self.hosted is None
            and self.resident_valid is None
            and self.recent_valid is None
        )


@dataclass(frozen=True)
class Hosted:
    """One layer's chunks attended in the host pool (see ``LayerKV.hosted``): their pinned
    slots in ``host``, their chunk indices, ``valid [B, n*T]`` on the host (None: all
    visible), and where the host call's seconds go (None: not timed)."""

    host: PoolTier
    layer_idx: int
    slot_index: torch.Tensor  # their pinned host slots, int64 [n] on the CPU
    chunks: tuple[int, ...]
    valid: torch.Tensor | None
    spent: Callable[[float], None] | None = None

    def gathered(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[Hkv, n*T, D]``: the slots copied end to end in host memory."""
        parts = [self.host.slot_data(slot)[self.layer_idx] for slot in self.slot_index.tolist()]
        return torch.cat([p[0] for p in parts], dim=1), torch.cat([p[1] for p in parts], dim=1)


@dataclass(frozen=True)
class PackedKV:
    """One layer of a forward over several sequences packed end to end in one row.

    Attributes:
        layer_idx: the layer.
        rows: each sequence's ``LayerKV`` (batch size 1 each), in packed order.
        spans: each sequence's ``(start, length)`` in the packed row.
    """

    layer_idx: int
    rows: list[LayerKV]
    spans: list[tuple[int, int]]
