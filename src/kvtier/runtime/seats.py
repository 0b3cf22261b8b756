"""Seats: the device storage of every one-row sequence an engine may run, in one slab.

An engine that runs up to ``seats`` sequences at once reserves their device pools and
tails as rows of two tensors instead of one pair per sequence::

    pools  [seats, L, 2, H, S, T, D]   row i: seat i's layer-major device pool
    tails  [seats, L, 2, H, T, D]      row i: seat i's mutable last chunk

so one decode step writes the new K/V of every decoding sequence with one indexed store
and attends all of them with one call per layer (``kvtier.runtime.decode``), instead of
one per sequence. Each sequence's arena sees only its own row (``pool``, ``tail``: views);
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
        ValueError: the budget cannot hold a tail and one resident chunk.
    """

    def __init__(
        self, layout: KVLayout, seats: int, budget_bytes: int, device: torch.device
    ) -> None:
        chunk = layout.chunk_nbytes
        if budget_bytes < 2 * chunk:
            raise ValueError(
                f"device_budget_bytes: {budget_bytes} holds no resident chunk beside the "
                f"{chunk}-byte tail; seats need at least {2 * chunk}"
            )
        self.layout = layout
        self.seats = seats
        self.slots = (budget_bytes - chunk) // chunk
        self.device = device
        num_layers, two, heads, tokens, dim = layout.chunk_shape
        self.pools = torch.zeros(
            (seats, num_layers, two, heads, self.slots, tokens, dim),
            dtype=layout.dtype,
            device=device,
        )
        self.tails = torch.zeros(
            (seats, num_layers, two, heads, tokens, dim), dtype=layout.dtype, device=device
        )

    def pool(self, seat: int) -> torch.Tensor:
        """Seat ``seat``'s device pool ``[L, 2, H, S, T, D]`` (a view of the slab)."""
        return self.pools[seat]

    def tail(self, seat: int) -> torch.Tensor:
        """Seat ``seat``'s tail as a one-row batch ``[1, L, 2, H, T, D]`` (a view)."""
        return self.tails[seat : seat + 1]
