"""A request as the scheduler sees it: tokens so far, sampling state, its prefix match and
its cache; and ``Piece``, the ids one sequence feeds one forward.

A ``Sequence`` is created by ``start_sequence`` and mutated only by the scheduler and the
modules it calls (``prefix``, ``runner``, ``postprocess``), on the engine's worker thread.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from kvtier.engine.overlap import BackLoad
from kvtier.engine.request import RequestHandle
from kvtier.engine.sampling import TextStream, make_generator
from kvtier.manager import LookupResult
from kvtier.runtime import SequenceKV


@dataclass(eq=False)
class Sequence:
    """A request the scheduler knows: its tokens, sampling state and (when running) cache.

    ``ids`` holds the prompt and every generated token; while decoding, the cache holds all
    but the last (the next forward's input).

    ``prefix`` is the one prefix match of the current wait (``KVManager.lookup`` of
    ``ids[:prefix_limit]``), made at first sight for the disk → host prefetch or at
    admission, and kept: admission adopts through it, the reused-by-tier counters read its
    ``tiers``. ``prefix_step`` is the scheduler step that made it; a match from an earlier
    step is stale (other sequences may have sealed chunks since) and admission looks again.
    A preempted or retried sequence starts a new wait with no match (it sealed more chunks).
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
    prefix: LookupResult | None = None
    prefix_step: int = -1
    prefetched: bool = False  # the prefetch hint of this wait was tried
    decoding: bool = False
    suspect: bool = False  # was in a step that failed: runs alone until a step succeeds
    recoveries: int = 0  # resumed after its KV was lost from every tier (recomputed)
    pieces: deque[tuple[int, int]] = field(default_factory=deque)  # prefill [start, stop)
    back: BackLoad | None = None  # its prefix's back, loading while the front is computed

    def wait_again(self, suspect: bool = False) -> None:
        """Back to waiting without a cache (preempted, or retried after a fault): the next
        admission looks the prefix up again and re-plans the prefill."""
        self.cache = None
        self.decoding, self.suspect, self.prefetched = False, suspect, False
        self.prefix, self.prefix_step = None, -1
        self.pieces.clear()
        self.back = None  # its loads go on into host; the next admission finds them there


class Piece(NamedTuple):
    """What one sequence feeds a step's forward: ``ids[start:stop]``."""

    seq: Sequence
    start: int
    stop: int


def start_sequence(handle: RequestHandle, tokenizer: Any) -> Sequence:
    """The scheduler's state of a newly submitted request: its generator (None when
    greedy) and text stream. Raises what their set-up raises (the request then fails)."""
    request = handle.request
    params = request.params
    generator = None if params.greedy else make_generator(params.seed)
    text = TextStream(tokenizer, params.stop, request.prompt_ids)
    return Sequence(handle, list(request.prompt_ids), text, generator, request.arrival_s)
