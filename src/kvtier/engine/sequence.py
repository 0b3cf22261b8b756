"""A request as the scheduler sees it: tokens so far, sampling state, and its cache.

Mutated only by the scheduler, on the engine's worker thread.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from kvtier.engine.request import RequestHandle
from kvtier.engine.sampling import TextStream
from kvtier.runtime import SequenceKV


@dataclass(eq=False)
class Sequence:
    """A request the scheduler knows: its tokens, sampling state and (when running) cache.

    ``ids`` holds the prompt and every generated token; while decoding, the cache holds all
    but the last (the next forward's input).
    """

    handle: RequestHandle
    ids: list[int]
    text: TextStream
    generator: torch.Generator | None
    waiting_since_s: float
    generated: int = 0
    last_token_s: float = 0.0
    cache: SequenceKV | None = None
    admitted: int = -1  # admission order; the youngest has the largest
    admitted_s: float = 0.0
    admissions: int = 0
    prefetched: bool = False
    decoding: bool = False
    suspect: bool = False  # was in a step that failed: runs alone until a step succeeds
    recoveries: int = 0  # resumed after its KV was lost from every tier (recomputed)
    pieces: deque[tuple[int, int]] = field(default_factory=deque)  # prefill [start, stop)
