"""``BatchCache``: one forward over several sequences packed end to end in one row.

Each running sequence keeps its own ``TieredCache`` (batch size 1: its own chunks, tail,
device tier and streams). A scheduler step packs every sequence's new tokens — one token
for a decoding sequence, a prefill piece for a prefilling one — into a single row
``[1, N]`` with explicit ``position_ids`` (each span its own positions). ``update`` hands
each span's K/V to its sequence's cache and returns a ``PackedView``; kvtier's attention
attends each span through its own cache. The dense parts of the model (projections, MLP,
logits) run once over all N tokens, so nothing is padded and decode tokens ride along
with prefill pieces.

Lifecycle: build one ``BatchCache`` per step over the caches of that step's sequences; it
holds no state of its own beyond the step.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

from kvtier.hf.cache import (
    FacadeLayer,
    PackedView,
    SelfManagedCache,
    TieredCache,
    capture_ids,
    take_ids,
)


class BatchCache(SelfManagedCache):
    """A transformers cache over one ``TieredCache`` per packed span, for one step.

    The mask transformers builds from ``get_seq_length``/``get_mask_sizes`` is not used:
    kvtier's mask hook passes only the padding mask (None here, no ``attention_mask`` is
    given) and each sequence's cache applies its own causal rule.

    Args:
        model: the model the caches serve (its input-id hook feeds ``update``).
        rows: the sequences' caches in packed order; each holds one sequence.
        tokens: how many new tokens each sequence has in the packed row (>= 1 each).

    Thread-safety: one forward at a time; the caches must not be used elsewhere during it.
    """

    def __init__(
        self, model: torch.nn.Module, rows: Sequence[TieredCache], tokens: Sequence[int]
    ) -> None:
        if not rows:
            raise ValueError("rows: a step needs at least one sequence cache")
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
        self._model = weakref.ref(model)
        super().__init__(layers=[FacadeLayer(self) for _ in range(rows[0].layout.num_layers)])

    def update(  # type: ignore[override]
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[PackedView, PackedView]:
        """Hand span ``i`` of the new K/V ``[1, Hkv, N, D]`` to cache ``i``."""
        if key_states.shape[0] != 1 or key_states.shape[2] != self.total_tokens:
            raise ValueError(
                f"BatchCache: a forward of shape {tuple(key_states.shape[:3])} over "
                f"{len(self.rows)} sequences packed in one row of {self.total_tokens} tokens"
            )
        model = self._model()
        ids = take_ids(model) if layer_idx == 0 and model is not None else None
        views = []
        for (start, count), cache in zip(self.spans, self.rows, strict=True):
            stop = start + count
            if ids is not None and model is not None:
                # The sequence's cache keys its chunks by the ids it finds at layer 0.
                capture_ids(model, ids[:, start:stop])
            view, _ = cache.update(
                key_states[:, :, start:stop], value_states[:, :, start:stop], layer_idx
            )
            views.append(view)
        packed = PackedView(layer_idx, views, self.spans)
        return packed, packed

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(cache.seq_len for cache in self.rows)

    @property
    def is_initialized(self) -> bool:
        return True

    @property
    def batch_size(self) -> int:
        return 1
