"""Seats: the device storage of every one-row sequence an engine may run, in one slab.

An engine that runs up to ``seats`` sequences at once reserves their device pools and
tails as rows of one tensor instead of a pool and a tail per sequence::

    data  [seats, L, 2, H, 1 + S, T, D]    slot 0 of row i: seat i's tail (mutable last
                                           chunk); slots 1..S: its layer-major pool

so one layer of one seat's tail and resident chunks is one ``[H, (1 + n) T, D]`` range,
and one decode step writes the new K/V of every decoding sequence with one indexed store
and attends all of them, tails and resident chunks together, with one kernel call per
layer (``kvtier.runtime.decode``). Each sequence's arena sees only its own row (``pool``,
``tail``: views);
the slab owns the memory and zeroes (pre-faults) it once, at construction. Only models
whose layers are all full attention (one layer group) take seats: sliding groups keep
per-sequence pools sized by their windows.

Thread-safety: the slab itself is immutable after construction; its rows are mutated by
the arenas that own them, on the thread running the forwards.
"""

from __future__ import annotations

import torch

from kvtier.kv.layout import KVLayout


class SeatSlab:
    """Device pools and tails of ``seats`` one-row sequences.

    Args:
        layout: the model's chunk layout (all layers; full attention).
        seats: sequences that may run at once.
        budget_bytes: each seat's device budget: one tail chunk plus its pool's slots
            (``DeviceArena.split`` of one row gives the same slot count).
        device: where the slab lives.

    Raises:
        ValueError: the budget cannot hold a tail chunk.
    """

    def __init__(
        self, layout: KVLayout, seats: int, budget_bytes: int, device: torch.device
    ) -> None:
        chunk = layout.chunk_nbytes
        if budget_bytes < chunk:
            raise ValueError(
                f"device_budget_bytes: {budget_bytes} is below the minimum {chunk} for a "
                f"sequence (one {chunk}-byte tail chunk)"
            )
        self.layout = layout
        self.seats = seats
        self.slots = (budget_bytes - chunk) // chunk
        self.device = device
        num_layers, two, heads, tokens, dim = layout.chunk_shape
        self.data = torch.zeros(
            (seats, num_layers, two, heads, 1 + self.slots, tokens, dim),
            dtype=layout.dtype,
            device=device,
        )

    def pool(self, seat: int) -> torch.Tensor:
        """Seat ``seat``'s device pool ``[L, 2, H, S, T, D]`` (a strided view of the slab:
        slots 1..S of its row)."""
        return self.data[seat, :, :, :, 1:]

    def tail(self, seat: int) -> torch.Tensor:
        """Seat ``seat``'s tail as a one-row batch ``[1, L, 2, H, T, D]`` (a strided view:
        slot 0 of its row)."""
        return self.data[seat : seat + 1, :, :, :, 0]

    def tails(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every seat's tail keys and values of one layer, ``[seats, H, T, D]`` each."""
        return self.data[:, layer_idx, 0, :, 0], self.data[:, layer_idx, 1, :, 0]

    def kv(self, layer_idx: int, seats: int, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of one layer for seats ``0 .. seats-1``: each seat's tail then
        its pool slots ``0 .. slots-1``, end to end, ``[seats, H, (1 + slots) T, D]``."""
        heads, dim = self.data.shape[3], self.data.shape[-1]
        k = self.data[:seats, layer_idx, 0, :, : 1 + slots].reshape(seats, heads, -1, dim)
        v = self.data[:seats, layer_idx, 1, :, : 1 + slots].reshape(seats, heads, -1, dim)
        return k, v
