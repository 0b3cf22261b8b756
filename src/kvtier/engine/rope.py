"""RoPE's cos/sin for a step's positions, from a table the model's own rotary module filled.

A decode step of 16 rows used to call the rotary module every step, and its ``cos`` and
``sin`` (MKL's vector maths) each opened an OpenMP region of torch's threads for 16 x 64
values. The region's helper thread then spins on a core for the rest of its spin count,
while kvtier's own pool (``kvtier.native``) needs that core for the step's projections:
perf on the 2-core Intel Xeon counted that helper at 13 % of all samples over a run of
16-row decode steps. ``RopeTable`` calls the module once per size over positions
``0..P-1`` and gathers a step's rows with ``index_select`` (no region at these sizes).

The table holds what the module returns for each position, so a row is the same bits as
the module's own output for that position: its arithmetic is elementwise in the position
(``position * inv_freq``, then cos/sin and the attention scaling). RoPE types whose
frequencies depend on the longest position of a call (``dynamic``, ``longrope``: the
module's ``dynamic_rope_update``) are not tabled: each step calls the module.

Thread-safety: one forward at a time (the engine's worker thread); ``rows`` may grow the
table (replaced, not mutated: a tensor handed out earlier stays valid).
"""

from __future__ import annotations

from typing import Any

import torch

_FIRST_POSITIONS = 4096
"""The table's first size (positions); it doubles past the longest position asked."""


def tabled(rotary: Any) -> bool:
    """Whether ``rotary``'s cos/sin for a position do not depend on the other positions of
    a call: its ``rope_type`` is one string, neither a dynamic type nor ``longrope``."""
    kind = getattr(rotary, "rope_type", "default")
    return isinstance(kind, str) and "dynamic" not in kind and kind != "longrope"


class RopeTable:
    """cos/sin ``[N, D]`` of a step's positions (``rows``) from the model's ``rotary``
    module (transformers' ``*RotaryEmbedding``: ``forward(x, position_ids)``).

    Args:
        rotary: the module; called with ``x`` of the step's dtype and device.
    """

    def __init__(self, rotary: Any) -> None:
        self.rotary = rotary
        self.tabled = tabled(rotary)
        self.cos: torch.Tensor | None = None  # [P, D], owned here
        self.sin: torch.Tensor | None = None

    def rows(self, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[N, D]`` (``h``'s dtype and device) for ``positions [N]``."""
        if not self.tabled:
            cos, sin = self.rotary(h[None], positions[None])
            return cos[0], sin[0]
        need = int(positions.max()) + 1 if positions.numel() else 1
        if self.cos is None or self.cos.shape[0] < need or self.cos.dtype != h.dtype:
            self._fill(h, max(need, _FIRST_POSITIONS))
        assert self.cos is not None and self.sin is not None
        return self.cos.index_select(0, positions), self.sin.index_select(0, positions)

    def _fill(self, h: torch.Tensor, need: int) -> None:
        size = 1 << (need - 1).bit_length()  # the next power of two
        if self.cos is not None and self.cos.dtype == h.dtype:
            size = max(size, 2 * self.cos.shape[0])
        positions = torch.arange(size, device=h.device)
        cos, sin = self.rotary(h[:1][None], positions[None])
        self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()
