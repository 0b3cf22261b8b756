"""kvtier's attention for transformers: registration, the mask hook and the input-id hook.

``attach(model)`` registers ``"kvtier"`` in transformers' ``AttentionInterface`` and
``AttentionMaskInterface``, switches the model to it, and hooks the input embeddings so the
cache learns the token ids it must key chunks by. The attention function attends to a
``TieredCache`` layer as segments — resident chunks (one call over the device tier's layer
arena), streamed pieces (waiting only for that piece), and the recent tokens (causal) —
merged exactly. Called with plain tensors (another cache, or none), it falls back to
transformers' SDPA attention, so an attached model still works with ``DynamicCache``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from kvtier.attention import SegmentResult, attend_flat, attend_own_keys, attend_segment, merge
from kvtier.hf.cache import LayerView, PackedView, TieredCache, capture_ids

ATTENTION_NAME = "kvtier"


@dataclass(frozen=True)
class PaddingMask:
    """What the mask hook hands to every layer: the 2D padding mask, plus what SDPA needs.

    Attributes:
        padding: ``[B, kv_length]`` bool (True = real token), or None (no padding).
        mask_kwargs: the arguments transformers gave the mask hook, to build an SDPA mask
            when the layer is not backed by a ``TieredCache``.
    """

    padding: torch.Tensor | None
    mask_kwargs: dict[str, Any]

    def sdpa_mask(self) -> torch.Tensor | None:
        return ALL_MASK_ATTENTION_FUNCTIONS["sdpa"](**self.mask_kwargs)


def padding_mask_hook(**kwargs: Any) -> PaddingMask:
    """Mask function registered for ``"kvtier"``: pass the padding mask through."""
    mask = kwargs.get("attention_mask")
    padding = None if mask is None or bool(mask.all()) else mask.to(torch.bool)
    return PaddingMask(padding, kwargs)


def tiered_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: Any,
    value: Any,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: ``query [B, Hq, Sq, D]`` → ``[B, Sq, Hq, D]``."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if isinstance(key, PackedView):
        return _attend_packed(key, query, scale), None
    if not isinstance(key, LayerView):
        mask = (
            attention_mask.sdpa_mask()
            if isinstance(attention_mask, PaddingMask)
            else attention_mask
        )
        return sdpa_attention_forward(
            module, query, key, value, mask, dropout=dropout, scaling=scale, **kwargs
        )
    padding = attention_mask.padding if isinstance(attention_mask, PaddingMask) else None
    return _attend_view(key, query, padding, scale), None


def _attend_view(
    view: LayerView, query: torch.Tensor, padding: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """One layer through one ``TieredCache``: ``query [B, Hq, Sq, D]`` → ``[B, Sq, Hq, D]``.

    Layer 0 hands the cache this pass's padding; the last layer ends the cache's pass.
    """
    cache = view.cache
    if view.layer_idx == 0:
        cache.observe_padding(padding)
    out = _attend_layer(cache, view, query, scale)
    if view.layer_idx == cache.layout.num_layers - 1:
        cache.end_forward()
    return out.transpose(1, 2).contiguous()


def _attend_packed(view: PackedView, query: torch.Tensor, scale: float) -> torch.Tensor:
    """One layer of several sequences packed in one row: ``query [1, Hq, N, D]`` →
    ``[1, N, Hq, D]``, each span through its own cache.

    Decode spans (one query) whose whole KV is resident and unpadded take a fast path:
    one attention call per segment and row, and one merge for all of them.
    """
    rows = view.rows
    if view.layer_idx == 0:
        for row in rows:
            row.cache.observe_padding(None)
    out = query.new_empty(1, query.shape[2], query.shape[1], query.shape[3])
    decodes: list[tuple[int, LayerView]] = []
    for (start, length), row in zip(view.spans, rows, strict=True):
        if length == 1 and row.cache.windows[view.layer_idx] is None and _resident_decode(row):
            decodes.append((start, row))
            continue
        result = _attend_layer(row.cache, row, query[:, :, start : start + length], scale)
        out[:, start : start + length] = result.transpose(1, 2)
    if decodes:
        _attend_decodes(decodes, query, scale, out)
    if view.layer_idx == rows[0].cache.layout.num_layers - 1:
        for row in rows:
            row.cache.end_forward()
    return out


def _resident_decode(view: LayerView) -> bool:
    """Nothing streams and no padding: resident chunks and the tail are the whole KV."""
    cache = view.cache
    plan = cache.plan
    return (
        not plan.pieces
        and plan.resident_valid is None
        and cache.recent_valid(view.recent_start, view.recent_key.shape[2]) is None
    )


def _attend_decodes(
    decodes: list[tuple[int, LayerView]], query: torch.Tensor, scale: float, out: torch.Tensor
) -> None:
    """One query per row over its resident chunks and its tail; writes ``out[0, start]``.

    No mask applies (the one query is the newest token), so each segment is one fused call
    on the query heads folded per KV head (``[1, Hkv, G, D]``); rows with resident chunks
    get two partial results, merged for all rows at once.
    """
    _, hq, _, dim = query.shape
    hkv = decodes[0][1].recent_key.shape[1]
    folded = query[0].to(torch.float32).reshape(hkv, hq // hkv, -1, dim)  # [Hkv, G, N, D]
    merged: list[tuple[list[int], SegmentResult]] = []
    both: list[int] = []
    tail_only: list[int] = []
    resident: list[SegmentResult] = []
    tails: list[SegmentResult] = []
    tails_alone: list[SegmentResult] = []
    for start, row in decodes:
        cache = row.cache
        plan = cache.plan
        q = folded[None, :, :, start]  # [1, Hkv, G, D]
        tail = SegmentResult(
            *attend_flat(
                q, row.recent_key.to(torch.float32), row.recent_value.to(torch.float32), None, scale
            )
        )
        if not plan.resident:
            tail_only.append(start)
            tails_alone.append(tail)
            continue
        assert cache.device_tier is not None
        keys, values = cache.device_tier.layer_kv(row.layer_idx)  # [H, S, T, D]
        keys = keys[:, plan.resident_slots].reshape(1, hkv, -1, dim)
        values = values[:, plan.resident_slots].reshape(1, hkv, -1, dim)
        resident.append(
            SegmentResult(
                *attend_flat(q, keys.to(torch.float32), values.to(torch.float32), None, scale)
            )
        )
        tails.append(tail)
        both.append(start)
    if both:
        merged.append((both, merge([_stack(resident), _stack(tails)])))
    if tail_only:
        merged.append((tail_only, _stack(tails_alone)))
    for starts, result in merged:
        index = torch.tensor(starts, dtype=torch.long, device=out.device)
        rows = result.out.reshape(len(starts), hq, dim).to(out.dtype)  # [R, Hq, D]
        out[0].index_copy_(0, index, rows)


def _stack(results: list[SegmentResult]) -> SegmentResult:
    """Rows of batch-1 results ``[1, ...]`` as one result ``[R, ...]``."""
    return SegmentResult(torch.cat([r.out for r in results]), torch.cat([r.lse for r in results]))


def _attend_layer(
    cache: TieredCache, view: LayerView, query: torch.Tensor, scale: float
) -> torch.Tensor:
    """Segments of one layer, merged; queries in blocks to bound the score matrix.

    On the CPU the queries are one block: torch's fused flash kernel tiles them itself.
    A pass that starts on a chunk boundary (no tail before it) and has no padding attends
    its new tokens with the kernel's causal flag instead of a mask.
    """
    window = cache.windows[view.layer_idx]
    if window is not None:
        return _attend_windowed(cache, view, query, scale, window)
    plan = cache.plan
    sq = query.shape[2]
    block = sq if query.device.type == "cpu" else cache.config.query_block_tokens
    starts = list(range(0, sq, block))
    partial: list[list[SegmentResult]] = [[] for _ in starts]
    q0 = cache.seq_len - sq  # absolute position of the first query
    if plan.resident:
        assert cache.device_tier is not None
        keys, values = cache.device_tier.layer_kv(view.layer_idx)  # [H, S, T, D]
        heads, dim = keys.shape[0], keys.shape[-1]
        # Slots lo..hi-1 of this layer, end to end: one [H, n*T, D] sequence, no copy.
        keys = keys[:, plan.resident_slots].reshape(heads, -1, dim)
        values = values[:, plan.resident_slots].reshape(heads, -1, dim)
        _attend_blocks(partial, query, starts, block, keys, values, plan.resident_valid, scale)
    streamer = cache.streamer
    assert streamer is not None
    for index in plan.pieces_by_layer[view.layer_idx] if plan.pieces else []:
        keys, values = streamer.acquire(index)  # [H, n*T, D]
        valid = plan.piece_valid[index]
        _attend_blocks(partial, query, starts, block, keys, values, valid, scale)
        streamer.release(index)
    recent_len = view.recent_key.shape[2]
    valid_mask = cache.recent_valid(view.recent_start, recent_len)
    if len(starts) == 1 and recent_len == sq and valid_mask is None and sq > 1:
        partial[0].append(attend_own_keys(query, view.recent_key, view.recent_value, scale))
        starts = []
    for i, start in enumerate(starts):
        q = query[:, :, start : start + block]
        partial[i].append(
            attend_segment(
                q,
                view.recent_key,
                view.recent_value,
                scale,
                query_positions=q0 + start,
                key_start=view.recent_start,
                valid_mask=valid_mask,
            )
        )
    outs = [merge(results).out for results in partial]
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out.to(query.dtype)


def _attend_windowed(
    cache: TieredCache, view: LayerView, query: torch.Tensor, scale: float, window: int
) -> torch.Tensor:
    """A sliding-window layer: each query sees the keys ``q - window < k <= q`` only.

    The same segments as a full layer (resident chunks, streamed pieces, recent tokens),
    each attended with a mask of its keys' absolute positions. The plan streams this layer
    only the chunks its window reaches (``cut_pieces``); resident chunks wholly before the
    window are not read. Queries in one block: a window bounds what each sees, not the
    score matrix.
    """
    plan = cache.plan
    sq = query.shape[2]
    size = cache.layout.chunk_tokens
    q0 = cache.seq_len - sq  # absolute position of the first query
    device = query.device
    q_pos = torch.arange(q0, q0 + sq, device=device)
    oldest = q0 - window + 1  # no query sees a key before this

    def in_window(k_pos: torch.Tensor) -> torch.Tensor:  # [Sk] -> [1, 1, Sq, Sk] bool
        return (k_pos[None, :] > q_pos[:, None] - window)[None, None]

    def chunk_positions(chunks: list[int]) -> torch.Tensor:  # [len * T]; -1: no chunk
        base = torch.tensor(chunks, dtype=torch.long, device=device)[:, None] * size
        pos = base + torch.arange(size, device=device)
        return torch.where(base >= 0, pos, torch.full_like(pos, -(2**40))).flatten()

    results: list[SegmentResult] = []
    if plan.resident:
        assert cache.device_tier is not None
        keys, values = cache.device_tier.layer_kv(view.layer_idx)  # [H, S, T, D]
        heads, dim = keys.shape[0], keys.shape[-1]
        chunks = plan.resident_chunks
        if max(chunks) >= 0 and (max(chunks) + 1) * size > oldest:
            k = keys[:, plan.resident_slots].reshape(heads, -1, dim)
            v = values[:, plan.resident_slots].reshape(heads, -1, dim)
            mask = in_window(chunk_positions(chunks))
            results.append(_attend_sealed(query, k, v, scale, plan.resident_valid, mask))
    streamer = cache.streamer
    assert streamer is not None
    for index in plan.pieces_by_layer[view.layer_idx] if plan.pieces else []:
        piece = plan.pieces[index]
        keys, values = streamer.acquire(index)  # [H, n*T, D]
        if (max(piece.chunk_idx) + 1) * size > oldest:
            mask = in_window(chunk_positions(list(piece.chunk_idx)))
            valid = plan.piece_valid[index]
            results.append(_attend_sealed(query, keys, values, scale, valid, mask))
        streamer.release(index)
    recent_len = view.recent_key.shape[2]
    recent_pos = torch.arange(view.recent_start, view.recent_start + recent_len, device=device)
    results.append(
        attend_segment(
            query,
            view.recent_key,
            view.recent_value,
            scale,
            query_positions=q0,
            key_start=view.recent_start,
            valid_mask=cache.recent_valid(view.recent_start, recent_len),
            mask=in_window(recent_pos),
        )
    )
    return merge(results).out.to(query.dtype)


def _attend_blocks(
    partial: list[list[SegmentResult]],
    query: torch.Tensor,
    starts: list[int],
    block: int,
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor | None,
    scale: float,
) -> None:
    """Attend every query block to sealed chunks ``[H, n*T, D]`` shared by the batch.

    Sealed chunks precede every query, so no causal rule applies; ``valid [B, n*T]`` masks
    padding and tokens of other rows.
    """
    for i, start in enumerate(starts):
        q = query[:, :, start : start + block]
        partial[i].append(_attend_sealed(q, keys, values, scale, valid))


def _attend_sealed(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    valid: torch.Tensor | None,
    mask: torch.Tensor | None = None,
) -> SegmentResult:
    """``query [B, Hq, Sq, D]`` over sealed chunks ``[H, n*T, D]`` shared by the batch
    (broadcast, not copied); ``valid [B, n*T]`` masks padding and other rows' tokens."""
    batch = query.shape[0]
    k = keys.unsqueeze(0).expand(batch, *keys.shape)
    v = values.unsqueeze(0).expand(batch, *values.shape)
    return attend_segment(query, k, v, scale, valid_mask=valid, mask=mask)


def _capture_ids_hook(
    module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    ids = args[0] if args else kwargs.get("input")
    model = getattr(module, "_kvtier_model", None)
    if isinstance(ids, torch.Tensor) and model is not None and model() is not None:
        capture_ids(model(), ids)


def register() -> None:
    """Register ``"kvtier"`` with transformers (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, tiered_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, padding_mask_hook)


def attach(model: torch.nn.Module) -> None:
    """Switch ``model`` to kvtier attention and hook its input embeddings (idempotent)."""
    import weakref

    register()
    if getattr(model.config, "_attn_implementation", None) != ATTENTION_NAME:
        model.set_attn_implementation(ATTENTION_NAME)  # type: ignore[operator]
    embeddings = model.get_input_embeddings()  # type: ignore[operator]
    if not getattr(embeddings, "_kvtier_hooked", False):
        embeddings._kvtier_model = weakref.ref(model)
        embeddings.register_forward_pre_hook(_capture_ids_hook, with_kwargs=True)
        embeddings._kvtier_hooked = True
