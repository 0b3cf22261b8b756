"""``BatchCache``: one batched decode forward over sequences of different lengths.

Each running sequence keeps its own ``TieredCache`` (batch size 1: its own chunks, tail,
device tier and streams). A decode step feeds one new token per sequence as one batch
``[B, 1]`` with explicit ``position_ids [B, 1]`` (each row's own length); ``update``
hands row ``b``'s K/V to row ``b``'s cache and returns a ``BatchView`` of the rows'
``LayerView``s, and kvtier's attention attends each query row through its own cache. The
dense parts of the model (projections, MLP, logits) run batched; attention is per row, so
no row is padded to the longest.

Lifecycle: build one ``BatchCache`` per decode step over the caches of the rows in that
step; it holds no state of its own beyond the step.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

from kvtier.hf.cache import (
    BatchView,
    FacadeLayer,
    SelfManagedCache,
    TieredCache,
    capture_ids,
    take_ids,
)


class BatchCache(SelfManagedCache):
    """A transformers cache over one ``TieredCache`` per batch row, for decode steps.

    The mask transformers builds from ``get_seq_length``/``get_mask_sizes`` (the longest
    row) is not used: kvtier's mask hook passes only the padding mask (None here, no
    ``attention_mask`` is given) and each row's cache applies its own causal rule.

    Args:
        model: the model the row caches serve (its input-id hook feeds ``update``).
        rows: the row caches in batch order; each holds one sequence (batch size 1).

    Thread-safety: one forward at a time; the row caches must not be used elsewhere during
    it.
    """

    def __init__(self, model: torch.nn.Module, rows: Sequence[TieredCache]) -> None:
        if not rows:
            raise ValueError("rows: a batch needs at least one row cache")
        self.rows = list(rows)
        self._model = weakref.ref(model)
        super().__init__(layers=[FacadeLayer(self) for _ in range(rows[0].layout.num_layers)])

    def update(  # type: ignore[override]
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[BatchView, BatchView]:
        """Hand row ``b`` of the new K/V ``[B, Hkv, N, D]`` to row cache ``b``."""
        if key_states.shape[0] != len(self.rows):
            raise ValueError(
                f"BatchCache: a forward of {key_states.shape[0]} rows over {len(self.rows)} "
                "row caches"
            )
        model = self._model()
        ids = take_ids(model) if layer_idx == 0 and model is not None else None
        views = []
        for b, cache in enumerate(self.rows):
            if ids is not None and model is not None:
                # The row cache keys its chunks by the ids it finds for its model at layer 0.
                capture_ids(model, ids[b : b + 1])
            view, _ = cache.update(key_states[b : b + 1], value_states[b : b + 1], layer_idx)
            views.append(view)
        batch = BatchView(layer_idx, views)
        return batch, batch

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(cache.seq_len for cache in self.rows)

    @property
    def is_initialized(self) -> bool:
        return True

    @property
    def batch_size(self) -> int:
        return len(self.rows)
