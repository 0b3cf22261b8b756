"""One attention call per layer for every decoding sequence of a packed step.

A decode row is one new token of a seated sequence (``kvtier.runtime.seats``) whose KV is
all on the device: its tail and its resident chunks, which lie end to end in its row of
the slab (slot 0, then the pool's slots). ``DecodeBatch.collect`` picks those rows out of
a step's passes once, before the layer loop, and precomputes what every layer shares: the
seat, tail position and resident slot range of each row. Per layer, ``attend`` makes one
call:

- on a float32 or bf16 CPU slab with kvtier's CPU kernels (``kvtier.native``),
  ``kvtier_cpu::decode_attend``: it stores every row's new K/V in its tail, attends each
  row to its own tail tokens and resident slots only (no mask, no other seat read) and
  writes the rows' outputs;
- otherwise torch's ops: one indexed write of the new K/V, then torch's fused kernel over
  the folded queries of all seats ``0 .. max seat`` with one key mask over slots ``0 .. n``
  (the tail's unfilled end and the slots a seat does not use are masked; seats between the
  decoding ones are computed and discarded), then the rows' outputs written back. (One
  seat's chunks split into a batch of parts and merged measured slower in the engine, at a
  4K context, than this one call.)

A row whose older chunks are attended in the host pool (``Decision.HOST``) or streamed
into its staging ring (``Decision.STREAM``) also takes the kernel: ``decode_attend`` then
returns every row's log-sum-exp, and each such row's other part (``attend_slots``
reading the host pool in place; torch's kernel over the staged pieces of the layer, as
they arrive) merges into its output exactly.

No Python in the layer loop grows with the number of rows, except one merge per hosted
or streamed row. Rows that do not qualify (a prefill piece, streamed or padded KV, a sliding layer,
no seat) keep the per-sequence path (``SequenceKV.write`` and ``attend_packed``).

Mutates the rows' tails (the slab) and, at the last layer, their passes' written-layer
count; owns its index tensors, mask and query buffer. Built and used by the thread running
the step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import torch

from kvtier import native
from kvtier.attention import attend_flat
from kvtier.runtime.seats import SeatSlab
from kvtier.runtime.sequence import SequenceKV


class DecodeBatch:
    """The decode rows of one packed step (see the module docstring).

    Args:
        slab: the seats' storage every row lives in.
        kvs: the rows' sequences, their passes begun.
        rows: each row's index in the packed step.
        dtype: the step's queries' dtype (the kernels take float32 queries only).
    """

    def __init__(
        self,
        slab: SeatSlab,
        kvs: Sequence[SequenceKV],
        rows: Sequence[int],
        dtype: torch.dtype = torch.float32,
    ) -> None:
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
        self.span = max(seats) + 1  # seats 0 .. span-1 are attended
        self.last_layer = slab.layout.num_layers - 1
        self.seat_idx = torch.tensor(seats, dtype=torch.long, device=device)
        self.tail_pos = torch.tensor(tails, dtype=torch.long, device=device)
        self.rows = torch.tensor(list(rows), dtype=torch.long, device=device)
        self.slots = max((s.stop for s in slot_ranges), default=0)  # pool slots read
        # Dense: rows 0..R-1 of the step are seats 0..R-1, so no gather or scatter is needed.
        self.dense = seats == list(range(len(seats))) and list(rows) == list(range(len(seats)))
        # One tail position for every row: a slice, no index.
        self.same_tail: int | None = tails[0] if len(set(tails)) == 1 else None
        _, _, heads, _, dim = slab.layout.chunk_shape
        self.kv_heads, self.head_dim = heads, dim
        self.query: torch.Tensor | None = None  # [span, Hkv, G, D], sized at the first layer
        data = slab.data
        self.ops = native.kv_ops(data) if dtype == torch.float32 else None
        # Rows with chunks attended in the host pool (native path only, see ``collect``):
        # (its step row, its hosted slots, its sequence).
        self.hosted = [
            (int(rows[i]), kv.plan.hosted_index[0], kv)
            for i, kv in enumerate(self.kvs)
            if kv.plan is not None and kv.plan.hosted and kv.plan.hosted[0]
        ]
        # Rows with chunks streamed into their staging rings (native path only).
        self.streamed = [
            (int(rows[i]), kv) for i, kv in enumerate(self.kvs) if kv.plan and kv.plan.pieces
        ]
        if self.ops is not None:  # the kernel reads each row's own keys: no mask
            self.lo = torch.tensor([(1 + r.start) * size for r in slot_ranges], dtype=torch.long)
            self.hi = torch.tensor([(1 + r.stop) * size for r in slot_ranges], dtype=torch.long)
            return
        assert not self.hosted and not self.streamed, "such rows take the native path only"
        # Keys of a seat's row: tail tokens 0..T-1, then pool slot j at (1 + j) T.
        last = torch.full((self.span,), -1, dtype=torch.long)  # idle seats see nothing
        lo = torch.zeros(self.span, dtype=torch.long)
        hi = torch.zeros(self.span, dtype=torch.long)
        for seat, tail, slots in zip(seats, tails, slot_ranges, strict=True):
            last[seat] = tail
            lo[seat], hi[seat] = (1 + slots.start) * size, (1 + slots.stop) * size
        keys = torch.arange((1 + self.slots) * size)
        visible = (keys <= last[:, None]) | ((keys >= lo[:, None]) & (keys < hi[:, None]))
        self.mask = _additive(visible, device)  # [span, 1, 1, (1 + n) T]
        # Every decoding seat sees its new token; idle seats' rows are discarded anyway.
        self.seen = torch.ones(1, 1, 1, dtype=torch.bool, device=device)

    @classmethod
    def collect(
        cls,
        kvs: Sequence[SequenceKV],
        spans: Sequence[tuple[int, int]],
        dtype: torch.dtype = torch.float32,
    ) -> tuple[DecodeBatch | None, list[int]]:
        """Split a step's passes: (the decode batch, or None; indices of the other spans).
        ``dtype``: the step's queries' dtype."""
        chosen: list[int] = []
        rest: list[int] = []
        slab: SeatSlab | None = None
        native_path = (
            native.ops() is not None
            and dtype == torch.float32
            and all(
                kv.arena.seat is None or native.kv_ops(kv.arena.seat[0].data) is not None
                for kv in kvs
            )
        )
        for i, ((_, length), kv) in enumerate(zip(spans, kvs, strict=True)):
            seat = kv.arena.seat
            if (
                length == 1
                and seat is not None
                and (slab is None or seat[0] is slab)
                and _on_device_or_host(kv, native_path)
            ):
                slab = seat[0]
                chosen.append(i)
            else:
                rest.append(i)
        if slab is None or not chosen:
            return None, rest
        batch = cls(slab, [kvs[i] for i in chosen], [spans[i][0] for i in chosen], dtype)
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
        if self.ops is not None:
            lse = None
            if self.hosted or self.streamed:
                lse = torch.empty(out.shape[1], out.shape[2], dtype=torch.float32)
            self.ops.decode_attend(
                self.slab.data,
                layer_idx,
                self.seat_idx,
                self.tail_pos,
                self.lo,
                self.hi,
                self.rows,
                query[0],
                keys[0],
                values[0],
                out[0],
                lse,
                scale,
            )
            if lse is not None:
                self._merge_hosted(layer_idx, query, scale, out, lse)
                self._merge_streamed(layer_idx, query, scale, out, lse)
            self._finish(layer_idx)
            return
        hkv, dim = self.kv_heads, self.head_dim
        hq = query.shape[1]
        span = self.span
        if self.dense:  # rows 0..R-1 are seats 0..R-1
            new_k, new_v = keys[0, :, :span], values[0, :, :span]  # [Hkv, R, D]
            q_rows = query[0, :, :span]
        else:
            new_k, new_v = keys[0, :, self.rows], values[0, :, self.rows]
            q_rows = query[0, :, self.rows]
        tail_k, tail_v = self.slab.tails(layer_idx)  # [seats, H, T, D]
        dtype = tail_k.dtype
        if self.dense and self.same_tail is not None:
            pos = self.same_tail
            tail_k[:span, :, pos] = new_k.transpose(0, 1).to(dtype)  # [R, Hkv, D]
            tail_v[:span, :, pos] = new_v.transpose(0, 1).to(dtype)
        else:
            tail_k[self.seat_idx, :, self.tail_pos] = new_k.transpose(0, 1).to(dtype)
            tail_v[self.seat_idx, :, self.tail_pos] = new_v.transpose(0, 1).to(dtype)
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
        k, v = self.slab.kv(layer_idx, span, self.slots)
        result, _ = attend_flat(
            q, k.to(torch.float32), v.to(torch.float32), self.mask, scale, seen=self.seen
        )
        if self.dense:
            out[0, :span] = result.reshape(span, hq, dim)
        else:
            rows_out = result[self.seat_idx].reshape(-1, hq, dim)  # [R, Hq, D]
            out[0].index_copy_(0, self.rows, rows_out.to(out.dtype))
        self._finish(layer_idx)

    def _merge_hosted(
        self,
        layer_idx: int,
        query: torch.Tensor,
        scale: float,
        out: torch.Tensor,
        lse: torch.Tensor,
    ) -> None:
        """Attend each hosted row's chunks in the host pool (``attend_slots``, in place)
        and merge them exactly into its output (both with their log-sum-exp)."""
        assert self.ops is not None
        for row, slots, kv in self.hosted:
            start = time.perf_counter()
            q = query[0, :, row : row + 1]  # [Hq, 1, D]
            host_out = torch.empty(1, q.shape[0], q.shape[2])
            host_lse = torch.empty(1, q.shape[0])
            self.ops.attend_slots(kv.host.pool, layer_idx, slots, q, host_out, host_lse, scale)
            _merge_row(out, lse, row, host_out.to(out.device), host_lse.to(out.device))
            kv.ledger.host_spent(time.perf_counter() - start)

    def _merge_streamed(
        self,
        layer_idx: int,
        query: torch.Tensor,
        scale: float,
        out: torch.Tensor,
        lse: torch.Tensor,
    ) -> None:
        """Attend each streamed row's pieces of this layer as they arrive in its staging
        ring, and merge them exactly into its output."""
        hkv, dim = self.kv_heads, self.head_dim
        for row, kv in self.streamed:
            plan, staging = kv.plan, kv.staging
            assert plan is not None and staging is not None
            q = query[0, :, row].reshape(1, hkv, -1, dim).to(torch.float32)  # [1, Hkv, G, D]
            for index in plan.pieces_by_layer[layer_idx]:
                keys, values = staging.acquire(index)  # [H, n*T, D]
                part, part_lse = attend_flat(
                    q, keys[None].to(torch.float32), values[None].to(torch.float32), None, scale
                )
                staging.release(index)
                _merge_row(out, lse, row, part.reshape(1, -1, dim), part_lse.reshape(1, -1))

    @property
    def native_only(self) -> bool:
        """Every row takes ``decode_attend`` alone (no hosted or streamed part to merge)."""
        return self.ops is not None and not self.hosted and not self.streamed

    def done(self) -> None:
        """Record the passes complete after a caller ran every layer's ``decode_attend``
        itself (``kvtier_cpu::decode_layers``)."""
        self._finish(self.last_layer)

    def _finish(self, layer_idx: int) -> None:
        if layer_idx == self.last_layer:  # the passes are complete (end_forward checks)
            for kv in self.kvs:
                assert kv.plan is not None
                kv.plan.layers_written = layer_idx + 1


def _merge_row(
    out: torch.Tensor, lse: torch.Tensor, row: int, part: torch.Tensor, part_lse: torch.Tensor
) -> None:
    """Merge attention ``part [1, Hq, D]`` (log-sum-exp ``part_lse [1, Hq]``) over other
    keys into step row ``row`` of ``out [1, N, Hq, D]`` and ``lse [N, Hq]``, exactly."""
    mine = lse[row : row + 1]
    top = torch.maximum(mine, part_lse)
    w_mine = torch.exp(mine - top)
    w_part = torch.exp(part_lse - top)
    total = w_mine + w_part
    mixed = (w_mine[..., None] * out[0, row : row + 1] + w_part[..., None] * part) / total[
        ..., None
    ]
    out[0, row : row + 1] = mixed
    lse[row : row + 1] = top + torch.log(total)


def _on_device_or_host(kv: SequenceKV, native_path: bool) -> bool:
    """The pass reads only resident chunks and its tail, unpadded, in one full group; on
    the native path also chunks streamed into its ring (all visible) and chunks attended
    in a slot-major float32 or bf16 CPU host pool (all visible)."""
    plan = kv.plan
    if plan is None or plan.recent_valid is not None or len(plan.resident) != 1:
        return False
    if plan.resident[0].valid is not None or kv.windows[0] is not None:
        return False
    if plan.pieces and not (native_path and all(v is None for v in plan.piece_valid.values())):
        return False
    if not any(plan.hosted):
        return True
    pool = kv.host.pool
    return (
        native_path
        and len(plan.hosted) == 1
        and plan.hosted_valid[0] is None
        and native.kv_ops(pool) is not None
        and not kv.host.layer_major
        and pool.is_contiguous()
    )


def _additive(visible: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``visible [span, K]`` → an additive mask ``[span, 1, 1, K]`` (0 / -inf), float32."""
    mask = torch.zeros(visible.shape, dtype=torch.float32)
    mask.masked_fill_(~visible, -math.inf)
    return mask[:, None, None].to(device)
