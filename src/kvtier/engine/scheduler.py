"""Continuous batching: the engine's worker when ``max_batch_size > 1``.

Every ``step`` reads schedule → run → postprocess:

1. **schedule**: start disk→host prefetches for queued requests' cached chunks; admit the
   oldest waiting sequences while the device budget has room for their caches (each
   running sequence holds one ``TieredCache`` of ``cache.device_budget_bytes``); when the
   oldest has waited ``preempt_after_s`` and nothing fits, preempt the youngest decoding
   sequence that has run that long, once no admitted sequence is still prefilling (its
   sealed chunks are already in host and stay there or go down to disk; it resumes later
   through ``reuse_prefix``).
2. **run**: prefill pieces (whole chunks) of the oldest admitted sequences still
   prefilling (one chunk, or up to ``prefill_tokens_per_step`` tokens), then one batched
   decode forward of every decoding sequence (one token each, different lengths, through
   ``BatchCache``).
3. **postprocess**: sample each row with its own parameters and generator, stream the
   token, finish or keep each sequence.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvtier.engine.batch_cache import BatchCache
from kvtier.engine.request import RequestHandle, TokenEvent
from kvtier.engine.sampling import TextStream, make_generator, sample
from kvtier.hf import TieredCache
from kvtier.kv.chunk import ChunkRef

if TYPE_CHECKING:
    from kvtier.engine.engine import Engine


@dataclass(eq=False)
class _Sequence:
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
    cache: TieredCache | None = None
    admitted: int = -1  # admission order; the youngest has the largest
    admitted_s: float = 0.0
    admissions: int = 0
    prefetched: bool = False
    decoding: bool = False
    pieces: deque[tuple[int, int]] = field(default_factory=deque)  # prefill [start, stop)


class BatchScheduler:
    """Runs the engine's requests with continuous batching; used by the worker thread only.

    Args:
        engine: the engine whose queue, model, manager, counters and histograms it uses.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.config = engine.config
        self.max_running = engine.config.max_running
        self.chunk_tokens = engine.manager.layout.chunk_tokens
        # Chunks per prefill forward: one, or as many as the step's prefill budget holds.
        budget = engine.config.prefill_tokens_per_step or self.chunk_tokens
        self._piece_chunks = max(1, budget // self.chunk_tokens)
        self.running: list[_Sequence] = []
        self.preempted: deque[_Sequence] = deque()  # waiting to resume, oldest first
        self.idle: list[TieredCache] = []  # caches of finished sequences, for reuse
        self._admissions = itertools.count()
        self._known: dict[RequestHandle, _Sequence] = {}  # queued requests seen so far

    @property
    def busy(self) -> bool:
        """Sequences are running or waiting to resume."""
        return bool(self.running or self.preempted)

    def step(self) -> None:
        """One scheduling step: schedule, run one prefill piece and one decode batch."""
        self._schedule()
        budget = self.config.prefill_tokens_per_step
        spent = 0
        while True:  # at least one piece; more while the step's prefill budget lasts
            prefilling = [s for s in self.running if not s.decoding]
            if not prefilling:
                break
            spent += self._prefill_piece(min(prefilling, key=lambda s: s.admitted))
            if budget is None or spent >= budget:
                break
        decoding = [s for s in self.running if s.decoding]
        if decoding:
            self._decode(decoding)

    def close(self) -> None:
        """Release every cache (worker exit)."""
        for seq in self.running:
            if seq.cache is not None:
                seq.cache.close()
        for cache in self.idle:
            cache.close()
        self.running, self.idle = [], []

    def fail_all(self, exc: Exception) -> None:
        """End every running and preempted sequence with ``exc``; drop their caches."""
        for seq in [*self.running, *self.preempted]:
            if seq.cache is not None:
                seq.cache.close()
                seq.cache = None
            self._fail(seq, exc)
        self.running, self.preempted = [], deque()
        self._sync_counts()

    # ---- schedule --------------------------------------------------------------------------

    def _schedule(self) -> None:
        engine = self.engine
        with engine._cond:
            queued = list(engine._queue)
        for handle in queued[: 2 * self.max_running]:
            self._prefetch(self._sequence_of(handle))
        for resuming in self.preempted:
            self._prefetch(resuming)
        while True:
            seq = self._oldest_waiting()
            if seq is None:
                break
            if seq.handle.cancelled:
                self._take(seq)
                self._finish_cancelled(seq)
                continue
            if len(self.running) >= self.max_running and not self._preempt_for(seq):
                break
            self._take(seq)
            self._admit(seq)

    def _sequence_of(self, handle: RequestHandle) -> _Sequence:
        seq = self._known.get(handle)
        if seq is None:
            request = handle.request
            params = request.params
            generator = None if params.greedy else make_generator(params.seed)
            text = TextStream(self.engine.tokenizer, params.stop, request.prompt_ids)
            seq = _Sequence(handle, list(request.prompt_ids), text, generator, request.arrival_s)
            self._known[handle] = seq
        return seq

    def _oldest_waiting(self) -> _Sequence | None:
        engine = self.engine
        with engine._cond:
            head = engine._queue[0] if engine._queue else None
        fresh = self._sequence_of(head) if head is not None else None
        resumed = self.preempted[0] if self.preempted else None
        if fresh is None or resumed is None:
            return fresh or resumed
        return resumed if resumed.waiting_since_s <= fresh.waiting_since_s else fresh

    def _take(self, seq: _Sequence) -> None:
        """Remove ``seq`` from whichever waiting line holds it."""
        engine = self.engine
        if self.preempted and self.preempted[0] is seq:
            self.preempted.popleft()
        else:
            with engine._cond:
                engine._queue.popleft()
            self._known.pop(seq.handle, None)
        self._sync_counts()

    def _preempt_for(self, seq: _Sequence) -> bool:
        """Make room for ``seq`` by preempting the youngest decoding sequence, if due.

        Due when ``seq`` has waited ``preempt_after_s``; only a sequence that has run that
        long since its admission may be preempted, so sequences take turns rather than
        thrash.
        """
        after = self.config.preempt_after_s
        now = time.perf_counter()
        if after is None or now - seq.waiting_since_s < after:
            return False
        if any(not s.decoding for s in self.running):
            return False  # one at a time: the last one admitted is still prefilling
        victims = [s for s in self.running if s.decoding and now - s.admitted_s >= after]
        if not victims:
            return False
        victim = max(victims, key=lambda s: s.admitted)
        self.running.remove(victim)
        assert victim.cache is not None
        self._release(victim.cache)  # sealed chunks stay in host (and disk) for the resume
        victim.cache = None
        victim.decoding = False
        victim.waiting_since_s = time.perf_counter()
        victim.prefetched = False
        self.preempted.append(victim)
        self._sync_counts()
        self.engine._count("preemptions")
        return True

    def _prefetch(self, seq: _Sequence) -> None:
        """Start moving the cached chunks of a waiting sequence's prefix disk → host."""
        if seq.prefetched:
            return
        seq.prefetched = True
        manager = self.engine.manager
        if manager.disk is None:
            return
        limit = ((len(seq.ids) - 1) // self.chunk_tokens) * self.chunk_tokens
        refs: list[ChunkRef] = []
        for ref in manager.refs_for(seq.ids[:limit]):
            if manager.locate(ref) is None:
                break
            refs.append(ref)
        todo = [r for r in refs if not manager.host.contains(r)]
        if todo and manager.prefetch_to_host(todo) is not None:
            self.engine._count("prefetched_chunks", len(todo))

    def _admit(self, seq: _Sequence) -> None:
        engine = self.engine
        cache = self.idle.pop() if self.idle else engine._new_cache()
        first = seq.admissions == 0
        tiers = engine._prefix_tiers(seq.ids, cache) if first else []
        try:
            reused = cache.reuse_prefix(torch.tensor([seq.ids], dtype=torch.long))
        except Exception as exc:
            cache.close()
            self._fail(seq, exc)
            return
        if first:
            seq.handle.reused_tokens = reused
            engine._count_prompt(len(seq.ids), reused, tiers)
        seq.cache = cache
        seq.admitted = next(self._admissions)
        seq.admitted_s = time.perf_counter()
        seq.admissions += 1
        size = self.chunk_tokens
        pos, end = cache.seq_len, len(seq.ids)
        while pos < end:  # pieces end on chunk boundaries, so each seals whole chunks
            stop = min(end, (pos // size + self._piece_chunks) * size)
            seq.pieces.append((pos, stop))
            pos = stop
        self.running.append(seq)
        self._sync_counts()

    # ---- run -------------------------------------------------------------------------------

    def _prefill_piece(self, seq: _Sequence) -> int:
        """One chunk-sized prefill forward; the last piece's logits give the next token.

        Returns the piece's tokens."""
        engine = self.engine
        cache = seq.cache
        assert cache is not None
        start, stop = seq.pieces.popleft()
        ids = torch.tensor([seq.ids[start:stop]], dtype=torch.long, device=engine.device)
        try:
            out = engine.model(ids, cache=cache, use_cache=True, logits_to_keep=1)
        except Exception as exc:
            self.running.remove(seq)
            cache.close()
            seq.cache = None
            self._fail(seq, exc)
            return stop - start
        if not seq.pieces:
            seq.decoding = True
            self._postprocess(seq, out.logits[0, -1])
        return stop - start

    def _decode(self, rows: list[_Sequence]) -> None:
        """One batched forward: the last token of every decoding sequence."""
        engine = self.engine
        caches = [s.cache for s in rows]
        assert all(c is not None for c in caches)
        batch = BatchCache(engine.model, [c for c in caches if c is not None])
        ids = torch.tensor([[s.ids[-1]] for s in rows], dtype=torch.long, device=engine.device)
        positions = torch.tensor(
            [[c.seq_len] for c in caches if c is not None], dtype=torch.long, device=engine.device
        )  # [B, 1]: each row's own next position
        try:
            out = engine.model(
                ids, position_ids=positions, cache=batch, use_cache=True, logits_to_keep=1
            )
        except Exception as exc:
            # Which row failed is unknown: every row of the step fails, the engine goes on.
            for seq in rows:
                self.running.remove(seq)
                if seq.cache is not None:
                    seq.cache.close()
                    seq.cache = None
                self._fail(seq, exc)
            return
        engine._count("decode_steps")
        engine._count("decode_rows", len(rows))
        engine._observe_batch(len(rows))
        logits = out.logits[:, -1]  # [B, V]
        for b, seq in enumerate(rows):
            self._postprocess(seq, logits[b])

    # ---- postprocess -----------------------------------------------------------------------

    def _postprocess(self, seq: _Sequence, logits: torch.Tensor) -> None:
        params = seq.handle.request.params
        token = sample(logits, params, seq.generator)
        last = seq.last_token_s if seq.generated else seq.handle.request.arrival_s
        reason, seq.last_token_s = self.engine._emit(
            seq.handle, seq.text, seq.generated, token, last
        )
        seq.generated += 1
        seq.ids.append(token)
        if reason is not None:
            self.running.remove(seq)
            assert seq.cache is not None
            self._release(seq.cache)
            seq.cache = None
            self._sync_counts()

    def _release(self, cache: TieredCache) -> None:
        cache.reset()
        self.idle.append(cache)

    def _finish_cancelled(self, seq: _Sequence) -> None:
        self.engine._count("cancelled")
        seq.handle.put(TokenEvent(seq.handle.request_id, None, "", True, "cancelled"))

    def _fail(self, seq: _Sequence, exc: Exception) -> None:
        self.engine._count("failed")
        seq.handle.fail(exc)
        self._sync_counts()

    def _sync_counts(self) -> None:
        """Publish who runs and how many wait to resume (for ``stats`` and ``close``)."""
        engine = self.engine
        with engine._cond:
            engine._running = [s.handle for s in self.running]
            engine._resuming = [s.handle for s in self.preempted]
