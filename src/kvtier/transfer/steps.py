"""Copy steps: the unit of work a link executes.

A link does not know tiers or chunks. It runs ``CopyStep``s in order, and each step says
how many bytes it moves and which layers it completes. Callers build steps from whatever
they move: a layer's slice of a staged chunk (``kvtier.runtime.staging``), a move between
two tiers (``kvtier.moves.Move``), a write-back (``kvtier.writeback``). Pure data.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


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
        skip: asked on the worker just before the step: True means its result is already
            where it goes (e.g. a chunk computed meanwhile), so the step is done without
            running, and its bytes neither pace the throttle nor count as moved.
    """

    nbytes: int
    layers: range
    run: Callable[[], None]
    skip: Callable[[], bool] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.nbytes, int) or self.nbytes < 0:
            raise ValueError(f"CopyStep.nbytes: must be an integer >= 0, got {self.nbytes!r}")
        if not isinstance(self.layers, range):
            raise ValueError(f"CopyStep.layers: must be a range, got {type(self.layers)}")
        if len(self.layers) and min(self.layers[0], self.layers[-1]) < 0:
            raise ValueError(f"CopyStep.layers: indices must be >= 0, got {self.layers}")
