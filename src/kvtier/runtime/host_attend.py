"""Attention over chunks that lie in the host pool, computed where they lie.

``on_host`` ships the query to the host and brings back output and log-sum-exp (DESIGN §4:
"attend to it on the CPU where it lies"); ``attend_sealed`` attends sealed chunks shared by
a batch, wherever they are. ``kvtier.runtime.dispatch`` merges the results with the other
segments'. Both only read the pool and the views; they mutate no cache state.
"""

from __future__ import annotations

import time

import torch

from kvtier import native
from kvtier.attention import SegmentResult, attend_segment
from kvtier.runtime.view import Hosted


def on_host(
    hosted: Hosted,
    query: torch.Tensor,
    scale: float,
    softcap: float | None,
    mask: torch.Tensor | None = None,
) -> SegmentResult:
    """``query [B, Hq, Sq, D]`` over the chunks attended in the host pool, computed where
    they lie: the query goes to the host, the output and log-sum-exp come back. The wall
    seconds (transfers included) go to ``hosted.spent``."""
    start = time.perf_counter()
    result = _host_attention(hosted, query, scale, softcap, mask)
    if hosted.spent is not None:
        hosted.spent(time.perf_counter() - start)
    return result


def _host_attention(
    hosted: Hosted,
    query: torch.Tensor,
    scale: float,
    softcap: float | None,
    mask: torch.Tensor | None,
) -> SegmentResult:
    """``on_host``'s work. A few unmasked queries of one sequence on a float32 or bf16 CPU pool
    take kvtier's ``attend_slots`` kernel, which reads the pinned slots in place; the rest,
    and soft-capped layers (the kernel has no cap), gather the slots (a copy in host
    memory) and take ``attend_segment``."""
    pool = hosted.host.pool
    host = pool.device
    ops = native.kv_ops(pool)
    sq = query.shape[2]
    if (
        ops is not None
        and query.dtype == torch.float32
        and mask is None
        and softcap is None
        and hosted.valid is None
        and query.shape[0] == 1
        and sq <= HOST_KERNEL_MAX_QUERIES
        and not hosted.host.layer_major
        and pool.is_contiguous()
    ):
        q = query[0].to(host, torch.float32)  # [Hq, Sq, D]
        out = torch.empty(sq, q.shape[0], q.shape[2])
        lse = torch.empty(sq, q.shape[0])
        ops.attend_slots(pool, hosted.layer_idx, hosted.slot_index, q, out, lse, scale)
        device = query.device
        return SegmentResult(out.transpose(0, 1)[None].to(device), lse.t()[None].to(device))
    keys, values = hosted.gathered()
    result = attend_sealed(
        query.to(host),
        keys,
        values,
        scale,
        hosted.valid,
        None if mask is None else mask.to(host),
        softcap,
    )
    return SegmentResult(result.out.to(query.device), result.lse.to(query.device))


HOST_KERNEL_MAX_QUERIES = 16
"""Most queries ``attend_slots`` takes (it reads the chunks once per query)."""


def attend_sealed(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    valid: torch.Tensor | None,
    mask: torch.Tensor | None = None,
    softcap: float | None = None,
) -> SegmentResult:
    """``query [B, Hq, Sq, D]`` over sealed chunks ``[H, n*T, D]`` shared by the batch
    (broadcast, not copied); ``valid [B, n*T]`` masks padding and other rows' tokens;
    ``softcap`` caps the scores (None: no cap)."""
    batch = query.shape[0]
    k = keys.unsqueeze(0).expand(batch, *keys.shape)
    v = values.unsqueeze(0).expand(batch, *values.shape)
    return attend_segment(query, k, v, scale, valid_mask=valid, mask=mask, softcap=softcap)
