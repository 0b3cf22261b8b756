"""One attention call per layer for every decoding sequence of a packed step.

A decode row is one new token of a seated sequence (``kvtier.runtime.seats``) whose KV is
all on the device: its resident chunks (a slot range of its row of the slab's pools) and
its tail. ``DecodeBatch.collect`` picks those rows out of a step's passes once, before the
layer loop, and precomputes what every layer shares: the seat and tail position of each
row, the key masks of the resident slots and of the tails, and a query buffer. Per layer,
``attend`` then

1. stores every row's new K/V in its tail with one indexed write (the slab's tails),
2. attends the folded queries of all seats ``0 .. max seat`` to the pools' slots
   ``0 .. max slot`` and to the tails, one fused kernel call each, with the masks,
3. merges the two results exactly and writes each row's output into the step's output.

No Python in the layer loop grows with the number of rows. Seats between the decoding ones
(idle, or prefilling in the same step) are computed and discarded. Rows that do not
qualify (a prefill piece, streamed or padded KV, a sliding layer, no seat) keep the
per-sequence path (``SequenceKV.write`` and ``attend_packed``).

Mutates the rows' tails (the slab) and their passes' written-layer count; owns its masks
and query buffer. Built and used by the thread running the step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kvtier.attention import SegmentResult, attend_flat, merge
from kvtier.runtime.seats import SeatSlab
from kvtier.runtime.sequence import SequenceKV


class DecodeBatch:
    """The decode rows of one packed step (see the module docstring).

    Args:
        slab: the seats' storage every row lives in.
        kvs: the rows' sequences, their passes begun.
        rows: each row's index in the packed step.
    """

    def __init__(self, slab: SeatSlab, kvs: Sequence[SequenceKV], rows: Sequence[int]) -> None:
        self.slab = slab
        self.kvs = list(kvs)
        size = slab.layout.chunk_tokens
        seats, tails, slot_ranges = [], [], []
        for kv in self.kvs:
            plan = kv.plan
            assert plan is not None and kv.arena.seat is not None
            seats.append(kv.arena.seat[1])
            tails.append(plan.tail_before)
            slot_ranges.append(plan.resident[0].slots)
        device = slab.device
        self.num_layers = slab.layout.num_layers
        self.span = max(seats) + 1  # seats 0 .. span-1 are attended
        self.seat_idx = torch.tensor(seats, dtype=torch.long, device=device)
        self.tail_pos = torch.tensor(tails, dtype=torch.long, device=device)
        self.rows = torch.tensor(list(rows), dtype=torch.long, device=device)
        self.tail_tokens = max(tails) + 1
        self.resident_slots = max((s.stop for s in slot_ranges), default=0)
        # Dense: rows 0..R-1 of the step are seats 0..R-1, so no gather or scatter is needed.
        self.dense = seats == list(range(len(seats))) and list(rows) == list(range(len(seats)))
        self.same_tail = len(set(tails)) == 1  # one tail position: a slice, no index
        # Additive masks [span, 1, 1, K]: 0 where a seat's row may see the key, -inf else;
        # None where every row sees every key (dense, same tail / same slot range).
        lo = torch.zeros(self.span, dtype=torch.long)
        hi = torch.zeros(self.span, dtype=torch.long)
        last = torch.full((self.span,), -1, dtype=torch.long)
        for seat, tail, slots in zip(seats, tails, slot_ranges, strict=True):
            lo[seat], hi[seat], last[seat] = slots.start * size, slots.stop * size, tail
        keys = torch.arange(self.resident_slots * size)
        self.resident_mask: torch.Tensor | None = None
        self.resident_seen: torch.Tensor | None = None
        if not (self.dense and all(s == slice(0, self.resident_slots) for s in slot_ranges)):
            visible = (keys >= lo[:, None]) & (keys < hi[:, None])
            self.resident_mask = _additive(visible, device)
            self.resident_seen = (hi > lo).to(device)[:, None, None]  # [span, 1, 1]
        self.tail_mask: torch.Tensor | None = None
        if not (self.dense and self.same_tail):
            self.tail_mask = _additive(torch.arange(self.tail_tokens) <= last[:, None], device)
        # Every decoding seat sees its new token; idle seats' rows are discarded anyway.
        self.tail_seen = torch.ones(1, 1, 1, dtype=torch.bool, device=device)
        _, _, heads, _, dim = slab.layout.chunk_shape
        self.kv_heads, self.head_dim = heads, dim
        self.query: torch.Tensor | None = None  # [span, Hkv, G, D], sized at the first layer

    @classmethod
    def collect(
        cls, kvs: Sequence[SequenceKV], spans: Sequence[tuple[int, int]]
    ) -> tuple[DecodeBatch | None, list[int]]:
        """Split a step's passes: (the decode batch, or None; indices of the other spans)."""
        chosen: list[int] = []
        rest: list[int] = []
        slab: SeatSlab | None = None
        for i, ((_, length), kv) in enumerate(zip(spans, kvs, strict=True)):
            seat = kv.arena.seat
            if (
                length == 1
                and seat is not None
                and (slab is None or seat[0] is slab)
                and _all_resident(kv)
            ):
                slab = seat[0]
                chosen.append(i)
            else:
                rest.append(i)
        if slab is None or not chosen:
            return None, rest
        batch = cls(slab, [kvs[i] for i in chosen], [spans[i][0] for i in chosen])
        return batch, rest

    def attend(
        self,
        layer_idx: int,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        """Store the rows' new K/V of one layer and write their attention into ``out``.

        Args:
            layer_idx: the layer.
            query: ``[1, Hq, N, D]`` the step's queries (all packed tokens).
            keys: ``[1, Hkv, N, D]`` the step's new keys.
            values: same shape.
            scale: softmax scale.
            out: ``[1, N, Hq, D]`` the step's attention output; the rows' entries are set.
        """
        hkv, dim = self.kv_heads, self.head_dim
        hq = query.shape[1]
        tails = self.slab.tails
        dtype = tails.dtype
        span, t = self.span, self.tail_tokens
        if self.dense:  # rows 0..R-1 are seats 0..R-1
            new_k, new_v = keys[0, :, :span].transpose(0, 1), values[0, :, :span].transpose(0, 1)
            q_rows = query[0, :, :span]
        else:
            new_k, new_v = (
                keys[0, :, self.rows].transpose(0, 1),
                values[0, :, self.rows].transpose(0, 1),
            )
            q_rows = query[0, :, self.rows]
        tail_k, tail_v = tails[:, layer_idx, 0], tails[:, layer_idx, 1]  # [seats, H, T, D]
        if self.dense and self.same_tail:
            tail_k[:span, :, t - 1] = new_k.to(dtype)  # [R, Hkv, D]
            tail_v[:span, :, t - 1] = new_v.to(dtype)
        else:
            tail_k[self.seat_idx, :, self.tail_pos] = new_k.to(dtype)
            tail_v[self.seat_idx, :, self.tail_pos] = new_v.to(dtype)
        folded = q_rows.transpose(0, 1).reshape(-1, hkv, hq // hkv, dim).to(torch.float32)
        if self.dense:
            q = folded  # [R, Hkv, G, D]
        else:
            if self.query is None:
                self.query = torch.zeros(
                    span, hkv, hq // hkv, dim, dtype=torch.float32, device=query.device
                )
            q = self.query
            q.index_copy_(0, self.seat_idx, folded)
        tail = SegmentResult(
            *attend_flat(
                q,
                tail_k[:span, :, :t].to(torch.float32),
                tail_v[:span, :, :t].to(torch.float32),
                self.tail_mask,
                scale,
                seen=self.tail_seen if self.tail_mask is not None else None,
            )
        )
        result = tail
        if self.resident_slots > 1 and span == 1:
            result = self._split_one(layer_idx, q, tail, scale)
        elif self.resident_slots:
            pools = self.slab.pools
            n = self.resident_slots
            res_k = pools[:span, layer_idx, 0, :, :n].reshape(span, hkv, -1, dim)
            res_v = pools[:span, layer_idx, 1, :, :n].reshape(span, hkv, -1, dim)
            resident = SegmentResult(
                *attend_flat(
                    q,
                    res_k.to(torch.float32),
                    res_v.to(torch.float32),
                    self.resident_mask,
                    scale,
                    seen=self.resident_seen,
                )
            )
            result = merge([resident, tail])
        if self.dense:
            out[0, :span] = result.out.reshape(span, hq, dim)
        else:
            rows_out = result.out[self.seat_idx].reshape(-1, hq, dim)  # [R, Hq, D]
            out[0].index_copy_(0, self.rows, rows_out.to(out.dtype))
        for kv in self.kvs:
            assert kv.plan is not None
            kv.plan.layers_written = layer_idx + 1


    def _split_one(
        self, layer_idx: int, q: torch.Tensor, tail: SegmentResult, scale: float
    ) -> SegmentResult:
        """One seat: its resident chunks attended as one batch of chunk-long parts (the
        kernel splits work by batch and head, so one row of ``Hkv`` heads would keep a
        2-core CPU half idle), then every part and the tail merged exactly."""
        pools = self.slab.pools
        n, size = self.resident_slots, self.slab.layout.chunk_tokens
        res_k = pools[0, layer_idx, 0, :, :n].transpose(0, 1)  # [n, Hkv, T, D]
        res_v = pools[0, layer_idx, 1, :, :n].transpose(0, 1)
        mask = seen = None
        if self.resident_mask is not None:
            mask = self.resident_mask.view(n, size)[:, None, None]  # [n, 1, 1, T]
            seen = torch.isfinite(mask).any(dim=-1)  # [n, 1, 1]
        out, lse = attend_flat(
            q.expand(n, -1, -1, -1),
            res_k.to(torch.float32),
            res_v.to(torch.float32),
            mask,
            scale,
            seen=seen,
        )
        lses = torch.cat([lse, tail.lse])  # [n + 1, Hkv, G]
        total = torch.logsumexp(lses, dim=0, keepdim=True)
        weights = torch.exp(lses - total).nan_to_num_(0.0).unsqueeze(-1)
        merged = (torch.cat([out, tail.out]) * weights).sum(dim=0, keepdim=True)
        return SegmentResult(merged, total)


def _all_resident(kv: SequenceKV) -> bool:
    """The pass reads only resident chunks and its tail, unpadded, in one full group."""
    plan = kv.plan
    if plan is None or plan.pieces or plan.recent_valid is not None or len(plan.resident) != 1:
        return False
    return plan.resident[0].valid is None and kv.windows[0] is None


def _additive(visible: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``visible [span, K]`` → an additive mask ``[span, 1, 1, K]`` (0 / -inf), float32."""
    mask = torch.zeros(visible.shape, dtype=torch.float32)
    mask.masked_fill_(~visible, -math.inf)
    return mask[:, None, None].to(device)
