"""Attention over a layer's segments: resident chunks, streamed pieces, recent tokens.

``attend(view, query, scale)`` attends one batch's layer (``LayerKV``) and
``attend_packed(view, query, scale)`` several sequences packed in one row (``PackedKV``).
Both take the layer's attention logit soft-cap (``softcap``, Gemma 2), applied to every
score of every segment before its softmax; the merge stays exact.
Each segment is attended with its log-sum-exp and the results are merged exactly
(``kvtier.attention.merge``), so no pass concatenates the cache. Sliding-window layers mask
every segment by its keys' absolute positions. A float32 CPU pass of one sequence whose
whole KV (float32 or bf16) is resident and unpadded takes one fused call instead (kvtier's
CPU kernel ``attend_prefill``, or ``attend_prefill_bf16`` for bf16 KV on a CPU with bf16
dot products, AMX or AVX-512 BF16: its earlier keys and its own keys, causally, no merge).
kvtier's CPU kernels have no soft-cap: a capped layer never takes them (``attend_prefill``,
``attend_slots`` on the host) but torch's path with the cap, which is exact. The functions
only read the views (and acquire/release the staging ring's pieces); they mutate no cache
state.
"""

from __future__ import annotations

from typing import Any

import torch

from kvtier import native
from kvtier.attention import SegmentResult, attend_flat, attend_own_keys, attend_segment, merge
from kvtier.runtime import low_attend
from kvtier.runtime.host_attend import attend_sealed, on_host
from kvtier.runtime.view import LayerKV, PackedKV


def attend(
    view: LayerKV, query: torch.Tensor, scale: float, softcap: float | None = None
) -> torch.Tensor:
    """``query [B, Hq, Sq, D]`` over one layer's segments → ``[B, Hq, Sq, D]``; ``softcap``:
    the layer's attention logit soft-cap (None: none)."""
    fused = _fused_inputs(view, query, softcap)
    if fused is not None:
        out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])
        fused[0].attend_prefill(query[0], *fused[1:], out, scale)
        return out.transpose(0, 1)[None]
    if view.window is not None:
        return _attend_windowed(view, query, scale, view.window, softcap)
    return _attend_full(view, query, scale, softcap)


def attend_packed(
    view: PackedKV,
    query: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    softcap: float | None = None,
    low: torch.dtype | None = None,
) -> torch.Tensor:
    """``query [1, Hq, N, D]`` of packed spans → ``[1, N, Hq, D]``, each span over its own
    sequence's KV. ``out``: the step's output to write the spans' rows into (the other
    rows are left as they are); None: a new one. ``softcap``: the layer's attention logit
    soft-cap (None: none). ``low`` (``bfloat16``, kvtier's bf16 mode): long passes that
    the fused kernel would take attend with their operands rounded to it instead
    (``kvtier.runtime.low_attend``); None: float32 throughout.

    Decode spans (one query) of full-attention layers whose whole KV is resident and
    unpadded take a fast path: one attention call per segment and row, and one merge for
    all of them.
    """
    if out is None:
        out = query.new_empty(1, query.shape[2], query.shape[1], query.shape[3])
    decodes: list[tuple[int, LayerKV]] = []
    for (start, length), row in zip(view.spans, view.rows, strict=True):
        if length == 1 and row.window is None and row.all_resident:
            decodes.append((start, row))
            continue
        span = query[:, :, start : start + length]
        fused = _fused_inputs(row, span, softcap)
        if fused is not None:
            rows = out[0, start : start + length]
            ops, k_old, v_old, k_new, v_new = fused
            earlier = k_old.shape[1] + k_new.shape[1] - length  # k_new may lead with some
            if k_new.dtype == torch.bfloat16 and _bf16_takes(length, earlier):
                ops.attend_prefill_bf16(span[0], k_old, v_old, k_new, v_new, rows, scale)
            elif low is not None and low_attend.takes(length, earlier):
                low_attend.attend_prefill_low(span[0], k_old, v_old, k_new, v_new, rows, scale, low)
            else:
                ops.attend_prefill(span[0], k_old, v_old, k_new, v_new, rows, scale)
            continue
        result = attend(row, span, scale, softcap)
        out[:, start : start + length] = result.transpose(1, 2)
    if decodes:
        _attend_decodes(decodes, query, scale, out, softcap)
    return out


BF16_MIN_PAIRS = {"amx": 1 << 13, "avx512_bf16": 1 << 9}
"""A pass over bf16 KV (kvtier's bf16 mode) with at least this many causal query-key pairs
per head, ``S * (E + S / 2)``, takes ``attend_prefill_bf16`` where the CPU has bf16 dot
products (``native.bf16_prefill()``: AMX tiles, or AVX-512 BF16's vdpbf16ps): both
matmuls on them, the softmax in base 2, queries and probabilities rounded to bf16.
Measured against ``attend_prefill`` on the same bf16 KV and torch's bf16 flash kernel
(SmolLM2's shape: 9 query heads over 3, D 64; 2 threads, best of 5; ms, S new tokens over
E earlier keys). AMX (Intel Xeon): 64 over 0 0.037 against 0.029 and 0.087; 16 over
512 0.080 / 0.075 / 0.205; 64 over 64 0.060 / 0.073 / 0.222; 128 over 0 0.061 / 0.085 /
0.144; 512 over 0 0.47 / 0.96 / 1.07; 16 over 4,096 0.42-0.50 / 0.63 / 0.66-0.85; 128
over 1,024 0.41 / 0.94 / 0.75; 2,048 over 0 5.1 / 14.1 / 9.9; 2,048 over 2,048 15.6 /
43.9 / 22.5. vdpbf16ps (AMD EPYC Zen 4): 2 over 0 0.010 against 0.007 and 0.065; 16
over 0 0.014 / 0.011 / 0.077; 32 over 0 0.020 / 0.020 / 0.098; 2 over 64 0.024 / 0.025 /
0.178; 64 over 0 0.042 / 0.050 / 0.306; 16 over 512 0.20 / 0.23 / 0.51; 512 over 0 1.76 /
3.45 / 8.31; 16 over 4,096 1.09 / 1.70 / 2.61; 128 over 1,024 1.77 / 3.45 / 4.86; 2,048
over 0 14.4 / 28.6 / 43.6; 2,048 over 2,048 40.6 / 83.9 / 105.7 (torch's flash kernel
there loses to the float32 kernel too; it wins only at 2 over 4,096: 0.54 against 0.72
/ 1.11). So it replaces torch's flash kernel (``low_attend``) for bf16 KV."""


def _bf16_takes(new_tokens: int, earlier_tokens: int) -> bool:
    units = native.bf16_prefill()
    pairs = low_attend.causal_pairs(new_tokens, earlier_tokens)
    return bool(units) and pairs >= BF16_MIN_PAIRS[units]


_FUSED_HEAD_DIMS = (64, 128)
"""Head dims kvtier's ``attend_prefill`` kernel is compiled for."""

FUSED_MIN_TOKENS = 2
"""The fused kernel takes every pass of at least 2 tokens, however long and however many
earlier keys (a one-token pass is a decode). It measured faster than torch's SDPA at every
length: 135-175 GFLOP/s from 16 tokens up (a 2,048-token pass over 0 / 2,048 / 6,144
earlier keys: 172 / 165 / 139 against SDPA's 108 / 73 / 82), and even for 2 tokens over
4,096 (16 against 16, where 14 of each item's 16 lanes idle)."""


def _fused_inputs(
    view: LayerKV, query: torch.Tensor, softcap: float | None
) -> tuple[Any, ...] | None:
    """``(ops, k_old, v_old, k_new, v_new)`` for kvtier's ``attend_prefill`` over
    ``query [1, Hq, S, D]`` where it applies: kvtier's CPU kernels, a float32 query and
    float32 or bf16 KV (``native.KV_DTYPES``, one dtype) on the CPU, a full-attention layer
    without soft-cap whose whole KV is resident and unpadded, the pass's own keys last in
    ``recent_key``, at least ``FUSED_MIN_TOKENS``. None: the segments path. With
    resident chunks, ``k_old`` is the chunks and ``k_new`` the whole tail (its tokens
    before the pass all visible: the kernel's ``P``); without, ``k_old`` is the tail
    before the pass and ``k_new`` the pass's own keys.

    A pass over resident chunks and an earlier tail (a reused prefix that ends inside a
    chunk: every next turn) took the segments path before the kernel had ``P``; warm 4K
    TTFT in bf16 spent 40-47 % of its 82-92 ms there (py-spy, Intel Xeon).

    Measured against torch's SDPA (``enable_gqa``, causal or with the pass's mask) on
    SmolLM2's shape (9 query heads over 3, D 64, float32; 2-core AMD EPYC Zen 4, 2 threads,
    interleaved, best of 5; GFLOP/s kernel against SDPA): 256 tokens over none 138 against
    51, over 2,048 earlier keys 156 against 87; 512 over none 145 against 54, over 1,024
    156 against 75; 2,048 over none 172 against 108, over 2,048 165 against 73, over 6,144
    139 against 82; 4,096 over none 166 against 114.
    """
    sq, dim = query.shape[2], query.shape[3]
    if (
        sq < FUSED_MIN_TOKENS
        or softcap is not None
        or query.shape[0] != 1
        or view.window is not None
        or not view.all_resident
        or dim not in _FUSED_HEAD_DIMS
        or query.dtype != torch.float32
        or not query.is_cpu
    ):
        return None
    recent = view.recent_key.shape[2]
    earlier = recent - sq  # the tail's tokens before this pass
    if view.recent_key.shape[0] != 1 or earlier < 0:
        return None
    kv = _kv_tensors(view)
    if any(t is not None and (t.stride(-1) != 1 or t.dtype != view.recent_key.dtype) for t in kv):
        return None
    ops = native.kv_ops(view.recent_key)
    if ops is None:
        return None
    if view.resident_key is not None and view.resident_value is not None:
        return ops, view.resident_key, view.resident_value, view.recent_key[0], view.recent_value[0]
    k_old, v_old = view.recent_key[0, :, :earlier], view.recent_value[0, :, :earlier]
    k_new, v_new = view.recent_key[0, :, earlier:], view.recent_value[0, :, earlier:]
    return ops, k_old, v_old, k_new, v_new


def _kv_tensors(view: LayerKV) -> tuple[torch.Tensor | None, ...]:
    return (view.recent_key, view.recent_value, view.resident_key, view.resident_value)


def _attend_decodes(
    decodes: list[tuple[int, LayerKV]],
    query: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    softcap: float | None,
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
        q = folded[None, :, :, start]  # [1, Hkv, G, D]
        recent_key = row.recent_key.to(torch.float32)
        recent_value = row.recent_value.to(torch.float32)
        tail = SegmentResult(*attend_flat(q, recent_key, recent_value, None, scale, None, softcap))
        if row.resident_key is None or row.resident_value is None:
            tail_only.append(start)
            tails_alone.append(tail)
            continue
        keys = row.resident_key.reshape(1, hkv, -1, dim).to(torch.float32)
        values = row.resident_value.reshape(1, hkv, -1, dim).to(torch.float32)
        resident.append(SegmentResult(*attend_flat(q, keys, values, None, scale, None, softcap)))
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


def _attend_full(
    view: LayerKV, query: torch.Tensor, scale: float, softcap: float | None
) -> torch.Tensor:
    """Segments of one full-attention layer, merged; queries in blocks to bound the score
    matrix.

    On the CPU the queries are one block: torch's fused flash kernel tiles them itself
    (soft-capped scores take the matmul path, in blocks like elsewhere). A pass that starts
    on a chunk boundary (no tail before it) and has no padding attends its new tokens with
    the kernel's causal flag instead of a mask.
    """
    sq = query.shape[2]
    tiled = query.device.type == "cpu" and softcap is None
    block = sq if tiled else view.query_block_tokens
    starts = list(range(0, sq, block))
    partial: list[list[SegmentResult]] = [[] for _ in starts]
    if view.resident_key is not None and view.resident_value is not None:
        _attend_blocks(
            partial,
            query,
            starts,
            block,
            view.resident_key,
            view.resident_value,
            view.resident_valid,
            scale,
            softcap,
        )
    for index, _, valid in view.pieces:
        keys, values = view.staging.acquire(index)  # [H, n*T, D]
        _attend_blocks(partial, query, starts, block, keys, values, valid, scale, softcap)
        view.staging.release(index)
    if view.hosted is not None:
        for i, start in enumerate(starts):
            q = query[:, :, start : start + block]
            partial[i].append(on_host(view.hosted, q, scale, softcap))
    recent_len = view.recent_key.shape[2]
    if len(starts) == 1 and recent_len == sq and view.recent_valid is None and sq > 1:
        own = attend_own_keys(query, view.recent_key, view.recent_value, scale, softcap)
        partial[0].append(own)
        starts = []
    for i, start in enumerate(starts):
        q = query[:, :, start : start + block]
        partial[i].append(
            attend_segment(
                q,
                view.recent_key,
                view.recent_value,
                scale,
                query_positions=view.query_start + start,
                key_start=view.recent_start,
                valid_mask=view.recent_valid,
                softcap=softcap,
            )
        )
    outs = [merge(results).out for results in partial]
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out.to(query.dtype)


def _attend_windowed(
    view: LayerKV, query: torch.Tensor, scale: float, window: int, softcap: float | None
) -> torch.Tensor:
    """A sliding-window layer: each query sees the keys ``q - window < k <= q`` only.

    The same segments as a full layer, each attended with a mask of its keys' absolute
    positions. The plan holds and streams this layer only the chunks its window reaches;
    resident chunks wholly before the window are not read. Queries in one block: a window
    bounds what each sees, not the score matrix.
    """
    sq = query.shape[2]
    size = view.chunk_tokens
    q0 = view.query_start
    device = query.device
    q_pos = torch.arange(q0, q0 + sq, device=device)
    oldest = q0 - window + 1  # no query sees a key before this

    def in_window(k_pos: torch.Tensor) -> torch.Tensor:  # [Sk] -> [1, 1, Sq, Sk] bool
        return (k_pos[None, :] > q_pos[:, None] - window)[None, None]

    def chunk_positions(chunks: tuple[int, ...]) -> torch.Tensor:  # [len * T]; -1: no chunk
        base = torch.tensor(chunks, dtype=torch.long, device=device)[:, None] * size
        pos = base + torch.arange(size, device=device)
        return torch.where(base >= 0, pos, torch.full_like(pos, -(2**40))).flatten()

    results: list[SegmentResult] = []
    chunks = view.resident_chunks
    if (
        view.resident_key is not None
        and view.resident_value is not None
        and max(chunks) >= 0
        and (max(chunks) + 1) * size > oldest
    ):
        mask = in_window(chunk_positions(chunks))
        keys, values = view.resident_key, view.resident_value
        results.append(
            attend_sealed(query, keys, values, scale, view.resident_valid, mask, softcap)
        )
    for index, piece, valid in view.pieces:
        keys, values = view.staging.acquire(index)  # [H, n*T, D]
        if (max(piece.chunk_idx) + 1) * size > oldest:
            mask = in_window(chunk_positions(piece.chunk_idx))
            results.append(attend_sealed(query, keys, values, scale, valid, mask, softcap))
        view.staging.release(index)
    hosted = view.hosted
    if hosted is not None and (max(hosted.chunks) + 1) * size > oldest:
        mask = in_window(chunk_positions(hosted.chunks))
        results.append(on_host(hosted, query, scale, softcap, mask))
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
            valid_mask=view.recent_valid,
            mask=in_window(recent_pos),
            softcap=softcap,
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
    softcap: float | None,
) -> None:
    """Attend every query block to sealed chunks ``[H, n*T, D]`` shared by the batch.

    Sealed chunks precede every query, so no causal rule applies; ``valid [B, n*T]`` masks
    padding and tokens of other rows.
    """
    for i, start in enumerate(starts):
        q = query[:, :, start : start + block]
        partial[i].append(attend_sealed(q, keys, values, scale, valid, None, softcap))
