"""Continuous batching: what the engine's worker runs.

Every ``step`` reads schedule → run → postprocess:

1. **schedule**: start disk→host prefetches for queued requests' cached chunks; admit the
   oldest waiting sequences while the device budget has room for their caches (each
   running sequence holds one ``SequenceKV`` of ``cache.device_budget_bytes``); when the
   oldest has waited ``preempt_after_s`` and nothing fits, preempt the youngest decoding
   sequence that has run that long, once no admitted sequence is still prefilling (its
   sealed chunks are already in host and stay there or go down to disk; it resumes later
   through ``reuse_prefix``).
2. **run**: one forward over the step's tokens packed in one row (``kvtier.hf.PackedCache``): the
   next prefill piece (whole chunks) of the oldest admitted sequences still prefilling
   (one chunk, or up to ``prefill_tokens_per_step`` tokens), and the last token of every
   decoding sequence (different lengths, no padding).
3. **postprocess**: sample each row with its own parameters and generator, stream the
   token, finish or keep each sequence.

Isolation: every per-request part of a step (setting up its generator and text stream,
prefetching, admission, the forward, sampling, stop strings and detokenizing) is guarded
on its own. A request that fails there fails alone, once, and leaves the queue; the
others' tokens are unaffected. A cancelled request leaves at the next step.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from typing import TYPE_CHECKING

import torch

from kvtier.engine.cache_pool import CachePool
from kvtier.engine.request import RequestHandle, TokenEvent
from kvtier.engine.sampling import TextStream, make_generator, sample, token_logprobs
from kvtier.engine.sequence import Sequence
from kvtier.hf import PackedCache
from kvtier.kv.chunk import ChunkRef
from kvtier.tiers import ChunkLostError

if TYPE_CHECKING:
    from kvtier.engine.engine import Engine

log = logging.getLogger(__name__)

# Times one sequence may resume after losing KV from every tier before it fails.
_MAX_RECOVERIES = 3


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
        self.running: list[Sequence] = []
        self.preempted: deque[Sequence] = deque()  # waiting to resume, oldest first
        self.caches = CachePool(engine._new_cache, self.max_running, self._piece_chunks)
        self._warm_up()
        self._admissions = itertools.count()
        self._known: dict[RequestHandle, Sequence] = {}  # queued requests seen so far

    @property
    def busy(self) -> bool:
        """Sequences are running or waiting to resume."""
        return bool(self.running or self.preempted)

    def step(self) -> None:
        """One scheduling step: schedule, then one forward of every running sequence."""
        self._drop_cancelled()
        self._schedule()
        if self.running:
            self._run(self._pieces())

    def _pieces(self) -> list[tuple[Sequence, int, int]]:
        """This step's work: ``(sequence, start, stop)`` of the ids each one feeds.

        Prefilling sequences, oldest first, give their next piece while the step's prefill
        budget lasts (at least one piece); every decoding sequence gives its last token.
        """
        budget = self.config.prefill_tokens_per_step or self.chunk_tokens
        work: list[tuple[Sequence, int, int]] = []
        spent = 0
        prefilling = sorted((s for s in self.running if not s.decoding), key=lambda s: s.admitted)
        for seq in prefilling:
            start, stop = seq.pieces[0]
            if work and spent + stop - start > budget:
                break
            seq.pieces.popleft()
            work.append((seq, start, stop))
            spent += stop - start
        end = len(work)
        for seq in self.running:
            if seq.decoding:
                work.append((seq, len(seq.ids) - 1, len(seq.ids)))
        if end < len(work):
            self.engine.counters.add("decode_steps")
            self.engine.counters.add("decode_rows", len(work) - end)
            self.engine.counters.observe_batch(len(work) - end)
        return work

    def close(self) -> None:
        """Release every cache (engine close, after the worker has exited)."""
        self.caches.close()
        self.running = []

    def fail_all(self, exc: Exception) -> None:
        """End every running and preempted sequence with ``exc``; replace their caches."""
        for seq in [*self.running, *self.preempted]:
            if seq.cache is not None:
                self.caches.replace(seq.cache)
                seq.cache = None
            self._fail(seq, exc)
        self.running, self.preempted = [], deque()
        self._sync_counts()

    # ---- schedule --------------------------------------------------------------------------

    def _drop_cancelled(self) -> None:
        """End the running and preempted sequences whose client cancelled (or went away)."""
        for seq in [s for s in self.running if s.handle.cancelled]:
            self._drop(seq)
            self._finish_cancelled(seq)
        for seq in [s for s in self.preempted if s.handle.cancelled]:
            self.preempted.remove(seq)
            self._finish_cancelled(seq)
        self._sync_counts()

    def _schedule(self) -> None:
        engine = self.engine
        with engine._cond:
            queued = list(engine._queue)
        for handle in queued[: 2 * self.max_running]:
            if (seq := self._sequence_of(handle)) is not None:
                self._prefetch(seq)
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
            if any(s.suspect for s in self.running) or (seq.suspect and self.running):
                break  # a sequence under suspicion runs alone
            if len(self.running) >= self.max_running and not self._preempt_for(seq):
                break
            self._take(seq)
            self._admit(seq)

    def _sequence_of(self, handle: RequestHandle) -> Sequence | None:
        """The scheduler's state of a queued request, set up on first sight; None when the
        set-up failed (the request then failed and left the queue)."""
        seq = self._known.get(handle)
        if seq is None:
            request = handle.request
            params = request.params
            try:
                generator = None if params.greedy else make_generator(params.seed)
                text = TextStream(self.engine.tokenizer, params.stop, request.prompt_ids)
            except Exception as exc:
                with self.engine._cond:
                    self.engine._queue.remove(handle)
                self.engine.counters.add("failed")
                handle.fail(exc)
                self._sync_counts()
                return None
            seq = Sequence(handle, list(request.prompt_ids), text, generator, request.arrival_s)
            self._known[handle] = seq
        return seq

    def _oldest_waiting(self) -> Sequence | None:
        engine = self.engine
        fresh: Sequence | None = None
        while fresh is None:
            with engine._cond:
                head = engine._queue[0] if engine._queue else None
            if head is None:
                break
            fresh = self._sequence_of(head)  # None: it failed and left; look again
        resumed = self.preempted[0] if self.preempted else None
        if fresh is None or resumed is None or resumed.suspect:
            return resumed or fresh
        return resumed if resumed.waiting_since_s <= fresh.waiting_since_s else fresh

    def _take(self, seq: Sequence) -> None:
        """Remove ``seq`` from whichever waiting line holds it."""
        engine = self.engine
        if self.preempted and self.preempted[0] is seq:
            self.preempted.popleft()
        else:
            with engine._cond:
                engine._queue.popleft()
            self._known.pop(seq.handle, None)
        self._sync_counts()

    def _preempt_for(self, seq: Sequence) -> bool:
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
        self.caches.give_back(victim.cache)  # sealed chunks stay in host (and disk) for the resume
        victim.cache = None
        victim.decoding = False
        victim.waiting_since_s = time.perf_counter()
        victim.prefetched = False
        self.preempted.append(victim)
        self._sync_counts()
        self.engine.counters.add("preemptions")
        return True

    def _prefetch(self, seq: Sequence) -> None:
        """Start moving the cached chunks of a waiting sequence's prefix disk → host.

        Only a hint: a failure here is logged and admission looks the prefix up again."""
        if seq.prefetched:
            return
        seq.prefetched = True
        manager = self.engine.manager
        if manager.disk is None:
            return
        limit = ((len(seq.ids) - 1) // self.chunk_tokens) * self.chunk_tokens
        try:
            refs: list[ChunkRef] = []
            for ref in manager.refs_for(seq.ids[:limit], seq.handle.request.cache_salt):
                if manager.locate(ref) is None:
                    break
                refs.append(ref)
            todo = [r for r in refs if not manager.host.contains(r)]
            if todo and manager.prefetch_to_host(todo) is not None:
                self.engine.counters.add("prefetched_chunks", len(todo))
        except Exception:
            log.exception(
                "prefetch for request %s failed; it loads on admission", seq.handle.request_id
            )

    def _admit(self, seq: Sequence) -> None:
        engine = self.engine
        cache = self.caches.take()
        first = seq.admissions == 0
        salt = seq.handle.request.cache_salt
        try:
            tiers = engine._prefix_tiers(seq.ids, salt) if first else []
            reused = cache.reuse_prefix(torch.tensor([seq.ids], dtype=torch.long), salt)
        except Exception as exc:
            self.caches.replace(cache)
            self._fail(seq, exc)
            return
        if first:
            seq.handle.reused_tokens = reused
            engine.counters.add_prompt(len(seq.ids), reused, tiers, self.chunk_tokens)
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

    def _run(self, work: list[tuple[Sequence, int, int]]) -> None:
        """One forward over every sequence's new tokens, packed in one row; then sample the
        sequences whose prompt is complete (decoding ones, and prefills' last pieces)."""
        engine = self.engine
        ids: list[int] = []
        positions: list[int] = []
        logit_rows: list[int] = []  # packed index of each sampled sequence's last token
        sampled: list[Sequence] = []
        for seq, start, stop in work:
            cache = seq.cache
            assert cache is not None
            ids.extend(seq.ids[start:stop])
            positions.extend(range(cache.seq_len, cache.seq_len + stop - start))
            if seq.decoding or not seq.pieces:
                logit_rows.append(len(ids) - 1)
                sampled.append(seq)
        caches = [seq.cache for seq, _, _ in work if seq.cache is not None]
        batch = PackedCache(caches, [stop - start for _, start, stop in work])
        device = engine.device
        try:
            out = engine.model(
                torch.tensor([ids], dtype=torch.long, device=device),
                position_ids=torch.tensor([positions], dtype=torch.long, device=device),
                cache=batch,
                use_cache=True,
                logits_to_keep=torch.tensor(logit_rows or [len(ids) - 1], device=device),
            )
        except Exception as exc:
            self._step_failed([seq for seq, _, _ in work], exc)
            return
        for seq, _, _ in work:
            seq.suspect = False
        logits = out.logits[0]  # [len(logit_rows), V]
        for i, seq in enumerate(sampled):
            seq.decoding = True
            try:
                self._postprocess(seq, logits[i])
            except Exception as exc:  # sampling or detokenizing this request: it alone fails
                self._drop(seq)
                self._fail(seq, exc)

    def _step_failed(self, seqs: list[Sequence], exc: Exception) -> None:
        """A forward raised. Alone, its sequence fails. Packed with others, which one
        failed is unknown: each goes back to wait (first in line) and retries alone, so
        only a sequence that fails on its own fails; the others resume from the KV their
        sealed chunks left in the tiers, like a preempted sequence."""
        for seq in seqs:
            self.running.remove(seq)
            if seq.cache is not None:
                self.caches.replace(seq.cache)  # its state is unknown after the error
                seq.cache = None
        if len(seqs) == 1:
            seq = seqs[0]
            if isinstance(exc, ChunkLostError) and seq.recoveries < _MAX_RECOVERIES:
                # Storage lost some of its KV (corrupt, or evicted from every tier): resume
                # it, recomputing from the last chunk still held.
                seq.recoveries += 1
                self._requeue(seq, suspect=False)
                self.engine.counters.add("recovered_sequences")
                self._sync_counts()
                return
            self._fail(seq, exc)
            return
        for seq in reversed(seqs):
            self._requeue(seq, suspect=True)
        self.engine.counters.add("isolated_failures")
        self._sync_counts()

    def _requeue(self, seq: Sequence, suspect: bool) -> None:
        """Send a sequence whose cache was dropped back to wait, first in line; it resumes
        through ``reuse_prefix`` from the chunks the tiers still hold."""
        seq.suspect, seq.decoding, seq.prefetched = suspect, False, False
        seq.pieces.clear()
        self.preempted.appendleft(seq)

    # ---- postprocess -----------------------------------------------------------------------

    def _postprocess(self, seq: Sequence, logits: torch.Tensor) -> None:
        params = seq.handle.request.params
        token = sample(logits, params, seq.generator)
        logprobs = (
            None if params.logprobs is None else token_logprobs(logits, token, params.logprobs)
        )
        last = seq.last_token_s if seq.generated else seq.handle.request.arrival_s
        reason, seq.last_token_s = self.engine._emit(
            seq.handle, seq.text, seq.generated, token, last, logprobs
        )
        seq.generated += 1
        seq.ids.append(token)
        if reason is not None:
            self._drop(seq)

    def _drop(self, seq: Sequence) -> None:
        """Take a running sequence out of the batch and keep its cache for the next one."""
        if seq in self.running:
            self.running.remove(seq)
        if seq.cache is not None:
            self.caches.give_back(seq.cache)
            seq.cache = None
        self._sync_counts()

    def _warm_up(self) -> None:
        """One throw-away forward as large as the largest step (the prefill budget plus a
        token per running sequence), with no cache, before any request.

        Like a GPU server's profiling run at start: the allocator then holds buffers of the
        step's activation sizes, so the first requests do not pay the first touch of fresh
        memory (about 2 s of a 4K-token step's 6.8 s on this machine).
        """
        budget = self.config.prefill_tokens_per_step or self.chunk_tokens
        tokens = max(budget, self._piece_chunks * self.chunk_tokens)
        ids = torch.zeros(1, tokens + self.max_running, dtype=torch.long, device=self.engine.device)
        with torch.no_grad():
            self.engine.model(ids, use_cache=False, logits_to_keep=1)

    def _finish_cancelled(self, seq: Sequence) -> None:
        self.engine.counters.add("cancelled")
        seq.handle.put(TokenEvent(seq.handle.request_id, None, "", True, "cancelled"))

    def _fail(self, seq: Sequence, exc: Exception) -> None:
        self.engine.counters.add("failed")
        seq.handle.fail(exc)
        self._sync_counts()

    def _sync_counts(self) -> None:
        """Publish who runs and how many wait to resume (for ``stats`` and ``close``)."""
        engine = self.engine
        with engine._cond:
            engine._running = [s.handle for s in self.running]
            engine._resuming = [s.handle for s in self.preempted]
