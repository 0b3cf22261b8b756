"""Attention over a list of KV segments, merged exactly with their log-sum-exp.

A layer's KV for a batch is a list of segments (resident chunks, streamed chunks, host-side
chunks, the tail). Each segment is attended to on its own, giving an output normalised
within the segment and the log-sum-exp of its scores; the partial results are merged
exactly (the flash-decoding merge)::

    m = max_i lse_i;  w_i = exp(lse_i - m);  out = sum_i w_i out_i / sum_i w_i;
    lse = m + log(sum_i w_i)

so no step concatenates the whole cache, and a segment can be computed where it lies (a
host-side segment on the CPU: the query travels there and only ``out`` and ``lse`` come
back). ``kvtier.runtime.dispatch`` composes these pieces for a layer's segments.

Masking model: a key at absolute position ``k`` is visible to a query at position ``q`` iff
``k <= q`` (causal, when query positions are given), its segment's ``valid_mask`` is True
(False marks padding) and an optional extra mask allows it. A query row that sees no key of a
segment gets ``lse = -inf`` and ``out = 0`` and drops out of the merge without NaN.

Soft-capping (Gemma 2): with ``softcap = c`` every scaled score ``s`` becomes
``c · tanh(s / c)`` before the mask and the softmax, as transformers' eager attention does.
The cap is elementwise on each score, so a segment's ``out`` and ``lse`` are those of the
capped scores and the merge stays exact. Capped segments take the plain matmul softmax (the
fused CPU flash kernel has no cap).

Numerics: scores, softmax and the weighted sum run in float32 (bf16/fp16 inputs are
upcast); partial results stay float32; callers cast the merged output back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor


class SegmentResult(NamedTuple):
    """Attention of a query over one segment (or a merge of several).

    Attributes:
        out: ``[B, Hq, Sq, D]`` float32, normalised within the segment; 0 where ``lse`` is
            ``-inf``.
        lse: ``[B, Hq, Sq]`` float32 log-sum-exp of the scaled, masked scores; ``-inf`` for
            rows that saw no key.
    """

    out: Tensor
    lse: Tensor


def empty_result(query: Tensor) -> SegmentResult:
    """The result of attending to nothing: ``out = 0``, ``lse = -inf`` (the merge identity)."""
    b, hq, sq, d = query.shape
    out = torch.zeros(b, hq, sq, d, dtype=torch.float32, device=query.device)
    lse = torch.full((b, hq, sq), -math.inf, dtype=torch.float32, device=query.device)
    return SegmentResult(out, lse)


def attend_segment(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    scale: float,
    *,
    query_positions: Tensor | int | None = None,
    key_start: int = 0,
    valid_mask: Tensor | None = None,
    mask: Tensor | None = None,
    softcap: float | None = None,
) -> SegmentResult:
    """Attention of ``query`` over one KV segment, with its log-sum-exp.

    Grouped-query attention is computed without repeating K/V: the query heads that share a
    KV head are folded into the query length (``[B, Hkv, G*Sq, D]``).

    Args:
        query: ``[B, Hq, Sq, D]``, ``Hq = Hkv * G``.
        key: ``[B, Hkv, Sk, D]``, on the same device as ``query``.
        value: ``[B, Hkv, Sk, D]``.
        scale: multiplier of the scores (usually ``D ** -0.5``).
        query_positions: absolute positions of the queries for the causal rule
            ``key_pos <= query_pos``: an int ``q0`` (positions ``q0 .. q0+Sq-1`` for every
            row), a ``[Sq]`` or ``[B, Sq]`` tensor, or None for no causal rule.
        key_start: absolute position of the segment's first key.
        valid_mask: optional ``[B, Sk]`` bool, False for padding keys.
        mask: optional extra mask broadcastable to ``[B, Hq, Sq, Sk]``: bool (True = attend)
            or additive float.
        softcap: attention logit soft-cap ``c`` (scores become ``c · tanh(s / c)`` before
            the mask); None: no cap.

    Returns:
        ``SegmentResult(out [B, Hq, Sq, D] float32, lse [B, Hq, Sq] float32)``.
    """
    b, hq, sq, d = query.shape
    hkv, sk = key.shape[1], key.shape[2]
    if hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    groups = hq // hkv
    if sk == 0 or _entirely_future(query_positions, sq, key_start):
        return empty_result(query)

    # [B, Hq, Sq, D] -> [B, Hkv, G*Sq, D]: the G query heads of a KV head share its K/V.
    q = query.to(torch.float32).reshape(b, hkv, groups * sq, d)
    k = key.to(torch.float32)
    v = value.to(torch.float32)
    allowed = _visibility(query_positions, sq, key_start, sk, valid_mask, query.device)
    additive: Tensor | None = None  # [B|1, Hkv|1, G|1, Sq, Sk] float, added to the scores
    if allowed is not None:
        additive = torch.zeros(allowed.shape, dtype=torch.float32, device=query.device)
        additive.masked_fill_(~allowed, -math.inf)
    if mask is not None:
        extra = _grouped_mask(mask, hkv, groups)
        if extra.dtype == torch.bool:
            extra = torch.zeros(extra.shape, device=query.device).masked_fill_(~extra, -math.inf)
        additive = extra.to(torch.float32) if additive is None else additive + extra
    flat_mask = seen = None
    if additive is not None:
        # Materialise the mask only over what differs: [B|1, Hkv|1, G*Sq, Sk], then broadcast
        # (stride 0) over batch and heads; the fused kernel reads broadcast masks.
        mb, mh = additive.shape[0], additive.shape[1]
        compact = additive.expand(mb, mh, groups, sq, sk).reshape(mb, mh, groups * sq, sk)
        flat_mask = compact.expand(b, hkv, groups * sq, sk)
        # Which query rows see at least one key: [B|1, Hkv|1, G*Sq] -> [B, Hkv, G*Sq].
        source = allowed if mask is None and allowed is not None else torch.isfinite(compact)
        rows = source.any(dim=-1)
        if mask is None:
            rows = rows.expand(mb, mh, groups, sq).reshape(mb, mh, groups * sq)
        seen = rows.expand(b, hkv, groups * sq)
    out, lse = attend_flat(q, k, v, flat_mask, scale, seen, softcap)
    return SegmentResult(out.reshape(b, hq, sq, d), lse.reshape(b, hq, sq))


def attend_own_keys(
    query: Tensor, key: Tensor, value: Tensor, scale: float, softcap: float | None = None
) -> SegmentResult:
    """Causal attention of ``S`` new tokens over exactly their own keys, with log-sum-exp.

    The case of a prefill piece that starts a chunk: query ``i`` sees keys ``0..i``. On the
    CPU it is one call of torch's fused flash kernel with its causal flag (no mask is built
    and the masked half of the scores is skipped); grouped-query K/V are repeated to the
    query heads for it (``S × Hq × D`` elements, small next to the attention). Elsewhere,
    and for soft-capped scores (the kernel has no cap), it is ``attend_segment`` with the
    causal rule.

    Args:
        query: ``[B, Hq, S, D]``.
        key: ``[B, Hkv, S, D]``: the keys of the same ``S`` positions.
        value: ``[B, Hkv, S, D]``.
        scale: multiplier of the scores.
        softcap: attention logit soft-cap (see ``attend_segment``); None: no cap.

    Returns:
        ``SegmentResult(out [B, Hq, S, D] float32, lse [B, Hq, S] float32)``.
    """
    hq, sq = query.shape[1], query.shape[2]
    hkv = key.shape[1]
    if key.shape[2] != sq or value.shape != key.shape:
        raise ValueError(
            f"key/value: must be [B, Hkv, {sq}, D] like the query's length, got "
            f"{tuple(key.shape)} and {tuple(value.shape)}"
        )
    if hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    if query.device.type != "cpu" or softcap is not None:
        return attend_segment(
            query, key, value, scale, query_positions=0, key_start=0, softcap=softcap
        )
    groups = hq // hkv
    k = key.to(torch.float32)
    v = value.to(torch.float32)
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query.to(torch.float32), k, v, 0.0, True, scale=scale
    )
    return SegmentResult(out, lse)


def attend_flat(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    scale: float,
    seen: Tensor | None = None,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Softmax attention with log-sum-exp, float32: ``q [N, H, M, D]``, ``k, v [N, H, K, D]``,
    optional additive ``mask [N, H, M, K]`` (may broadcast) → ``(out [N, H, M, D],
    lse [N, H, M])``. ``seen [N, H, M]`` says which rows have a visible key (computed from the
    mask when not given). ``softcap = c``: the scaled scores become ``c · tanh(s / c)``
    before the mask (transformers' order); None: no cap.

    On the CPU without a cap this is torch's fused flash kernel (it returns the log-sum-exp);
    elsewhere, and with a cap, a plain matmul softmax. Rows that see no key come back as
    ``out = 0``, ``lse = -inf``.
    """
    if q.device.type == "cpu" and softcap is None:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=mask, scale=scale
        )
        if mask is not None:
            # The kernel reports lse = 0 for a row whose keys are all masked.
            if seen is None:
                seen = torch.isfinite(mask).any(dim=-1)  # [N, H, M]
            lse = torch.where(seen, lse, torch.full_like(lse, -math.inf))
            out = out * seen.unsqueeze(-1)
        return out, lse
    scores = torch.matmul(q * scale, k.transpose(-1, -2))  # [N, H, M, K]
    if softcap is not None:
        scores = scores.div_(softcap).tanh_().mul_(softcap)  # c · tanh(s / c), in place
    if mask is not None:
        scores = scores + mask
    row_max = scores.amax(dim=-1, keepdim=True)  # -inf if fully masked
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    probs = scores.sub_(row_max).exp_()  # masked scores become exp(-inf) = 0
    denom = probs.sum(dim=-1, keepdim=True)
    out = torch.matmul(probs, v)
    out.div_(torch.where(denom > 0, denom, torch.ones_like(denom)))
    return out, (row_max + denom.log()).squeeze(-1)


def merge(results: Sequence[SegmentResult]) -> SegmentResult:
    """Merge partial attention results exactly (flash-decoding merge).

    Rows whose ``lse`` is ``-inf`` in every input stay ``out = 0``, ``lse = -inf``.

    Args:
        results: partial results over disjoint key sets, same shapes and device.

    Returns:
        The result of attending to the union of the key sets (float32).
    """
    if not results:
        raise ValueError("results: merge needs at least one SegmentResult")
    if len(results) == 1:
        return results[0]
    lses = torch.stack([r.lse for r in results])  # [N, B, Hq, Sq]
    lse = torch.logsumexp(lses, dim=0)  # -inf only where every input is -inf
    # w_i = exp(lse_i - lse) sums to 1 per row; rows seen by no segment give NaN -> 0.
    weights = torch.exp(lses - lse).nan_to_num_(0.0).unsqueeze(-1)  # [N, B, Hq, Sq, 1]
    out = results[0].out * weights[0]
    for weight, result in zip(weights[1:], results[1:], strict=True):
        out.addcmul_(result.out, weight)
    return SegmentResult(out, lse)


def _entirely_future(query_positions: Tensor | int | None, sq: int, key_start: int) -> bool:
    """True if an int-positioned query block precedes every key of the segment."""
    return isinstance(query_positions, int) and key_start > query_positions + sq - 1


def _visibility(
    query_positions: Tensor | int | None,
    sq: int,
    key_start: int,
    sk: int,
    valid_mask: Tensor | None,
    device: torch.device,
) -> Tensor | None:
    """Which keys each query may see, shaped to broadcast against ``[B, Hkv, G, Sq, Sk]``.

    Returns None when every key is visible (no mask work on the common decode path).
    """
    allowed: Tensor | None = None
    if query_positions is not None:
        if isinstance(query_positions, int):
            needs_causal = key_start + sk - 1 > query_positions
            q_pos = torch.arange(query_positions, query_positions + sq, device=device)
        else:
            needs_causal = True
            q_pos = query_positions.to(device)
        if needs_causal:
            k_pos = torch.arange(key_start, key_start + sk, device=device)
            causal = k_pos <= q_pos.unsqueeze(-1)  # [Sq, Sk] or [B, Sq, Sk]
            if causal.dim() == 2:
                causal = causal.unsqueeze(0)
            allowed = causal[:, None, None]  # [B|1, 1, 1, Sq, Sk]
    if valid_mask is not None:
        valid = valid_mask.to(device=device, dtype=torch.bool)[:, None, None, None, :]
        allowed = valid if allowed is None else allowed & valid
    return allowed


def _grouped_mask(mask: Tensor, hkv: int, groups: int) -> Tensor:
    """A mask broadcastable to ``[B, Hq, Sq, Sk]``, reshaped to ``[B, Hkv, G, Sq, Sk]``."""
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    b, h, sq, sk = mask.shape
    if h == 1:
        return mask.unsqueeze(2)  # [B, 1, 1, Sq, Sk]
    if h != hkv * groups:
        raise ValueError(f"mask: head dimension must be 1 or {hkv * groups}, got {h}")
    return mask.reshape(b, hkv, groups, sq, sk)
