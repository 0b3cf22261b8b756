"""``TieredCache``: a transformers ``Cache`` whose KV lives in kvtier's tiers.

Per sequence (batch row) the cache holds sealed chunks, each in the device tier (resident)
or only in the host tier (streamed in layer by layer when attention needs it), plus one
mutable tail chunk on the device. ``update`` returns a ``LayerView`` handle instead of
concatenated tensors; the attention function registered by ``kvtier.hf.attention`` attends
to resident chunks, streamed pieces and the recent tokens as separate segments and merges
them exactly.

Device memory (the cache's own accounting, ``device_nbytes``): the resident chunks (a
layer-major device tier of ``device_budget_bytes - batch × chunk_nbytes``) plus one tail
chunk per row stay within ``device_budget_bytes``; the streaming ring adds the fixed
``staging_nbytes`` (≤ ``staging_bytes``). Transient per-forward activations (the new tokens'
K/V of one layer) are not counted; ``kvtier.hf.generate`` prefills in chunk-sized pieces
to keep them small.

Lifecycle of a forward pass: ``update(layer 0)`` plans it (which chunks are resident, which
must stream, pins them, starts the stream); each layer's attention consumes its pieces; the
last layer's attention calls ``end_forward`` which seals every chunk completed during the
pass (host once, device if it is among the newest) and unpins.

Thread-safety: one forward pass at a time per cache. Tiers may be shared with other caches.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvtier.config import HostConfig, ManagerConfig, TieredCacheConfig
from kvtier.hf.stream import Piece, Streamer, cut_pieces
from kvtier.kv.chunk import Chunk, ChunkRef
from kvtier.kv.layout import KVLayout
from kvtier.kv.spec import check_exact, check_update, sliding_windows
from kvtier.manager import KVManager
from kvtier.tiers.base import ChunkLostError, TierStats
from kvtier.tiers.pool import PoolTier, device_tier
from kvtier.transfer import LinkStats

# The token ids of the latest forward of each model, captured by a pre-hook on its input
# embeddings: ``update(layer 0)`` of the cache in use picks them up to key its chunks.
_LAST_IDS: weakref.WeakKeyDictionary[torch.nn.Module, torch.Tensor] = weakref.WeakKeyDictionary()


@dataclass
class LayerView:
    """What ``TieredCache.update`` hands to the attention function for one layer.

    Attributes:
        cache: the cache (the attention function reads resident and streamed chunks there).
        layer_idx: the layer.
        recent_key: ``[B, Hkv, R, D]``: the unsealed tail before this pass plus the new
            tokens (a view of the tail when they fit in it).
        recent_value: same shape.
        recent_start: absolute position of ``recent_key``'s first token.
    """

    cache: TieredCache
    layer_idx: int
    recent_key: torch.Tensor
    recent_value: torch.Tensor
    recent_start: int


@dataclass
class PackedView:
    """One layer of a forward over several ``TieredCache``s packed into one row.

    Handed to the attention function by a cache that keeps one ``TieredCache`` per sequence
    (``kvtier.engine.batch_cache.BatchCache``): the forward's single row holds each
    sequence's new tokens end to end, and the queries ``spans[i] = (start, length)`` of the
    packed row attend to ``rows[i]`` through that sequence's own cache.

    Attributes:
        layer_idx: the layer.
        rows: each sequence's ``LayerView`` (batch size 1 each), in packed order.
        spans: each sequence's ``(start, length)`` in the packed row.
    """

    layer_idx: int
    rows: list[LayerView]
    spans: list[tuple[int, int]]


@dataclass
class _Plan:
    """One forward pass: what is resident, what streams, what is pinned."""

    resident: list[tuple[int, int, int]] = field(default_factory=list)  # (slot, row, chunk)
    pieces: list[Piece] = field(default_factory=list)
    pieces_by_layer: list[list[int]] = field(default_factory=list)
    device_pins: list[ChunkRef] = field(default_factory=list)
    host_pins: list[ChunkRef] = field(default_factory=list)
    resident_valid: torch.Tensor | None = None  # [B, (hi - lo) * T]; None: all valid
    resident_slots: slice = field(default_factory=lambda: slice(0, 0))  # slots attention reads
    resident_chunks: list[int] = field(default_factory=list)  # per slot read; -1: unused
    piece_valid: dict[int, torch.Tensor | None] = field(default_factory=dict)  # by piece, [B, n*T]
    recent_valid: tuple[tuple[int, int], torch.Tensor | None] | None = None
    sealed_before: int = 0
    tail_before: int = 0
    new_tokens: int = 0


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
        return "\n".join(rows)


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


class TieredCache(SelfManagedCache):
    """Drop-in transformers cache with a device byte budget over kvtier's tiers.

    Args:
        model: the causal LM it serves (its config, dtype and device; its attention is
            switched to kvtier's segmented attention, and a hook captures input ids).
        config: budget, staging, look-ahead, link.
        manager: the host/disk tiers; share one manager between caches (and turns) to
            reuse KV. Default: a private manager with a host tier big enough for 8K tokens.
        model_id: identity of the weights for chunk keys; default
            ``kvtier.models.model_identity(model)``.
        chunk_tokens: tokens per chunk when no manager is given.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: TieredCacheConfig | None = None,
        manager: KVManager | None = None,
        model_id: str | None = None,
        chunk_tokens: int = 256,
    ) -> None:
        from kvtier.hf.attention import ATTENTION_NAME, attach

        self.config = config or TieredCacheConfig()
        model_config = model.config
        dtype = next(model.parameters()).dtype
        # Refuse, with the reason, a model this cache cannot run exactly (before any state).
        heads = KVLayout.from_model_config(model_config, dtype, chunk_tokens)
        self.layer_specs = check_exact(model, heads.num_kv_heads, heads.head_dim)
        # Per layer: the sliding window attention must keep to, or None (whole history).
        self.windows = sliding_windows(model, self.layer_specs)
        self.model_type = str(getattr(model_config, "model_type", type(model).__name__))
        if manager is None:
            from kvtier.models import model_identity

            layout = KVLayout.from_model_config(model_config, dtype, chunk_tokens)
            host_bytes = max(64 << 20, layout.kv_nbytes(8192) + layout.chunk_nbytes * 4)
            manager = KVManager(
                layout,
                model_id or model_identity(model),
                ManagerConfig(
                    chunk_tokens=chunk_tokens, host=HostConfig(capacity_bytes=host_bytes)
                ),
            )
        expected = KVLayout.from_model_config(model_config, dtype, manager.layout.chunk_tokens)
        if expected != manager.layout:
            raise ValueError(
                f"manager: its layout {manager.layout.fingerprint()} does not match the model's "
                f"{expected.fingerprint()}; build the KVManager from this model's config and dtype"
            )
        if not isinstance(manager.host, PoolTier):
            raise ValueError("manager: the host tier must be a memory pool (PoolTier)")
        self.manager = manager
        self.layout = manager.layout
        self.host: PoolTier = manager.host
        self.device = torch.device(
            self.config.device
            if self.config.device is not None
            else next(model.parameters()).device
        )
        super().__init__(layers=[FacadeLayer(self) for _ in range(self.layout.num_layers)])
        self._model = weakref.ref(model)
        attach(model)
        self.attention_name = ATTENTION_NAME
        self.batch_size_ = 0
        self.seq_len = 0
        self.reused_tokens = 0
        self.sealed_chunks = 0
        self.salt = ""  # the tenant salt of the chunks this cache seals (see reuse_prefix)
        self.refs: list[list[ChunkRef]] = []
        self.token_ids = torch.empty(0, 0, dtype=torch.int64)  # [B, seq_len], -1 = unknown
        self.valid = torch.empty(0, 0, dtype=torch.bool)  # [B, seq_len], False = padding
        self.tail_len = 0
        self.tails: torch.Tensor | None = None  # [B, L, 2, H, T, D]
        self.device_tier: PoolTier | None = None
        self.streamer: Streamer | None = None
        self._open: torch.Tensor | None = None  # host [B, f, L, 2, H, T, D], chunks of a pass
        self._sink_pins: list[ChunkRef] = []
        self._plan: _Plan | None = None
        self.peak_device_nbytes = 0

    # ---- transformers Cache API ----------------------------------------------------------

    def update(  # type: ignore[override]
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[LayerView, LayerView]:
        """Take the new K/V ``[B, Hkv, N, D]`` of one layer; returns the layer's view.

        Raises:
            UnsupportedModelError: the keys do not match the layout (before any change).
        """
        layout = self.layout
        if (
            key_states.dim() != 4
            or key_states.shape[1] != layout.num_kv_heads
            or (key_states.shape[3] != layout.head_dim)
        ):
            check_update(
                self.model_type, layer_idx, key_states, layout.num_kv_heads, layout.head_dim
            )
        b, _, n, _ = key_states.shape
        if layer_idx == 0:
            self._begin_forward(b, n, key_states.device)
        plan = self._plan
        assert plan is not None and self.tails is not None
        size = self.layout.chunk_tokens
        tail_before = plan.tail_before
        tail_k = self.tails[:, layer_idx, 0]  # [B, H, T, D]
        tail_v = self.tails[:, layer_idx, 1]
        key_states = key_states.to(self.layout.dtype)
        value_states = value_states.to(self.layout.dtype)
        if tail_before + n <= size:
            tail_k[:, :, tail_before : tail_before + n] = key_states
            tail_v[:, :, tail_before : tail_before + n] = value_states
            recent_k = tail_k[:, :, : tail_before + n]
            recent_v = tail_v[:, :, : tail_before + n]
        else:
            recent_k = torch.cat([tail_k[:, :, :tail_before], key_states], dim=2)
            recent_v = torch.cat([tail_v[:, :, :tail_before], value_states], dim=2)
            full = (tail_before + n) // size
            assert self._open is not None
            for kv, recent in ((0, recent_k), (1, recent_v)):
                # [B, H, f*T, D] -> [B, f, H, T, D] into the host buffer of completed chunks.
                blocks = recent[:, :, : full * size].unflatten(2, (full, size)).transpose(1, 2)
                self._open[:, :full, layer_idx, kv].copy_(blocks)
            rest = tail_before + n - full * size
            tail_k[:, :, :rest] = recent_k[:, :, full * size :]
            tail_v[:, :, :rest] = recent_v[:, :, full * size :]
        view = LayerView(self, layer_idx, recent_k, recent_v, plan.sealed_before * size)
        return view, view

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seq_len

    @property
    def is_initialized(self) -> bool:
        return self.seq_len > 0

    @property
    def batch_size(self) -> int:
        return self.batch_size_ if self.batch_size_ else -1

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens; only tokens of the unsealed tail."""
        if tokens_to_remove == 0:
            return
        drop = -tokens_to_remove
        if tokens_to_remove > 0 or drop > self.tail_len:
            raise NotImplementedError(
                f"TieredCache.crop({tokens_to_remove}): only tokens of the unsealed tail "
                f"({self.tail_len}) can be removed"
            )
        self.tail_len -= drop
        self.seq_len -= drop
        self.token_ids = self.token_ids[:, : self.seq_len]
        self.valid = self.valid[:, : self.seq_len]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.seq_len and not torch.equal(beam_idx.cpu(), torch.arange(self.batch_size_)):
            raise NotImplementedError("TieredCache does not support beam search reordering")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.seq_len and repeats != 1:
            raise NotImplementedError("TieredCache cannot repeat a filled batch")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.seq_len:
            raise NotImplementedError("TieredCache cannot select rows of a filled batch")

    def reset(self) -> None:
        """Forget the sequences (their sealed chunks stay in the tiers for reuse)."""
        self._release_plan()
        if self.device_tier is not None and self._sink_pins:
            self.device_tier.unpin(self._sink_pins)
        self._sink_pins = []
        self.seq_len = self.tail_len = self.batch_size_ = 0
        self.refs = []
        self.token_ids = torch.empty(0, 0, dtype=torch.int64)
        self.valid = torch.empty(0, 0, dtype=torch.bool)
        self.salt = ""

    # ---- kvtier API ---------------------------------------------------------------------

    def reuse_prefix(self, input_ids: torch.Tensor, salt: str = "") -> int:
        """Adopt the longest cached prefix of a prompt from any tier; returns its tokens.

        Call on an empty cache before generating. At least one prompt token is left to
        compute (the model needs it for the next-token logits). Only whole chunks are reused;
        all rows must share the reused prefix (in practice: one row). ``salt`` is the
        tenant's: only chunks keyed under it are adopted, and the chunks this cache seals
        until ``reset`` are keyed under it too.

        Storage faults cost recompute, never an error: disk chunks are promoted to host
        first (blocking), and only the leading run that host then holds is adopted; the
        rest of the prefix is recomputed, and the chunks lost are counted in the manager's
        ``recomputed_chunks_by_cause`` (``"corrupt"`` or ``"missing"``).
        """
        if self.seq_len:
            raise ValueError("reuse_prefix: the cache already holds tokens; call reset() first")
        ids = input_ids.detach().to("cpu", torch.int64)
        if ids.dim() == 1:
            ids = ids.unsqueeze(0)
        size = self.layout.chunk_tokens
        limit = ((ids.shape[1] - 1) // size) * size
        self.salt = salt
        hits = [self.manager.lookup(row[:limit], salt) for row in ids]
        hit_chunks = min(len(h.refs) for h in hits)
        if hit_chunks == 0:
            return 0
        refs = [h.refs[:hit_chunks] for h in hits]
        self.host.count_reads(sum(h.by_tier.get("host", 0) for h in hits), 0)
        # Promote disk -> host, then adopt only the leading run that host now holds (pinned
        # until it is on the device): from a chunk found corrupt or gone on, the prefix is
        # recomputed. Corrupt chunks are counted where they are found (the promotion).
        held: list[ChunkRef] = []
        adopted = hit_chunks
        try:
            for row_refs in refs:
                outcomes = self.manager.promote(row_refs[:adopted])
                pinned = self.host.pin(row_refs[:adopted])
                held += [r for r, ok in zip(row_refs, pinned, strict=False) if ok]
                gone = [not ok and o != "corrupt" for o, ok in zip(outcomes, pinned, strict=True)]
                if any(gone):
                    self.manager.count_recompute("missing", sum(gone))
                adopted = next((i for i, ok in enumerate(pinned) if not ok), adopted)
            if adopted == 0:
                return 0
            self._init_batch(ids.shape[0], self.device)
            self.refs = [r[:adopted] for r in refs]
            hit = adopted * size
            self.seq_len = hit
            self.token_ids = ids[:, :hit].clone()
            self.valid = torch.ones(ids.shape[0], hit, dtype=torch.bool)
            self.reused_tokens = hit
            self._adopt_on_device()
        finally:
            self.host.unpin(held)
        return hit

    def reserve(self, open_chunks: int = 2) -> None:
        """Allocate and touch the buffers of a one-sequence batch now: the device tier,
        the tail, the host buffer for ``open_chunks`` chunks completed in one pass (a
        prefill piece of ``n`` chunks needs ``n + 1``), and the link.

        A serving engine reserves its caches at start, so no request pays the first touch
        of fresh memory (far slower than a copy into touched memory) and the device budget
        is taken up front. The cache stays empty; later passes reuse these buffers.
        """
        if self.seq_len:
            raise ValueError("reserve: the cache already holds tokens; call reset() first")
        self._init_batch(1, self.device)
        self._ensure_open(1, max(1, open_chunks))
        self.batch_size_ = 0
        self.refs = []

    @property
    def device_nbytes(self) -> int:
        """Device bytes counted against the budget: resident chunks plus the tails."""
        tier = self.device_tier.used_bytes if self.device_tier is not None else 0
        tails = self.tails.numel() * self.tails.element_size() if self.tails is not None else 0
        return tier + tails

    @property
    def staging_nbytes(self) -> int:
        return self.streamer.staging_nbytes if self.streamer is not None else 0

    def stats(self) -> CacheStats:
        streamer = self.streamer
        return CacheStats(
            device=self.device_tier.stats() if self.device_tier is not None else TierStats(),
            host=self.host.stats(),
            link=streamer.stats() if streamer is not None else LinkStats(),
            link_description=streamer.describe() if streamer is not None else "idle",
            device_budget_bytes=self.config.device_budget_bytes,
            device_nbytes=self.device_nbytes,
            staging_nbytes=self.staging_nbytes,
            reused_tokens=self.reused_tokens,
            sealed_chunks=self.sealed_chunks,
        )

    def close(self) -> None:
        """Stop the link and release the device tier (host/disk chunks stay for reuse)."""
        self.reset()
        if self.streamer is not None:
            self.streamer.close()
            self.streamer = None
        if self.device_tier is not None:
            self.device_tier.close()
            self.device_tier = None

    # ---- forward-pass machinery (used by kvtier.hf.attention) ------------------------------

    def observe_padding(self, padding: torch.Tensor | None) -> None:
        """Record the ``[B, kv_length]`` padding mask of this pass (True = real token)."""
        plan = self._plan
        assert plan is not None
        if padding is not None:
            width = min(padding.shape[1], self.seq_len)
            self.valid[:, :width] = padding[:, :width].to("cpu", torch.bool)
        size = self.layout.chunk_tokens
        rows = self.batch_size_
        valid = self.valid
        assert self.device_tier is not None
        # Attention reads one contiguous range of slots; slots in it that this pass does not
        # use stay masked out.
        lo = min((slot for slot, _, _ in plan.resident), default=0)
        hi = max((slot + 1 for slot, _, _ in plan.resident), default=0)
        resident = torch.zeros(rows, hi - lo, size, dtype=torch.bool)
        for slot, row, chunk in plan.resident:
            resident[row, slot - lo] = valid[row, chunk * size : (chunk + 1) * size]
        plan.resident_slots = slice(lo, hi)
        plan.resident_chunks = [-1] * (hi - lo)
        for slot, _, chunk in plan.resident:
            plan.resident_chunks[slot - lo] = chunk
        plan.resident_valid = self._flat_mask(resident)
        plan.piece_valid = {}
        masks: dict[tuple[tuple[int, ...], tuple[int, ...]], torch.Tensor | None] = {}
        for index, piece in enumerate(plan.pieces):  # layers share most pieces' chunks
            key = (piece.rows, piece.chunk_idx)
            if key not in masks:
                mask = torch.zeros(rows, len(piece.host_slots), size, dtype=torch.bool)
                for j, (row, chunk) in enumerate(zip(*key, strict=True)):
                    mask[row, j] = valid[row, chunk * size : (chunk + 1) * size]
                masks[key] = self._flat_mask(mask)
            plan.piece_valid[index] = masks[key]

    def _flat_mask(self, mask: torch.Tensor) -> torch.Tensor | None:
        """``[B, S, T]`` → ``[B, S*T]`` on the device, or None when every token is visible."""
        return None if bool(mask.all()) else mask.flatten(1).to(self.device)

    def recent_valid(self, start: int, length: int) -> torch.Tensor | None:
        """``[B, length]`` padding mask of the recent tokens; None when all are real.

        The same for every layer of a pass, so it is computed once (at layer 0).
        """
        plan = self.plan
        if plan.recent_valid is None or plan.recent_valid[0] != (start, length):
            valid = self.valid[:, start : start + length]
            mask = None if bool(valid.all()) else valid.to(self.device)
            plan.recent_valid = ((start, length), mask)
        return plan.recent_valid[1]

    @property
    def plan(self) -> _Plan:
        assert self._plan is not None, "no forward pass in progress"
        return self._plan

    def end_forward(self) -> None:
        """Seal every chunk completed in this pass, decide residency, unpin."""
        plan = self.plan
        size = self.layout.chunk_tokens
        total = plan.tail_before + plan.new_tokens
        self._release_plan()  # waits for the stream, then unpins
        if total < size:
            self.tail_len = total
            return
        assert self.tails is not None
        if total == size:
            data, full = self.tails[:, None], 1  # the tail filled exactly: [B, 1, L, 2, H, T, D]
        else:
            assert self._open is not None
            full = total // size
            data = self._open[:, :full]
        sinks: list[Chunk] = []
        others: list[Chunk] = []
        for row in range(self.batch_size_):
            for j in range(full):
                ref = self._next_ref(row)
                chunk = Chunk(ref, data[row, j])
                (sinks if len(self.refs[row]) < self.config.sink_chunks else others).append(chunk)
                self.refs[row].append(ref)
        self.manager.store(sinks + others)
        self.sealed_chunks += len(sinks) + len(others)
        self._place_on_device(sinks, others)
        self.tail_len = total - full * size

    # ---- internals ------------------------------------------------------------------------

    def _init_batch(self, rows: int, device: torch.device) -> None:
        layout = self.layout
        if self.batch_size_ and rows != self.batch_size_:
            raise ValueError(
                f"batch size changed from {self.batch_size_} to {rows}; "
                "call reset() between batches"
            )
        if self.batch_size_:
            return
        tail_nbytes = rows * layout.chunk_nbytes
        budget = self.config.device_budget_bytes
        if budget < tail_nbytes:
            raise ValueError(
                f"device_budget_bytes: {budget} is below the minimum {tail_nbytes} for a batch "
                f"of {rows} (one {layout.chunk_nbytes}-byte tail chunk per sequence)"
            )
        self.batch_size_ = rows
        self.refs = [[] for _ in range(rows)]
        shape = (rows, *layout.chunk_shape)
        if self.tails is None or tuple(self.tails.shape) != shape or self.tails.device != device:
            # Only the first tail_len tokens of a tail are ever read: no need to clear it.
            self.tails = torch.zeros(shape, dtype=layout.dtype, device=device)
        if self.device_tier is None or self.device_tier.capacity_bytes != budget - tail_nbytes:
            if self.device_tier is not None:
                self.device_tier.close()
            self.device_tier = device_tier(layout, budget - tail_nbytes, device)
        if self.streamer is None:
            self.streamer = Streamer(
                layout,
                self.host,
                device,
                self.config.staging_bytes,
                self.config.lookahead,
                self.config.prefetch,
                self.config.link,
            )

    def _begin_forward(self, rows: int, new_tokens: int, device: torch.device) -> None:
        if self._plan is not None:
            # The previous pass did not reach its last layer (an exception): drop its state.
            self._release_plan()
        self._init_batch(rows, device)
        assert self.device_tier is not None and self.streamer is not None
        model = self._model()
        ids = _LAST_IDS.pop(model, None) if model is not None else None
        plan = _Plan(sealed_before=len(self.refs[0]), tail_before=self.tail_len)
        streamed = self._pin_sealed(plan)  # before any state changes: it may raise
        plan.new_tokens = new_tokens
        size = self.layout.chunk_tokens
        if ids is None or tuple(ids.shape) != (rows, new_tokens):
            ids = torch.full((rows, new_tokens), -1, dtype=torch.int64)
        self.token_ids = torch.cat(
            [self.token_ids.reshape(rows, -1), ids.to("cpu", torch.int64)], 1
        )
        self.valid = torch.cat(
            [self.valid.reshape(rows, -1), torch.ones(rows, new_tokens, dtype=torch.bool)], 1
        )
        # A sliding layer's queries see no key before (first query - window + 1).
        first_chunk = [
            max(0, (self.seq_len - window + 1) // size) if window is not None else 0
            for window in self.windows
        ]
        self.seq_len += new_tokens
        full = (self.tail_len + new_tokens) // size
        if self.tail_len + new_tokens > size:
            self._ensure_open(rows, full)
        plan.pieces = cut_pieces(
            self.layout.num_layers, streamed, self.streamer.piece_chunks, first_chunk
        )
        per_layer: list[list[int]] = [[] for _ in range(self.layout.num_layers)]
        for index, piece in enumerate(plan.pieces):
            per_layer[piece.layer_idx].append(index)
        plan.pieces_by_layer = per_layer
        self._plan = plan
        self.streamer.start(plan.pieces)
        self.peak_device_nbytes = max(self.peak_device_nbytes, self.device_nbytes)

    def _pin_sealed(self, plan: _Plan) -> list[tuple[int, int, int]]:
        """Pin every sealed chunk for a pass: on the device (resident, into ``plan``) or
        in host (streamed; disk chunks are promoted first). Returns the streamed ones as
        ``(host slot, row, chunk)``.

        Raises:
            ChunkLostError: a chunk is in no tier (evicted, corrupt, unreadable); nothing
                is left pinned, and the chunks lost are counted in the manager's stats.
        """
        assert self.device_tier is not None
        streamed: list[tuple[int, int, int]] = []
        missing: list[ChunkRef] = []
        for row, row_refs in enumerate(self.refs):
            for chunk, ref in enumerate(row_refs):
                if self.device_tier.pin([ref])[0]:
                    plan.device_pins.append(ref)
                    slot = self.device_tier.slot_of(ref)
                    assert slot is not None
                    plan.resident.append((slot, row, chunk))
                    continue
                if not self.host.contains(ref):
                    missing.append(ref)
                streamed.append((-1, row, chunk))
        outcomes = dict(zip(missing, self.manager.promote(missing), strict=True))
        lost: dict[int, tuple[int, str]] = {}  # row -> (first chunk lost, cause)
        for i, (_, row, chunk) in enumerate(streamed):
            ref = self.refs[row][chunk]
            if row in lost or not self.host.pin([ref])[0]:
                if row not in lost:
                    lost[row] = (chunk, "corrupt" if outcomes.get(ref) == "corrupt" else "missing")
                continue
            plan.host_pins.append(ref)
            slot = self.host.slot_of(ref)
            assert slot is not None
            streamed[i] = (slot, row, chunk)
        if not lost:
            return streamed
        self.device_tier.unpin(plan.device_pins)
        self.host.unpin(plan.host_pins)
        gone = sum(
            1
            for row, (chunk, _) in lost.items()
            for ref in self.refs[row][chunk:]
            if outcomes.get(ref) != "corrupt" and self.manager.locate(ref) is None
        )
        if gone:  # (corrupt ones were counted where they were found)
            self.manager.count_recompute("missing", gone)
        row, (chunk, cause) = next(iter(lost.items()))
        ref = self.refs[row][chunk]
        raise ChunkLostError(
            f"chunk {ref.short()} of sequence {row} is in no tier ({cause}); resume it from "
            f"its cached prefix (host capacity {self.host.capacity_bytes} bytes may be too "
            "small for the context)",
            cause=cause,
            num_chunks=sum(len(self.refs[r]) - c for r, (c, _) in lost.items()),
        )

    def _ensure_open(self, rows: int, full: int) -> None:
        shape = (rows, full, *self.layout.chunk_shape)
        if self._open is None or self._open.shape[0] != rows or self._open.shape[1] < full:
            pin = self.device.type == "cuda"
            self._open = torch.zeros(shape, dtype=self.layout.dtype, pin_memory=pin)

    def _next_ref(self, row: int) -> ChunkRef:
        size = self.layout.chunk_tokens
        index = len(self.refs[row])
        ids = self.token_ids[row, index * size : (index + 1) * size]
        parent = self.refs[row][-1] if self.refs[row] else None
        if bool((ids < 0).any()) or (parent is not None and not parent.token_ids):
            # Unknown tokens (inputs_embeds, or a chain already broken): a private chunk that
            # no lookup can match.
            return ChunkRef(os.urandom(self.manager.hasher.digest_bytes), ())
        return ChunkRef.of(
            self.manager.hasher.key(parent.key if parent else None, ids.numpy(), self.salt), ids
        )

    def _adopt_on_device(self) -> None:
        """Copy the sinks and the newest adopted chunks from host to the device tier."""
        refs = [r for row in self.refs for r in row]
        held = [r for r, ok in zip(refs, self.host.pin(refs), strict=True) if ok]
        try:
            sinks: list[Chunk] = []
            others: list[Chunk] = []
            for row in self.refs:
                for index, ref in enumerate(row):
                    view = self.host.view(ref) if ref in held else None
                    if view is not None:
                        (sinks if index < self.config.sink_chunks else others).append(
                            Chunk(ref, view)
                        )
            self._place_on_device(sinks, others)
        finally:
            self.host.unpin(held)

    def _place_on_device(self, sinks: list[Chunk], others: list[Chunk]) -> None:
        """Keep the sinks (pinned) and the newest sealed chunks resident on the device."""
        tier = self.device_tier
        assert tier is not None
        room = tier.num_slots - len(self._sink_pins)
        sinks = sinks[: max(0, room - 1)]  # always leave one slot for recent chunks
        newest = others[-(room - len(sinks)) :] if room - len(sinks) > 0 else []
        tier.put(sinks + newest)
        for chunk in sinks:
            if tier.pin([chunk.ref])[0]:
                self._sink_pins.append(chunk.ref)

    def _release_plan(self) -> None:
        plan = self._plan
        if plan is None:
            return
        if self.streamer is not None:
            self.streamer.finish()
        if self.device_tier is not None and plan.device_pins:
            self.device_tier.unpin(plan.device_pins)
        if plan.host_pins:
            self.host.unpin(plan.host_pins)
        self._plan = None


def capture_ids(model: torch.nn.Module, ids: torch.Tensor) -> None:
    """Record a forward's input ids for the cache that will see it (hook helper)."""
    _LAST_IDS[model] = ids.detach()


def take_ids(model: torch.nn.Module) -> torch.Tensor | None:
    """Remove and return the ids ``capture_ids`` recorded for ``model`` (None: none).

    For a cache that splits one forward's rows over several ``TieredCache``s: it takes the
    batch's ids, then hands each row cache its row with ``capture_ids``.
    """
    return _LAST_IDS.pop(model, None)
