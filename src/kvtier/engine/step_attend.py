"""One layer's attention over a step's packed spans, for kvtier's own forward.

``attend_layer`` writes each prefill span's new K/V into its sequence (``SequenceKV.write``)
and attends it over that sequence's KV (``kvtier.runtime.attend_packed``), and attends the
step's seated decode rows in one call (``kvtier.runtime.DecodeBatch``). With no sequence KV
(a throw-away forward, e.g. the engine's warm-up) each span attends causally to itself only.

Mutates the sequences' KV (the pass each has begun) and nothing else; one caller at a time
(the engine's worker thread).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from kvtier.runtime import DecodeBatch, PackedKV, SequenceKV, attend_packed


def attend_layer(
    layer_idx: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kvs: Sequence[SequenceKV] | None,
    spans: Sequence[tuple[int, int]],
    batch: DecodeBatch | None,
    rest: Sequence[int],
    scale: float,
    low: torch.dtype | None = None,
) -> torch.Tensor:
    """Every span's attention, ``[1, N, Hq, D]`` (a new tensor), from ``q [1, Hq, N, D]``
    and ``k``/``v [1, Hkv, N, D]`` (views are fine): the decode rows of ``batch`` in one
    call, the spans ``rest`` (indices into ``spans``) each over its own KV; ``kvs`` None:
    each span causally over its own tokens. ``low``: long prefill passes' attention
    operands' dtype (``kvtier.runtime.attend_packed``); None: float32."""
    if kvs is None:
        out = torch.empty(1, q.shape[2], q.shape[1], q.shape[3], dtype=q.dtype)
        for start, length in spans:
            part = F.scaled_dot_product_attention(
                q[:, :, start : start + length],
                k[:, :, start : start + length],
                v[:, :, start : start + length],
                is_causal=True,
                scale=scale,
                enable_gqa=True,
            )
            out[:, start : start + length] = part.transpose(1, 2)
        return out
    out = q.new_empty(1, q.shape[2], q.shape[1], q.shape[3])
    if batch is not None:
        batch.attend(layer_idx, q, k, v, scale, out)
    if rest:
        views = []
        for i in rest:
            s, m = spans[i]
            views.append(kvs[i].write(layer_idx, k[:, :, s : s + m], v[:, :, s : s + m]))
        view = PackedKV(layer_idx, views, [spans[i] for i in rest])
        attend_packed(view, q, scale, out, low=low)
    return out
