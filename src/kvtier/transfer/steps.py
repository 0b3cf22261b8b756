"""Copy steps: the unit of work a link executes.

A link does not know tiers or chunks. It runs ``CopyStep``s in order, and each step says
how many bytes it moves and which layers it completes. Callers build steps from whatever
they move: tensor slices (``layer_copy_steps``), a tier's ``get_into``, a disk read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch


@dataclass(frozen=True)
class CopyStep:
    """One copy a link executes.

    Attributes:
        nbytes: bytes the step moves; counted against the link's in-flight bound and
            used by its throttle.
        layers: layer indices this step writes. A layer is ready once every step that
            covers it has finished (steps run in submission order). May be empty.
        run: does the copy, e.g. ``dst[l].copy_(src[l])``. Called once, on the link's
            worker thread (on CUDA, inside the link's copy stream); it must not submit to
            its own link. The buffers it touches belong to the caller, who keeps them
            alive and leaves them unchanged until the transfer is done.
    """

    nbytes: int
    layers: range
    run: Callable[[], None]

    def __post_init__(self) -> None:
        if not isinstance(self.nbytes, int) or self.nbytes < 0:
            raise ValueError(f"CopyStep.nbytes: must be an integer >= 0, got {self.nbytes!r}")
        if not isinstance(self.layers, range):
            raise ValueError(f"CopyStep.layers: must be a range, got {type(self.layers)}")
        if len(self.layers) and min(self.layers[0], self.layers[-1]) < 0:
            raise ValueError(f"CopyStep.layers: indices must be >= 0, got {self.layers}")


def layer_copy_steps(
    srcs: Sequence[torch.Tensor],
    dsts: Sequence[torch.Tensor],
    layers_per_step: int = 1,
    non_blocking: bool = False,
) -> list[CopyStep]:
    """Steps that copy ``srcs[i]`` into ``dsts[i]`` layer group by layer group.

    Every tensor is layer-major (dim 0 is the layer, e.g. a chunk ``[L, 2, H, T, D]``), and
    all share the same number of layers. Step ``k`` copies layers
    ``[k * layers_per_step, (k + 1) * layers_per_step)`` of every pair, so layer 0 of all
    chunks is ready before layer 1 of any.

    Builds closures only; copies nothing now. The caller owns every tensor.

    Args:
        srcs: source tensors, ``[L, ...]``.
        dsts: destination tensors, same shapes as ``srcs``.
        layers_per_step: layers per step (>= 1); larger steps mean fewer, bigger copies.
        non_blocking: passed to ``Tensor.copy_`` (async host<->CUDA copies need pinned
            host memory).

    Returns:
        ``ceil(L / layers_per_step)`` steps (none when there are no pairs).
    """
    if len(srcs) != len(dsts):
        raise ValueError(f"layer_copy_steps: {len(srcs)} sources but {len(dsts)} destinations")
    if layers_per_step < 1:
        raise ValueError(f"layers_per_step: must be >= 1, got {layers_per_step}")
    if not srcs:
        return []
    num_layers = srcs[0].shape[0]
    for src, dst in zip(srcs, dsts, strict=True):
        if src.shape != dst.shape or src.shape[0] != num_layers:
            raise ValueError(
                f"layer_copy_steps: shapes {tuple(src.shape)} -> {tuple(dst.shape)} differ "
                f"or do not have {num_layers} layers"
            )
    steps = []
    for start in range(0, num_layers, layers_per_step):
        stop = min(start + layers_per_step, num_layers)
        pairs = [(src[start:stop], dst[start:stop]) for src, dst in zip(srcs, dsts, strict=True)]
        nbytes = sum(s.numel() * s.element_size() for s, _ in pairs)
        steps.append(CopyStep(nbytes, range(start, stop), partial(_copy_all, pairs, non_blocking)))
    return steps


def _copy_all(pairs: list[tuple[torch.Tensor, torch.Tensor]], non_blocking: bool) -> None:
    for src, dst in pairs:
        dst.copy_(src, non_blocking=non_blocking)
