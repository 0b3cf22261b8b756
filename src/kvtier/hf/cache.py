"""``TieredCache``: a transformers ``Cache`` whose KV lives in kvtier's tiers.

A thin adapter over ``kvtier.runtime.SequenceKV``: ``update`` keeps a layer's new K/V in
the runtime and returns the layer's ``LayerKV`` view instead of concatenated tensors;
kvtier's attention (``kvtier.hf.attention``) attends to its segments. The model hooks that
``attach`` installs call ``begin_forward`` before each forward (with the input ids, which
``update`` does not see, and the padding mask) and ``end_forward`` after it, so the
attention function drives nothing. Lengths and mask sizes come from the runtime.

Device memory (the runtime's own accounting, ``device_nbytes``): resident chunks of every
layer group plus one tail chunk per row stay within ``device_budget_bytes``; the
streaming ring adds the fixed ``staging_nbytes`` (≤ ``staging_bytes``). Transient
per-forward activations are not counted; ``kvtier.hf.generate`` prefills in chunk-sized
pieces to keep them small.

Thread-safety: one forward pass at a time per cache. Tiers may be shared with other caches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvtier.config import HostConfig, ManagerConfig, TieredCacheConfig
from kvtier.hf.attention import attach
from kvtier.hf.base import FacadeLayer, SelfManagedCache
from kvtier.kv.layout import KVLayout
from kvtier.kv.spec import LayerSpec, check_exact, sliding_windows
from kvtier.manager import KVManager
from kvtier.models import model_identity
from kvtier.profiles import resolve_rates
from kvtier.runtime import CacheStats, LayerKV, SequenceKV


@dataclass(frozen=True)
class ModelSpec:
    """What kvtier keeps for a transformers model (checked: it can run it exactly).

    Attributes:
        layout: the chunk layout of its KV.
        layer_specs: per layer, the attention kind, window, heads and head size.
        windows: per layer, the sliding window attention must keep to (None: full).
        model_type: the config's model type (named in errors).
    """

    layout: KVLayout
    layer_specs: list[LayerSpec]
    windows: list[int | None]
    model_type: str

    def check_manager(self, manager: KVManager) -> None:
        """Raise ``ValueError`` unless ``manager`` was built for this layout."""
        if self.layout != manager.layout:
            raise ValueError(
                f"manager: its layout {manager.layout.fingerprint()} does not match the model's "
                f"{self.layout.fingerprint()}; build the KVManager from this model's config "
                "and KV dtype (bfloat16 under EngineConfig(matmul_dtype='bfloat16'))"
            )


def model_spec(
    model: torch.nn.Module, chunk_tokens: int, kv_dtype: torch.dtype | None = None
) -> ModelSpec:
    """The KV spec of ``model`` with chunks of ``chunk_tokens`` and K/V of ``kv_dtype``
    (None: the weights' dtype); pure.

    Raises:
        UnsupportedModelError: kvtier cannot run the model exactly (one line: why).
    """
    dtype = kv_dtype or next(model.parameters()).dtype
    layout = KVLayout.from_model_config(model.config, dtype, chunk_tokens)
    specs = check_exact(model, layout.num_kv_heads, layout.head_dim)
    model_type = str(getattr(model.config, "model_type", type(model).__name__))
    return ModelSpec(layout, specs, sliding_windows(model, specs), model_type)


class TieredCache(SelfManagedCache):
    """Drop-in transformers cache with a device byte budget over kvtier's tiers.

    Args:
        model: the causal LM it serves (its config, dtype and device; its attention is
            switched to kvtier's segmented attention, and hooks feed each forward's ids).
        config: budget, staging, look-ahead, link, placement (``auto`` without rates
            reads this machine's calibration profile of the model).
        manager: the host/disk tiers; share one manager between caches (and turns) to
            reuse KV. Default: a private manager with a host tier big enough for 8K tokens.
        model_id: identity of the weights for chunk keys; default
            ``kvtier.models.model_identity(model)``.
        chunk_tokens: tokens per chunk when no manager is given.

    Raises:
        UnsupportedModelError: kvtier cannot run the model exactly (one line: why).
        ProfileMissingError: placement ``auto`` without rates and no profile here.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: TieredCacheConfig | None = None,
        manager: KVManager | None = None,
        model_id: str | None = None,
        chunk_tokens: int = 256,
    ) -> None:
        self.config = config or TieredCacheConfig()
        # Refuse, with the reason, a model this cache cannot run exactly (before any state).
        spec = model_spec(model, manager.layout.chunk_tokens if manager else chunk_tokens)
        self.layer_specs = spec.layer_specs
        self.model_type = spec.model_type
        heads = spec.layout
        if manager is None:
            host_bytes = max(64 << 20, heads.kv_nbytes(8192) + heads.chunk_nbytes * 4)
            manager = KVManager(
                heads,
                model_id or model_identity(model),
                ManagerConfig(
                    chunk_tokens=chunk_tokens, host=HostConfig(capacity_bytes=host_bytes)
                ),
            )
        spec.check_manager(manager)
        device = torch.device(
            self.config.device
            if self.config.device is not None
            else next(model.parameters()).device
        )
        if self.config.rates is None:  # this machine's profile of the model, if any
            self.config = resolve_rates(self.config, manager.hasher.namespace.model_id)
        self.kv = SequenceKV(
            manager,
            spec.windows,
            self.config,
            device,
            self.model_type,
        )
        self.manager = manager
        self.layout = manager.layout
        super().__init__(layers=[FacadeLayer(self) for _ in range(self.layout.num_layers)])
        attach(model)

    # ---- transformers Cache API ----------------------------------------------------------

    def begin_forward(
        self, ids: torch.Tensor | None, new_tokens: int, rows: int, padding: torch.Tensor | None
    ) -> None:
        if self.kv.plan is not None and self.kv.plan.layers_written == self.layout.num_layers:
            self.kv.end_forward()  # a forward that ran without kvtier's end hook
        self.kv.begin_forward(new_tokens, rows, ids, padding)

    def end_forward(self) -> None:
        self.kv.end_forward()

    def update(  # type: ignore[override]
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[LayerKV, LayerKV]:
        """Take the new K/V ``[B, Hkv, N, D]`` of one layer; returns the layer's view.

        Raises:
            UnsupportedModelError: the keys do not match the layout (before any change).
        """
        plan = self.kv.plan
        if layer_idx == 0 and (plan is None or plan.layers_written):
            # No hook began this forward (the model was called around kvtier's hooks):
            # begin it here, with the token ids unknown (its chunks are private).
            self.begin_forward(None, key_states.shape[2], key_states.shape[0], None)
        view = self.kv.write(layer_idx, key_states, value_states)
        return view, view

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.kv.seq_len

    @property
    def seq_len(self) -> int:
        return self.kv.seq_len

    @property
    def is_initialized(self) -> bool:
        return self.kv.seq_len > 0

    @property
    def batch_size(self) -> int:
        return self.kv.state.rows if self.kv.state.rows else -1

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens; only tokens of the unsealed tail."""
        if tokens_to_remove > 0:
            raise NotImplementedError(
                f"TieredCache.crop({tokens_to_remove}): only tokens of the unsealed tail "
                f"({self.kv.state.tail_len}) can be removed"
            )
        if tokens_to_remove:
            self.kv.crop(-tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        rows = self.kv.state.rows
        if self.kv.seq_len and not torch.equal(beam_idx.cpu(), torch.arange(rows)):
            raise NotImplementedError("TieredCache does not support beam search reordering")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.kv.seq_len and repeats != 1:
            raise NotImplementedError("TieredCache cannot repeat a filled batch")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.kv.seq_len:
            raise NotImplementedError("TieredCache cannot select rows of a filled batch")

    def reset(self) -> None:
        """Forget the sequences (their sealed chunks stay in the tiers for reuse)."""
        self.kv.reset()

    # ---- kvtier API ---------------------------------------------------------------------

    def reuse_prefix(self, input_ids: torch.Tensor, salt: str = "") -> int:
        """Adopt the longest cached prefix of a prompt (``SequenceKV.reuse_prefix``)."""
        return self.kv.reuse_prefix(input_ids, salt)

    def reserve(self, open_chunks: int = 2) -> None:
        """Allocate the buffers of a one-sequence batch now (``SequenceKV.reserve``)."""
        self.kv.reserve(open_chunks)

    @property
    def windows(self) -> list[int | None]:
        return self.kv.windows

    @property
    def device_nbytes(self) -> int:
        """Device bytes counted against the budget: resident chunks plus the tails."""
        return self.kv.device_nbytes

    @property
    def peak_device_nbytes(self) -> int:
        return self.kv.peak_device_nbytes

    @property
    def staging_nbytes(self) -> int:
        return self.kv.staging_nbytes

    def stats(self) -> CacheStats:
        return self.kv.stats()

    def close(self) -> None:
        """Stop the link and release the device arena (host/disk chunks stay for reuse)."""
        self.kv.close()
