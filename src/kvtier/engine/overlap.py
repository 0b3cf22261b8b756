"""Reuse from a slow lower tier: compute a prefix's front while its back loads, and meet
where the two cross (DESIGN §4; Cake overlaps the same two).

A prompt's prefix match names the tier that holds each chunk. The leading run that host
holds is adopted at admission. For the chunks after it, held below host (the *back*),
``ReuseOverlap.adopt`` decides with the cost model:

- ``load``: unless overlap is predicted to put the back in place in at most
  ``OVERLAP_GAIN`` of the time loading all of it takes (``overlap_s``: pieces computed
  front to back until the loads, last chunk first, have reached them), or when the
  lower tier's rate is not known yet (the first load measures it), or overlap is off
  (``EngineConfig.reuse_overlap``): the admission promotes it and waits
  (``SequenceKV.reuse_prefix``). The margin is there because the two share the machine:
  a read from Redis parses on the CPU the prefill uses, and on two cores a predicted 6 %
  gain became a 3.7× loss (TTFT 2.18 s against 0.59 s predicted for loading, 2026-12-02);
- overlap: otherwise its promotions start, last chunk first, and the sequence prefills from
  the end of the host run, one piece per step. Before each piece the scheduler calls
  ``meet``: once host holds every chunk from the next piece's start to the end of the back,
  they are adopted (``SequenceKV.adopt_loaded``) and the rest of the prompt is prefilled.
  Compute moves forward, loads move backward, so they meet where their times balance, as
  measured (the model only decides whether to try). A chunk that never arrives (corrupt,
  evicted) is computed; a promotion of a chunk computed meanwhile is skipped on the link
  (``Move.landed``).

Each reuse with a back counts its decisions in ``EngineMetrics.add_decision``: ``load``
(chunks adopted from below host) and ``recompute`` (chunks of the back computed), each with
its predicted seconds (bytes ÷ the lower tier's rate; the work model's prefill seconds) and
measured seconds (admission until the chunks were in place).

Worker thread only: mutates the sequences' ``back``, their caches and handles' reused
tokens, and the metrics.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kvtier.engine.metrics import EngineMetrics
from kvtier.engine.request import RequestHandle
from kvtier.engine.work import WorkModel
from kvtier.kv.chunk import ChunkRef
from kvtier.manager import KVManager, LookupResult
from kvtier.runtime import SequenceKV
from kvtier.runtime.ledger import DecisionCost

OVERLAP_GAIN = 0.75
"""Overlap is tried only when predicted to take at most this share of the load-first time."""


@dataclass
class BackLoad:
    """A prefix's back loading while its front is computed (``Sequence.back``).

    Attributes:
        refs: the prefix match's chunks, front to back.
        tiers: the tier of each at admission.
        first: the first chunk of the back (the first held below host).
        admitted_s: ``perf_counter`` at admission.
        load_s_per_chunk: the lower tier's predicted seconds per chunk (None: no rate).
        count: the reuse is the request's first admission (its tokens count as reused).
        handle: the request, whose ``reused_tokens`` grow by what the back adds.
    """

    refs: list[ChunkRef]
    tiers: list[str]
    first: int
    admitted_s: float
    load_s_per_chunk: float | None
    count: bool
    handle: RequestHandle


class ReuseOverlap:
    """Decides, per reused prefix, how its chunks below host come back (module docstring).

    Args:
        manager: the tiers (host, the lower tiers and their links).
        work: the engine's work model (prefill seconds).
        metrics: where decisions and reused tokens are counted.
        piece_tokens: the most prompt tokens one prefill piece carries.
        enabled: False: the back always loads first (``EngineConfig.reuse_overlap``).
    """

    def __init__(
        self,
        manager: KVManager,
        work: WorkModel,
        metrics: EngineMetrics,
        piece_tokens: int,
        enabled: bool = True,
    ) -> None:
        self.manager, self.work, self.metrics = manager, work, metrics
        self.piece_tokens, self.enabled = piece_tokens, enabled
        self.chunk_tokens = manager.layout.chunk_tokens

    def load_gbps(self) -> float | None:
        """The tier below host's read rate the model assumes: its link's throttle, or the
        rate the link achieved so far, whichever is lower (None: neither known)."""
        if not self.manager.hops:
            return None
        throttle = self.manager.config.lower_tiers[0].link.gbps
        achieved = self.manager.hops[0].link.stats().achieved_gbps
        known = [r for r in (throttle, achieved) if r]
        return min(known) if known else None

    def prefill_s(self, start: int, stop: int) -> float:
        """The work model's seconds to prefill positions ``[start, stop)``."""
        per_token, per_pair, _ = self.work.rates
        tokens = stop - start
        return per_token * tokens + per_pair * tokens * (start + stop) / 2

    def overlap_s(self, start: int, back_chunks: int, prompt_tokens: int, load_s: float) -> float:
        """Predicted seconds until a back of ``back_chunks`` chunks from position ``start``
        is in place when its front is computed piece by piece while it loads last chunk
        first at ``load_s`` a chunk: the first piece after which the loads have reached the
        compute (or the whole back computed)."""
        end = start + back_chunks * self.chunk_tokens
        pos, elapsed = start, 0.0
        while pos < end:
            stop = min(pos + self.piece_tokens, prompt_tokens)
            elapsed += self.prefill_s(pos, stop)
            pos = stop
            if max(0, end - pos) // self.chunk_tokens * load_s <= elapsed:
                break
        return elapsed

    def adopt(
        self,
        cache: SequenceKV,
        ids: list[int],
        handle: RequestHandle,
        match: LookupResult,
        count: bool,
    ) -> tuple[int, BackLoad | None]:
        """Adopt ``match`` of ``ids`` (the sequence's tokens so far) into the empty
        ``cache`` now, or its host run now and its back later, under the request's salt;
        returns the tokens adopted now and the pending back (None: nothing pending).
        ``count``: the request's first admission (reused tokens are counted)."""
        salt = handle.request.cache_salt
        prompt = torch.tensor([ids], dtype=torch.long)
        host, size = self.manager.host.name, self.chunk_tokens
        first = next((i for i, t in enumerate(match.tiers) if t != host), len(match.tiers))
        back = len(match.refs) - first
        if back == 0:
            return cache.reuse_prefix(prompt, salt, match=match), None
        gbps = self.load_gbps()
        per_chunk = self.manager.layout.chunk_nbytes / (gbps * 1e9) if gbps else None
        start = first * size
        if (
            not self.enabled
            or per_chunk is None
            or self.overlap_s(start, back, len(ids), per_chunk) > OVERLAP_GAIN * back * per_chunk
        ):
            began = time.perf_counter()
            reused = cache.reuse_prefix(prompt, salt, match=match)
            loaded = max(0, reused // size - first)
            predicted = loaded * per_chunk if per_chunk is not None else None
            self._decide("load", loaded, predicted, time.perf_counter() - began)
            return reused, None
        # Never blocks the worker: a chunk the link has no room for now is computed, unless
        # a later meet finds it loaded after all.
        self.manager.prefetch_to_host(match.refs[first:][::-1], wait_for_room=False)
        front = LookupResult(start, match.refs[:first], match.tiers[:first])
        reused = cache.reuse_prefix(prompt, salt, match=front, pages=False)
        pending = BackLoad(
            list(match.refs),
            list(match.tiers),
            first,
            time.perf_counter(),
            per_chunk,
            count,
            handle,
        )
        return reused, pending

    def meet(self, cache: SequenceKV, ids: list[int], back: BackLoad) -> tuple[bool, int]:
        """Before a piece of a sequence with a pending back: adopt the back's rest if host
        holds all of it. Returns ``(settled, tokens adopted)``: settled means the back is
        no longer pending (adopted, or the compute reached its end)."""
        size = self.chunk_tokens
        pos = cache.seq_len
        if pos % size:
            return False, 0
        done = pos // size
        if done >= len(back.refs):
            self._settle(back, done, 0)
            return True, 0
        rest = back.refs[done:]
        if not all(self.manager.host.contains(r) for r in rest):
            return False, 0
        adopted = cache.adopt_loaded(torch.tensor([ids], dtype=torch.long), rest) // size
        self._settle(back, done, adopted)
        return True, adopted * size

    def _settle(self, back: BackLoad, done: int, adopted: int) -> None:
        """Count a back's decisions once it is settled: computed up to chunk ``done``,
        then ``adopted`` chunks adopted."""
        elapsed = time.perf_counter() - back.admitted_s
        size = self.chunk_tokens
        computed = max(0, done - back.first)
        if computed:
            start = back.first * size
            self._decide("recompute", computed, self.prefill_s(start, done * size), elapsed)
        if adopted:
            per_chunk = back.load_s_per_chunk
            self._decide("load", adopted, adopted * per_chunk if per_chunk else None, elapsed)
            if back.count:
                self.metrics.add_reused(adopted * size, back.tiers[done:], size)
                back.handle.reused_tokens += adopted * size

    def _decide(self, name: str, chunks: int, predicted_s: float | None, measured: float) -> None:
        if chunks:
            nbytes = chunks * self.manager.layout.chunk_nbytes
            self.metrics.add_decision(name, DecisionCost(chunks, nbytes, predicted_s, measured))
