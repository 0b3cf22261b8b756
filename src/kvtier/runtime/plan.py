"""The plan of one forward pass: per layer group, what is resident and what streams.

``plan_forward`` finds every sealed chunk a pass needs where it lies — in the group's
device pool (resident: the arena's residency index says so, nothing to pin) or in host
(pinned, streamed over the device⇄host link; disk chunks promoted first) — and
precomputes what every layer's attention reads: the contiguous slot range of the resident
chunks with their padding mask, the streamed pieces with theirs, and the recent tokens'
mask. ``release`` unpins the host chunks.

Per chunk range the plan records a ``Decision``: resident, streamed, or attended in the
host pool where it lies (the query goes to the host, the output and its log-sum-exp come
back and merge exactly; nothing crosses the link), as many per group as ``hosted_count``
says (``kvtier.runtime.cost``: none, all, or the cost model's choice). The dispatch of
``kvtier.runtime.dispatch`` reads the decisions through the per-layer views.

A plan is built and released by the thread running the pass; attention only reads it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

import torch

from kvtier.kv.chunk import ChunkRef
from kvtier.manager import KVManager
from kvtier.runtime.arena import DeviceArena
from kvtier.runtime.staging import Piece, StagingRing, cut_pieces
from kvtier.runtime.state import SequenceState
from kvtier.runtime.view import Hosted
from kvtier.tiers.base import ChunkLostError
from kvtier.tiers.pool import PoolTier


class Decision(Enum):
    """Where a chunk range's attention reads its KV."""

    RESIDENT = "resident"  # the group's device pool
    STREAM = "stream"  # host -> staging ring, layer by layer
    HOST = "host"  # attended in the host pool, where it lies


@dataclass(frozen=True)
class ChunkRange:
    """Chunks ``[start, stop)`` of ``row`` for the layers of group ``group``."""

    group: int
    row: int
    start: int
    stop: int
    decision: Decision


@dataclass
class Resident:
    """One group's resident chunks for a pass.

    Attributes:
        positions: ``(row, chunk index)`` of each resident chunk the pass reads.
        pool_slots: the slot of each of them in the group's pool.
        slots: the pool slots attention reads (one contiguous range).
        chunks: the chunk index in each of those slots (-1: a slot this pass does not use).
        valid: ``[B, n*T]`` which of those keys each row may see; None: all.
    """

    positions: list[tuple[int, int]] = field(default_factory=list)
    pool_slots: list[int] = field(default_factory=list)
    slots: slice = field(default_factory=lambda: slice(0, 0))
    chunks: list[int] = field(default_factory=list)
    valid: torch.Tensor | None = None


@dataclass
class ForwardPlan:
    """One forward pass over a batch (see the module docstring)."""

    sealed_before: int
    tail_before: int
    new_tokens: int
    query_start: int  # absolute position of the first new token
    resident: list[Resident] = field(default_factory=list)  # by group
    pieces: list[Piece] = field(default_factory=list)
    pieces_by_layer: list[list[int]] = field(default_factory=list)
    piece_valid: dict[int, torch.Tensor | None] = field(default_factory=dict)  # [B, n*T]
    host_pins: list[ChunkRef] = field(default_factory=list)
    hosted: list[list[tuple[int, int, int]]] = field(default_factory=list)  # by group:
    # (host slot, row, chunk) of the chunks attended in the host pool
    hosted_valid: list[torch.Tensor | None] = field(default_factory=list)  # by group [B, n*T]
    hosted_index: list[torch.Tensor] = field(default_factory=list)  # by group: slots [n]
    recent_valid: torch.Tensor | None = None  # [B, tail_before + new]; None: all real
    ranges: list[ChunkRange] = field(default_factory=list)
    layers_written: int = 0
    token_ids: torch.Tensor | None = None  # [B, seq_len + N]: committed when the pass ends
    valid: torch.Tensor | None = None  # [B, seq_len + N]


def plan_forward(
    state: SequenceState,
    valid: torch.Tensor,
    arena: DeviceArena,
    host: PoolTier,
    manager: KVManager,
    staging: StagingRing,
    new_tokens: int,
    hosted_count: Callable[[int, int], int] | None = None,
) -> ForwardPlan:
    """Pin what a pass over ``new_tokens`` needs and plan its reads; ``valid`` is the
    padding of every token with the new ones (``state.extended``); ``hosted_count(group,
    n)``: how many of a group's ``n`` non-resident chunks (the oldest) are attended in the
    host pool instead of streamed (None: none; ``kvtier.runtime.cost``). Mutates pins only.

    Raises:
        ChunkLostError: a needed chunk is in no tier; nothing is left pinned.
    """
    size = arena.layout.chunk_tokens
    query_start = state.seq_len
    plan = ForwardPlan(state.sealed_chunks, state.tail_len, new_tokens, query_start)
    streamed_by_group = _pin(plan, state, arena, host, manager, query_start)
    if hosted_count is not None:
        hosted_keys: set[tuple[int, int, int]] = set()  # (group, row, chunk)
        for g, todo in enumerate(streamed_by_group):
            k = min(max(hosted_count(g, len(todo)), 0), len(todo))
            plan.hosted.append(todo[:k])
            plan.hosted_index.append(torch.tensor([s for s, _, _ in todo[:k]], dtype=torch.long))
            streamed_by_group[g] = todo[k:]
            hosted_keys.update((g, row, chunk) for _, row, chunk in todo[:k])
            mask = torch.zeros(state.rows, k, size, dtype=torch.bool)
            for j, (_, row, chunk) in enumerate(todo[:k]):
                mask[row, j] = valid[row, chunk * size : (chunk + 1) * size]
            plan.hosted_valid.append(_flat_mask(mask, host.device))
        if hosted_keys:
            plan.ranges = _mark_hosted(plan.ranges, hosted_keys)
    device = arena.device
    rows = state.rows
    for resident in plan.resident:
        slots = resident.pool_slots
        lo = min(slots, default=0)
        hi = max((s + 1 for s in slots), default=0)
        # Attention reads one contiguous range of slots; slots in it that this pass does
        # not use stay masked out.
        mask = torch.zeros(rows, hi - lo, size, dtype=torch.bool)
        resident.chunks = [-1] * (hi - lo)
        for slot, (row, chunk) in zip(slots, resident.positions, strict=True):
            mask[row, slot - lo] = valid[row, chunk * size : (chunk + 1) * size]
            resident.chunks[slot - lo] = chunk
        resident.slots = slice(lo, hi)
        resident.valid = _flat_mask(mask, device)
    by_layer: list[list[tuple[int, int, int]]] = [[] for _ in range(arena.layout.num_layers)]
    for g, group in enumerate(arena.groups):
        for layer in group.layers:
            by_layer[layer] = streamed_by_group[g]
    plan.pieces = cut_pieces(by_layer, staging.piece_chunks)
    plan.pieces_by_layer = [[] for _ in range(arena.layout.num_layers)]
    masks: dict[tuple[tuple[int, ...], tuple[int, ...]], torch.Tensor | None] = {}
    for index, piece in enumerate(plan.pieces):
        plan.pieces_by_layer[piece.layer_idx].append(index)
        key = (piece.rows, piece.chunk_idx)  # layers share most pieces' chunks
        if key not in masks:
            mask = torch.zeros(rows, len(piece.host_slots), size, dtype=torch.bool)
            for j, (row, chunk) in enumerate(zip(*key, strict=True)):
                mask[row, j] = valid[row, chunk * size : (chunk + 1) * size]
            masks[key] = _flat_mask(mask, device)
        plan.piece_valid[index] = masks[key]
    recent = valid[:, plan.sealed_before * size :]
    plan.recent_valid = None if bool(recent.all()) else recent.to(device)
    return plan


def _pin(
    plan: ForwardPlan,
    state: SequenceState,
    arena: DeviceArena,
    host: PoolTier,
    manager: KVManager,
    query_start: int,
) -> list[list[tuple[int, int, int]]]:
    """Find every needed sealed chunk in its group's pool (the arena's residency index:
    nothing to pin) or pin it in host; returns per group the streamed ones as
    ``(host slot, row, chunk)``.

    A sliding group needs no chunk before the window of the pass's first query.
    """
    size = arena.layout.chunk_tokens
    streamed: list[list[tuple[int, int]]] = []
    for g, group in enumerate(arena.groups):
        first = group.first_chunk(query_start, size)
        resident = Resident()
        todo: list[tuple[int, int]] = []
        for row, row_refs in enumerate(state.refs):
            for chunk in range(first, len(row_refs)):
                slot = arena.slot_of(g, row_refs[chunk])
                if slot is not None:
                    resident.positions.append((row, chunk))
                    resident.pool_slots.append(slot)
                    decision = Decision.RESIDENT
                else:
                    todo.append((row, chunk))
                    decision = Decision.STREAM
                _extend(plan.ranges, ChunkRange(g, row, chunk, chunk + 1, decision))
        plan.resident.append(resident)
        streamed.append(todo)
    needed = sorted({rc for todo in streamed for rc in todo})
    missing = [state.refs[r][c] for r, c in needed if not host.contains(state.refs[r][c])]
    outcomes = dict(zip(missing, manager.promote(missing), strict=True))
    host_slot: dict[tuple[int, int], int] = {}
    lost: dict[int, tuple[int, str]] = {}  # row -> (first chunk lost, cause)
    for row, chunk in needed:
        ref = state.refs[row][chunk]
        if row in lost or not host.pin([ref])[0]:
            if row not in lost:
                lost[row] = (chunk, "corrupt" if outcomes.get(ref) == "corrupt" else "missing")
            continue
        plan.host_pins.append(ref)
        slot = host.slot_of(ref)
        assert slot is not None
        host_slot[(row, chunk)] = slot
    if lost:
        release(plan, host)
        _raise_lost(state, manager, host, outcomes, lost)
    return [[(host_slot[(r, c)], r, c) for r, c in todo] for todo in streamed]


def _extend(ranges: list[ChunkRange], item: ChunkRange) -> None:
    """Append a one-chunk range, merged into the last one when it continues it."""
    last = ranges[-1] if ranges else None
    if last is not None and (last.group, last.row, last.decision, last.stop) == (
        item.group,
        item.row,
        item.decision,
        item.start,
    ):
        ranges[-1] = ChunkRange(last.group, last.row, last.start, item.stop, last.decision)
    else:
        ranges.append(item)


def _mark_hosted(ranges: list[ChunkRange], hosted: set[tuple[int, int, int]]) -> list[ChunkRange]:
    """``ranges`` with the streamed chunks in ``hosted`` (group, row, chunk) marked HOST."""
    marked: list[ChunkRange] = []
    for item in ranges:
        for chunk in range(item.start, item.stop):
            decision = item.decision
            if decision is Decision.STREAM and (item.group, item.row, chunk) in hosted:
                decision = Decision.HOST
            _extend(marked, ChunkRange(item.group, item.row, chunk, chunk + 1, decision))
    return marked


def _raise_lost(
    state: SequenceState,
    manager: KVManager,
    host: PoolTier,
    outcomes: dict[ChunkRef, str],
    lost: dict[int, tuple[int, str]],
) -> None:
    gone = sum(
        1
        for row, (chunk, _) in lost.items()
        for ref in state.refs[row][chunk:]
        if outcomes.get(ref) != "corrupt" and manager.locate(ref) is None
    )
    if gone:  # (corrupt ones were counted where they were found)
        manager.count_recompute("missing", gone)
    row, (chunk, cause) = next(iter(lost.items()))
    ref = state.refs[row][chunk]
    raise ChunkLostError(
        f"chunk {ref.short()} of sequence {row} is in no tier ({cause}); resume it from "
        f"its cached prefix (host capacity {host.capacity_bytes} bytes may be too small for "
        "the context)",
        cause=cause,
        num_chunks=sum(len(state.refs[r]) - c for r, (c, _) in lost.items()),
    )


def hosted_view(
    plan: ForwardPlan,
    group: int,
    layer_idx: int,
    host: PoolTier,
    spent: Callable[[float], None] | None = None,
) -> Hosted | None:
    """Layer ``layer_idx``'s chunks of group ``group`` attended on the host (their pinned
    host slots; ``spent`` is told the seconds each host call takes); None when the group
    has none."""
    hosted = plan.hosted[group] if plan.hosted else []
    if not hosted:
        return None
    return Hosted(
        host=host,
        layer_idx=layer_idx,
        slot_index=plan.hosted_index[group],
        chunks=tuple(chunk for _, _, chunk in hosted),
        valid=plan.hosted_valid[group],
        spent=spent,
    )


def _flat_mask(mask: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """``[B, S, T]`` → ``[B, S*T]`` on the device, or None when every token is visible."""
    return None if bool(mask.all()) else mask.flatten(1).to(device)


def release(plan: ForwardPlan, host: PoolTier) -> None:
    """Unpin what ``plan_forward`` pinned (the caller finished the staging ring first)."""
    if plan.host_pins:
        host.unpin(plan.host_pins)
        plan.host_pins = []
