"""``PackedCache``: one forward over several sequences packed end to end in one row.

Each running sequence keeps its own ``kvtier.runtime.SequenceKV`` (batch size 1: its own
chunks, tail, device arena and streams). An engine step packs every sequence's new tokens
— one token for a decoding sequence, a prefill piece for a prefilling one — into a single
row ``[1, N]`` with explicit ``position_ids`` (each span its own positions). The model hook
hands each span's ids to its sequence at ``begin_forward``; ``update`` hands each span's
K/V to its sequence and returns a ``PackedKV``; kvtier's attention attends each span over
its own sequence's KV. The dense parts of the model (projections, MLP, logits) run once
over all N tokens, so nothing is padded and decode tokens ride along with prefill pieces.

Lifecycle: build one ``PackedCache`` per step over that step's sequences; it holds no
state of its own beyond the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvtier.hf.base import FacadeLayer, SelfManagedCache
from kvtier.runtime import PackedKV, SequenceKV


def begin_packed(
    kvs: Sequence[SequenceKV], spans: Sequence[tuple[int, int]], ids: torch.Tensor | None
) -> None:
    """Begin one pass per sequence packed in one row: span ``(start, length)`` of the
    packed ids ``[1, N]`` (None: unknown) for each. All or none: when one raises
    (``ChunkLostError``), the passes begun before it are dropped again."""
    begun: list[SequenceKV] = []
    try:
        for (start, count), kv in zip(spans, kvs, strict=True):
            kv.begin_forward(count, 1, ids[:, start : start + count] if ids is not None else None)
            begun.append(kv)
    except BaseException:
        for kv in begun:
            kv.drop_forward()
        raise


class PackedCache(SelfManagedCache):
    """A transformers cache over one ``SequenceKV`` per packed span, for one step.

    The mask transformers builds from ``get_seq_length``/``get_mask_sizes`` is not used:
    kvtier's mask hook passes only the padding mask (none here) and each sequence's KV
    applies its own causal and window rules.

    Args:
        rows: the sequences in packed order; each holds one row.
        tokens: how many new tokens each sequence has in the packed row (>= 1 each).

    Thread-safety: one forward at a time; the sequences must not be used elsewhere during it.
    """

    def __init__(self, rows: Sequence[SequenceKV], tokens: Sequence[int]) -> None:
        if not rows:
            raise ValueError("rows: a step needs at least one sequence")
        if len(tokens) != len(rows) or min(tokens) < 1:
            raise ValueError(
                f"tokens: one count >= 1 per row ({len(rows)} rows), got {list(tokens)}"
            )
        self.rows = list(rows)
        self.spans: list[tuple[int, int]] = []
        start = 0
        for count in tokens:
            self.spans.append((start, count))
            start += count
        self.total_tokens = start
        super().__init__(layers=[FacadeLayer(self) for _ in range(rows[0].layout.num_layers)])

    def begin_forward(
        self, ids: torch.Tensor | None, new_tokens: int, rows: int, padding: torch.Tensor | None
    ) -> None:
        """Begin every sequence's pass with its span of the packed ids ``[1, N]``.

        Raises:
            ValueError: the forward is not one row of the packed length.
            ChunkLostError: from the first sequence whose chunk is lost; the sequences
                begun before it are dropped again.
        """
        if rows != 1 or new_tokens != self.total_tokens:
            raise ValueError(
                f"PackedCache: a forward of {rows} rows × {new_tokens} tokens over "
                f"{len(self.rows)} sequences packed in one row of {self.total_tokens} tokens"
            )
        begin_packed(self.rows, self.spans, ids)

    def end_forward(self) -> None:
        for kv in self.rows:
            kv.end_forward()

    def update(  # type: ignore[override]
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[PackedKV, PackedKV]:
        """Hand span ``i`` of the new K/V ``[1, Hkv, N, D]`` to sequence ``i``."""
        if key_states.shape[0] != 1 or key_states.shape[2] != self.total_tokens:
            raise ValueError(
                f"PackedCache: a forward of shape {tuple(key_states.shape[:3])} over "
                f"{len(self.rows)} sequences packed in one row of {self.total_tokens} tokens"
            )
        if layer_idx == 0 and any(kv.plan is None for kv in self.rows):
            self.begin_forward(None, self.total_tokens, 1, None)  # called around the hooks
        views = [
            kv.write(
                layer_idx,
                key_states[:, :, start : start + count],
                value_states[:, :, start : start + count],
            )
            for (start, count), kv in zip(self.spans, self.rows, strict=True)
        ]
        packed = PackedKV(layer_idx, views, self.spans)
        return packed, packed

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(kv.seq_len for kv in self.rows)

    @property
    def is_initialized(self) -> bool:
        return True

    @property
    def batch_size(self) -> int:
        return 1
