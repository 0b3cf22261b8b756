"""The device arena: one batch's resident chunks (a pool per layer group) and its tails.

Device memory of a batch of ``rows`` sequences, all counted against one budget::

    part             shape (per row)                         rule
    tails            [L, 2, H, T, D] × rows                  always: the mutable last chunk
    sliding pool g   [Lg, 2, H, T, D] × window_chunks(g)      the sealed chunks g's next
                                                              query can reach, no others
    full pool        [Lf, 2, H, T, D] × what is left          sinks (pinned), then newest

A sliding group therefore never holds more than its window (rounded up to whole chunks)
plus the tail per sequence.

Residency is an index the arena keeps from its own events: a chunk becomes resident when
``place`` puts it, and stops when a put evicts it, ``place`` drops it from a window, or
``clear`` empties the pool. The pools are private to the arena and change only in those
calls (between passes), so a pass reads ``slot_of`` without pinning or taking a lock per
chunk. The staging ring for streamed chunks is a fixed allowance
outside the budget (``kvtier.runtime.staging``). The buffer of chunks completed during a
pass lives on the compute device, so a sealed chunk is copied device → host once (by the
manager's ``store``) and placed on the device from there without crossing the link.

Ownership: the arena owns its pools, tails and open buffer (a seated arena's pool and
tail are its row of an engine's ``SeatSlab``, which owns that memory); callers get views
that stay
valid until the next ``ensure`` with another row count or ``close``. Mutated by
``ensure``, ``place``, ``clear``, ``unpin_sinks`` and ``close``, from the one thread that
runs the batch's forwards; not thread-safe.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.kv.chunk import Chunk, ChunkRef
from kvtier.kv.keys import ChunkKey
from kvtier.kv.layout import KVLayout
from kvtier.runtime.groups import LayerGroup
from kvtier.runtime.seats import SeatSlab
from kvtier.tiers.base import TierStats
from kvtier.tiers.pool import PoolTier, device_tier


class DeviceArena:
    """Resident chunks and tails of one batch within ``budget_bytes``.

    Args:
        layout: the model's chunk layout (all layers).
        groups: the layer groups (``kvtier.runtime.groups.layer_groups``).
        budget_bytes: device bytes for tails plus resident chunks.
        device: where everything lives.
        sink_chunks: leading chunks of each sequence pinned in the full-attention pool.
        seat: ``(slab, index)``: keep the pool and tail in that row of the slab (one-row
            batches of an all-full-attention model only); None: allocate them here.

    Raises:
        ValueError: a seat for a model with sliding layers, or whose slab has another
            slot count than the budget gives.
    """

    def __init__(
        self,
        layout: KVLayout,
        groups: Sequence[LayerGroup],
        budget_bytes: int,
        device: torch.device,
        sink_chunks: int,
        seat: tuple[SeatSlab, int] | None = None,
    ) -> None:
        self.layout = layout
        self.groups = list(groups)
        self.budget_bytes = budget_bytes
        self.device = device
        self.sink_chunks = sink_chunks
        # layer -> (group index, layer index within the group's pool)
        self.where: list[tuple[int, int]] = [(0, 0)] * layout.num_layers
        for g, group in enumerate(self.groups):
            for local, layer in enumerate(group.layers):
                self.where[layer] = (g, local)
        self.rows = 0
        self.pools: list[PoolTier] = []
        self.tails: torch.Tensor | None = None  # [B, L, 2, H, T, D]
        self.open: torch.Tensor | None = None  # [B, f, L, 2, H, T, D]: chunks of a pass
        self._sinks: list[ChunkRef] = []  # pinned in the full pool
        self.peak_group_nbytes = [0] * len(self.groups)  # most each pool held after a place
        self._slots: list[dict[ChunkKey, int]] = [{} for _ in self.groups]  # resident: slot
        self.seat = seat
        if seat is not None:
            if len(self.groups) != 1 or self.groups[0].window is not None:
                raise ValueError("seat: only a model whose layers are all full attention")
            slots = self.split(1)[0] // layout.chunk_nbytes
            if seat[0].slots != slots:
                raise ValueError(f"seat: the slab has {seat[0].slots} slots, the budget {slots}")

    # ---- sizes --------------------------------------------------------------------------

    def split(self, rows: int) -> list[int]:
        """Bytes of each group's pool for a batch of ``rows``: sliding groups get their
        windows first (as far as the budget goes), full attention what is left.

        Raises:
            ValueError: the budget cannot hold one tail chunk per row.
        """
        tails = rows * self.layout.chunk_nbytes
        if self.budget_bytes < tails:
            raise ValueError(
                f"device_budget_bytes: {self.budget_bytes} is below the minimum {tails} for a "
                f"batch of {rows} (one {self.layout.chunk_nbytes}-byte tail chunk per sequence)"
            )
        left = self.budget_bytes - tails
        sizes = [0] * len(self.groups)
        for g, group in enumerate(self.groups):
            reach = group.window_chunks(self.layout.chunk_tokens)
            if reach is None:
                continue
            chunk = group.layout(self.layout).chunk_nbytes
            sizes[g] = min(rows * reach, left // chunk) * chunk
            left -= sizes[g]
        for g, group in enumerate(self.groups):
            if group.window is None:
                sizes[g] = left
        return sizes

    @property
    def resident_slots(self) -> int | None:
        """Sealed chunks of every layer the arena can keep resident for the batch (the full
        pool's slots); None when every layer is sliding (no length outgrows the arena)."""
        full = [g for g, group in enumerate(self.groups) if group.window is None]
        if not full:
            return None
        return self.pools[full[0]].num_slots if self.pools else 0

    @property
    def device_nbytes(self) -> int:
        """Device bytes counted against the budget: resident chunks plus the tails."""
        tails = self.tails.numel() * self.tails.element_size() if self.tails is not None else 0
        return tails + sum(p.used_bytes for p in self.pools)

    def group_nbytes(self, group_idx: int) -> int:
        """Resident bytes of one group (its pool; the tails are counted apart)."""
        return self.pools[group_idx].used_bytes if self.pools else 0

    def stats(self) -> TierStats:
        return TierStats.total(p.stats() for p in self.pools) if self.pools else TierStats()

    # ---- buffers ------------------------------------------------------------------------

    def ensure(self, rows: int) -> None:
        """Allocate the pools and tails of a batch of ``rows`` (kept while it stays the same).

        Raises:
            ValueError: the budget cannot hold one tail chunk per row.
        """
        sizes = self.split(rows)
        if self.seat is not None:
            self._ensure_seat(rows, sizes[0])
            return
        shape = (rows, *self.layout.chunk_shape)
        if self.tails is None or tuple(self.tails.shape) != shape:
            # Only the first tail_len tokens of a tail are ever read: no need to clear it.
            self.tails = torch.zeros(shape, dtype=self.layout.dtype, device=self.device)
        if not self.pools or [p.capacity_bytes for p in self.pools] != sizes:
            self.close_pools()
            self.pools = [
                device_tier(group.layout(self.layout), size, self.device)
                for group, size in zip(self.groups, sizes, strict=True)
            ]
        self.rows = rows

    def _ensure_seat(self, rows: int, pool_nbytes: int) -> None:
        """The pool and tail are the seat's row of the slab (views, allocated there)."""
        assert self.seat is not None
        if rows != 1:
            raise ValueError(f"a seated cache runs one row, not {rows}")
        slab, index = self.seat
        if not self.pools:
            self.tails = slab.tail(index)
            self.pools = [
                device_tier(self.layout, pool_nbytes, self.device, storage=slab.pool(index))
            ]
        self.rows = 1

    def ensure_open(self, rows: int, num_chunks: int) -> torch.Tensor:
        """The buffer for ``num_chunks`` chunks completed in one pass, ``[B, f, L, 2, H, T, D]``."""
        if self.open is None or self.open.shape[0] != rows or self.open.shape[1] < num_chunks:
            shape = (rows, num_chunks, *self.layout.chunk_shape)
            self.open = torch.zeros(shape, dtype=self.layout.dtype, device=self.device)
        return self.open

    def slot_of(self, group_idx: int, ref: ChunkRef) -> int | None:
        """The slot of a resident chunk in group ``group_idx``'s pool; None: not resident."""
        return self._slots[group_idx].get(ref.key)

    def layer_kv(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's keys and values in its group's pool, ``[H, S, T, D]`` each."""
        g, local = self.where[layer_idx]
        return self.pools[g].layer_kv(local)

    # ---- residency ----------------------------------------------------------------------

    def place(
        self, chunks: Sequence[tuple[int, int, Chunk]], refs: Sequence[Sequence[ChunkRef]]
    ) -> None:
        """Make newly sealed (or adopted) chunks resident by each group's rule.

        Args:
            chunks: ``(row, chunk index, chunk)`` in sequence order per row; ``chunk.data``
                holds every layer ``[L, 2, H, T, D]`` and is only read.
            refs: every sealed chunk of each row after this pass (for the sliding rule).
        """
        for g, group in enumerate(self.groups):
            pool = self.pools[g]
            layers = list(group.layers)
            whole = len(layers) == self.layout.num_layers

            def part(chunk: Chunk, whole: bool = whole, layers: list[int] = layers) -> Chunk:
                return chunk if whole else Chunk(chunk.ref, chunk.data[layers])

            if group.window is None:
                self._place_full(g, [(i, part(c)) for _, i, c in chunks])
                continue
            size = self.layout.chunk_tokens
            keep: list[Chunk] = []
            for row, row_refs in enumerate(refs):
                first = group.first_chunk(len(row_refs) * size, size)
                gone = [r for r in row_refs[:first] if r.key in self._slots[g]]
                pool.remove(gone)  # out of the window for good
                for ref in gone:
                    self._slots[g].pop(ref.key, None)
                keep += [part(c) for r, i, c in chunks if r == row and i >= first]
            if keep and pool.num_slots:
                self._put(g, keep[-pool.num_slots :])
        for g, pool in enumerate(self.pools):
            self.peak_group_nbytes[g] = max(self.peak_group_nbytes[g], pool.used_bytes)

    def _put(self, group_idx: int, chunks: list[Chunk]) -> None:
        """Put chunks in a pool and record the residency events: stored and evicted."""
        pool, slots = self.pools[group_idx], self._slots[group_idx]
        result = pool.put(chunks)
        for ref in result.evicted:
            slots.pop(ref.key, None)
        for chunk in chunks:
            if chunk.key in result.stored or chunk.key in result.already_present:
                slot = pool.slot_of(chunk.ref)
                if slot is not None:
                    slots[chunk.key] = slot

    def _place_full(self, group_idx: int, chunks: list[tuple[int, Chunk]]) -> None:
        """Keep the sinks (pinned) and the newest sealed chunks resident."""
        pool = self.pools[group_idx]
        room = pool.num_slots - len(self._sinks)
        sinks = [c for i, c in chunks if i < self.sink_chunks]
        others = [c for i, c in chunks if i >= self.sink_chunks]
        sinks = sinks[: max(0, room - 1)]  # always leave one slot for recent chunks
        newest = others[-(room - len(sinks)) :] if room - len(sinks) > 0 else []
        self._put(group_idx, sinks + newest)
        for chunk in sinks:
            if pool.pin([chunk.ref])[0]:
                self._sinks.append(chunk.ref)

    def unpin_sinks(self) -> None:
        """Let the sinks of the sequences that are done be evicted."""
        if self._sinks and self.pools:
            g = next(i for i, group in enumerate(self.groups) if group.window is None)
            self.pools[g].unpin(self._sinks)
        self._sinks = []

    def clear(self) -> None:
        """Drop every resident chunk (they stay in host), so the next sequence's chunks fill
        the pools from slot 0 again and lie end to end."""
        self.unpin_sinks()
        for pool in self.pools:
            pool.clear()
        self._slots = [{} for _ in self.groups]

    def close_pools(self) -> None:
        self.unpin_sinks()
        for pool in self.pools:
            pool.close()
        self.pools = []
        self._slots = [{} for _ in self.groups]

    def close(self) -> None:
        """Release the pools; the arena may be ``ensure``d again."""
        self.close_pools()
        self.rows = 0
