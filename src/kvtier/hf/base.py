"""The base every kvtier transformers cache shares: ``SelfManagedCache`` and ``FacadeLayer``.

kvtier's caches keep their KV themselves (in ``kvtier.runtime``), not in transformers'
per-layer tensors; these two answer transformers' generic ``Cache`` code (lengths, mask
sizes, compile and crop flags) the same way for every one of them, and name the two calls
kvtier's model hooks (``kvtier.hf.attention``) make around each forward. No state of their
own beyond a weak reference; thread-safety is the subclass's.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class FacadeLayer(CacheLayerMixin):
    """Per-layer facade so transformers' generic ``Cache`` code sees familiar layers.

    kvtier's caches keep their KV themselves; a facade only answers lengths and mask sizes
    from its cache's ``get_seq_length()`` and refuses direct updates.
    """

    is_sliding = False

    def __init__(self, cache: Cache) -> None:
        super().__init__()
        self._cache = weakref.ref(cache)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> Any:
        cache = self._cache()
        name = type(cache).__name__
        raise RuntimeError(f"{name} layers are updated through {name}.update")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        cache = self._cache()
        return 0 if cache is None else cache.get_seq_length()

    def get_max_length(self) -> int:
        return -1


class SelfManagedCache(Cache):
    """What every kvtier cache answers the same way to transformers' generic code.

    The KV lives in kvtier's tiers, not in ``layers``: lengths and mask sizes come from
    ``get_seq_length``; nothing is compiled (static shapes would defeat the tiers) and
    ``crop`` is limited (``is_croppable`` False, so ``generate`` never relies on it).
    """

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.get_seq_length()

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_croppable(self) -> bool:
        return False

    def begin_forward(
        self, ids: torch.Tensor | None, new_tokens: int, rows: int, padding: torch.Tensor | None
    ) -> None:
        """Called by kvtier's model hook before a forward that uses this cache: the new
        tokens' ids ``[B, N]`` (None when the model got embeddings) and the ``[B, kv_length]``
        padding mask (True = real token; None: none)."""
        raise NotImplementedError

    def end_forward(self) -> None:
        """Called by kvtier's model hook after a forward that used this cache completed."""
        raise NotImplementedError
