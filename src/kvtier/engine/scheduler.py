"""Continuous batching: the scheduler owns the waiting, running and preempted sequences and
runs the engine's step.

Every ``step`` reads schedule → run → postprocess:

1. **schedule**: end cancelled sequences; start disk → host prefetches for the first
   waiting sequences' cached chunks (their one prefix match, kept on the sequence); admit
   the oldest waiting sequences while a cache is free (each running sequence holds one
   ``SequenceKV`` of ``cache.device_budget_bytes``) and the host tier holds the sealed
   chunks of all of them at their longest, preempting when due
   (``kvtier.engine.policy``); admission adopts the cached prefix, or its host part and
   later the rest (``kvtier.engine.overlap``: the front computes while the back loads).
   Then pick the step's pieces: the next prefill piece (whole chunks) of the oldest
   admitted sequences still prefilling (one chunk, or up to ``prefill_tokens_per_step``
   tokens; first adopting a loaded back), and the last token of every decoding sequence.
2. **run**: one forward over those pieces packed in one row (``kvtier.engine.runner``),
   timed: the work model (``kvtier.engine.work``) that admission predicts with learns
   from it.
3. **postprocess**: sample each row with its own parameters and generator, stream the
   token, finish or keep each sequence (``kvtier.engine.postprocess``).

Isolation: every per-request part of a step (its generator and text stream, prefetching,
admission, the forward, sampling, stop strings and detokenizing) is guarded on its own. A
request that fails there fails alone, once, and leaves; the others' tokens are unaffected.
A cancelled request leaves at the next step.

Mutates its lines, the sequences, the caches it takes from its ``CachePool``, the metrics,
and publishes its lines to the ``Handoff`` after every change. Worker thread only.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from kvtier.engine.cache_pool import CachePool
from kvtier.engine.config import EngineConfig
from kvtier.engine.handoff import Handoff
from kvtier.engine.metrics import EngineMetrics
from kvtier.engine.overlap import ReuseOverlap
from kvtier.engine.policy import choose_victim, next_in_line
from kvtier.engine.postprocess import postprocess
from kvtier.engine.prefix import PrefixMatcher
from kvtier.engine.request import RequestHandle, TokenEvent
from kvtier.engine.runner import LlamaRunner, ModelRunner, Sampled
from kvtier.engine.sequence import Piece, Sequence, start_sequence
from kvtier.manager import KVManager
from kvtier.runtime import SequenceKV
from kvtier.tiers import ChunkLostError

log = logging.getLogger(__name__)

# Times one sequence may resume after losing KV from every tier before it fails.
_MAX_RECOVERIES = 3


class BatchScheduler:
    """Runs the engine's requests with continuous batching; worker thread only.

    Reserves ``config.max_running`` caches from ``new_cache`` and warms the model up when
    built (the device budget is taken at start).

    Args:
        runner: runs the model.
        tokenizer: for each sequence's text stream.
        manager: the shared tiers (prefix lookups, prefetches).
        config: batch size, prefill budget, preemption.
        new_cache: builds the unreserved ``SequenceKV`` of seat ``i``.
        handoff: where the worker takes submitted handles from; the scheduler publishes
            its lines there.
        metrics: the engine's counters and histograms.
        eos_ids: token ids that end a sequence (unless ``ignore_eos``).
    """

    def __init__(
        self,
        runner: ModelRunner | LlamaRunner,
        tokenizer: Any,
        manager: KVManager,
        config: EngineConfig,
        new_cache: Callable[[int], SequenceKV],
        handoff: Handoff,
        metrics: EngineMetrics,
        eos_ids: frozenset[int],
    ) -> None:
        self.runner, self.tokenizer, self.config = runner, tokenizer, config
        self.handoff, self.metrics, self.eos_ids = handoff, metrics, eos_ids
        self.max_running = config.max_running
        self.chunk_tokens = manager.layout.chunk_tokens
        self.prefill_budget_tokens = config.prefill_tokens_per_step or self.chunk_tokens
        # Chunks per prefill forward: one, or as many as the step's prefill budget holds.
        self._piece_chunks = max(1, self.prefill_budget_tokens // self.chunk_tokens)
        self.prefixes = PrefixMatcher(manager, metrics)
        piece_tokens = self._piece_chunks * self.chunk_tokens
        self.overlap = ReuseOverlap(
            manager, handoff.work, metrics, piece_tokens, config.reuse_overlap
        )
        self.waiting: deque[Sequence] = deque()  # submitted, oldest first
        self.running: list[Sequence] = []
        self.preempted: deque[Sequence] = deque()  # waiting to resume, oldest first
        self.caches = CachePool(new_cache, self.max_running, self._piece_chunks)
        self.host_slots = manager.host.num_slots
        tokens = max(self.prefill_budget_tokens, self._piece_chunks * self.chunk_tokens)
        self._warm_up(tokens + self.max_running)
        self._admissions = itertools.count()
        self._steps = 0

    def _warm_up(self, largest: int) -> None:
        """The largest step once (the allocator then holds its buffers) and a step of one
        token per seat; their times seed the work model that admission predicts with."""
        start = time.perf_counter()
        self.runner.warm_up(largest)
        prefill_s = (time.perf_counter() - start) / largest
        start = time.perf_counter()
        self.runner.warm_up(self.max_running)
        decode_s = (time.perf_counter() - start) / self.max_running
        self.handoff.work.seed(prefill_s, decode_s)

    @property
    def busy(self) -> bool:
        """Sequences wait, run or wait to resume."""
        return bool(self.waiting or self.running or self.preempted)

    def add(self, handles: Iterable[RequestHandle]) -> None:
        """Put newly submitted requests at the end of the waiting line; one whose set-up
        (generator, text stream) raises fails alone."""
        for handle in handles:
            try:
                self.waiting.append(start_sequence(handle, self.tokenizer))
            except Exception as exc:
                self.metrics.add("failed")
                handle.fail(exc)
        self._publish()

    def step(self) -> None:
        """One step: schedule, run one forward of the step's pieces, postprocess."""
        self._steps += 1
        work = self._schedule()
        if not work:
            return
        start = time.perf_counter()
        try:
            out = self.runner.run(work)
        except Exception as exc:
            self._step_failed([piece.seq for piece in work], exc)
            return
        seconds = time.perf_counter() - start
        prefill = [p for p in work if not p.seq.decoding]
        pairs = sum((p.stop - p.start) * (p.start + p.stop) / 2 for p in prefill)
        self.handoff.work.observe_step(
            sum(p.stop - p.start for p in prefill), len(work) - len(prefill), seconds, pairs
        )
        for piece in work:
            piece.seq.suspect = False
        self._postprocess(out)

    def fail_all(self, exc: Exception) -> None:
        """End every running and preempted sequence with ``exc``; replace their caches."""
        for seq in [*self.running, *self.preempted]:
            if seq.cache is not None:
                self.caches.replace(seq.cache)
                seq.cache = None
            self._fail(seq, exc)
        self.running, self.preempted = [], deque()
        self._publish()

    def close(self) -> None:
        """Release every cache (engine close, after the worker has exited)."""
        self.caches.close()
        self.running = []

    # ---- schedule --------------------------------------------------------------------------

    def _schedule(self) -> list[Piece]:
        self._drop_cancelled()
        for ahead in (*itertools.islice(self.waiting, 2 * self.max_running), *self.preempted):
            self.prefixes.prefetch(ahead, self._steps)
        while (seq := next_in_line(self.waiting, self.preempted)) is not None:
            if any(s.suspect for s in self.running) or (seq.suspect and self.running):
                break  # a sequence under suspicion runs alone
            if len(self.running) >= self.max_running and not self._preempt_for(seq):
                break
            if self.running and not self._host_holds(seq):
                break  # it waits until running sequences leave room in the host tier
            if self.preempted and self.preempted[0] is seq:
                self.preempted.popleft()
            else:
                self.waiting.popleft()
            self._admit(seq)
        return self._pieces()

    def _host_holds(self, seq: Sequence) -> bool:
        """The host tier holds the sealed chunks of every running sequence and ``seq`` at
        their longest (prompt plus ``max_tokens``): admitted together they do not evict
        each other's KV (which would be recomputed)."""

        def chunks(s: Sequence) -> int:
            request = s.handle.request
            return (len(request.prompt_ids) + request.params.max_tokens) // self.chunk_tokens

        return sum(chunks(s) for s in self.running) + chunks(seq) <= self.host_slots

    def _drop_cancelled(self) -> None:
        """End the sequences whose client cancelled (or went away), wherever they are."""
        for seq in [s for s in self.running if s.handle.cancelled]:
            self._drop(seq)
            self._finish_cancelled(seq)
        for line in (self.waiting, self.preempted):
            for seq in [s for s in line if s.handle.cancelled]:
                line.remove(seq)
                self._finish_cancelled(seq)
        self._publish()

    def _preempt_for(self, seq: Sequence) -> bool:
        """Make room for ``seq`` by preempting a running sequence, if one is due
        (``choose_victim``); its sealed chunks stay in host (and disk) for the resume."""
        victim = choose_victim(seq, self.running, self.config.preempt_after_s)
        if victim is None:
            return False
        self.running.remove(victim)
        assert victim.cache is not None
        self._seal_pages(victim)  # its resume then recomputes less than a page
        self.caches.give_back(victim.cache)
        victim.wait_again()
        victim.waiting_since_s = time.perf_counter()
        self.preempted.append(victim)
        self.metrics.add("preemptions")
        self._publish()
        return True

    def _admit(self, seq: Sequence) -> None:
        """Give ``seq`` a cache, adopt its cached prefix through its one prefix match, and
        plan its prefill in pieces; a failure here fails it alone."""
        cache = self.caches.take()
        first = seq.admissions == 0  # a resume's prompt was counted at its first admission
        try:
            match = self.prefixes.match(seq, cache, self._steps)
            reused_tokens, seq.back = self.overlap.adopt(cache, seq.ids, seq.handle, match, first)
        except Exception as exc:
            self.caches.replace(cache)
            self._fail(seq, exc)
            return
        if first:
            seq.handle.reused_tokens = reused_tokens
            size = self.chunk_tokens
            tiers = match.tiers[: reused_tokens // size]  # a fault may have cut them short
            if reused_tokens % size and cache.pages_tier is not None:
                tiers = [*tiers, cache.pages_tier]
            self.metrics.add_prompt(len(seq.ids), reused_tokens, tiers, size)
        seq.cache = cache
        seq.admitted = next(self._admissions)
        seq.admitted_s = time.perf_counter()
        seq.admissions += 1
        self._plan_prefill(seq)
        self.running.append(seq)
        self._publish()

    def _plan_prefill(self, seq: Sequence) -> None:
        """Split the rest of ``seq``'s prompt (after what its cache holds) into pieces."""
        assert seq.cache is not None
        seq.pieces.clear()
        size = self.chunk_tokens
        pos, end = seq.cache.seq_len, len(seq.ids)
        while pos < end:  # pieces end on chunk boundaries, so each seals whole chunks
            stop = min(end, (pos // size + self._piece_chunks) * size)
            seq.pieces.append((pos, stop))
            pos = stop

    def _meet(self, seq: Sequence) -> None:
        """Before ``seq``'s next piece: adopt its prefix's back if it has loaded (a
        failure leaves it to compute: only an optimisation)."""
        back, cache = seq.back, seq.cache
        assert back is not None and cache is not None
        try:
            settled, adopted = self.overlap.meet(cache, seq.ids, back)
        except Exception:
            log.exception("request %s: adopting loaded chunks failed", seq.handle.request_id)
            settled, adopted = True, 0
        if settled:
            seq.back = None
        if adopted:
            self._plan_prefill(seq)

    def _pieces(self) -> list[Piece]:
        """This step's work. Prefilling sequences, oldest first, give their next piece
        while the step's prefill budget lasts (at least one piece); every decoding
        sequence gives its last token."""
        work: list[Piece] = []
        spent = 0
        prefilling = sorted((s for s in self.running if not s.decoding), key=lambda s: s.admitted)
        for seq in prefilling:
            if seq.back is not None:
                self._meet(seq)
            start, stop = seq.pieces[0]
            if work and spent + stop - start > self.prefill_budget_tokens:
                break
            seq.pieces.popleft()
            work.append(Piece(seq, start, stop))
            spent += stop - start
        prefill_rows = len(work)
        work += [Piece(s, len(s.ids) - 1, len(s.ids)) for s in self.running if s.decoding]
        if (decode_rows := len(work) - prefill_rows) > 0:
            self.metrics.add("decode_steps")
            self.metrics.add("decode_rows", decode_rows)
            self.metrics.observe_batch(decode_rows)
        return work

    # ---- run: a failed forward -------------------------------------------------------------

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
                seq.wait_again()
                self.preempted.appendleft(seq)
                self.metrics.add("recovered_sequences")
                self._publish()
                return
            self._fail(seq, exc)
            return
        log.warning("a step of %d failed (%r); each retries alone", len(seqs), exc, exc_info=exc)
        for seq in reversed(seqs):
            seq.wait_again(suspect=True)
            self.preempted.appendleft(seq)
        self.metrics.add("isolated_failures")
        self._publish()

    # ---- postprocess -----------------------------------------------------------------------

    def _postprocess(self, out: Sampled) -> None:
        for seq, logits in zip(out.seqs, out.logits, strict=False):
            if not seq.decoding:  # the prompt is in: the same prompt again reuses its pages
                self._seal_pages(seq, prompt_end=True)
            seq.decoding = True
            try:
                if postprocess(seq, logits, self.eos_ids, self.metrics) is not None:
                    self._drop(seq)
            except Exception as exc:  # sampling or detokenizing this request: it alone fails
                self._drop(seq)
                self._fail(seq, exc)

    def _drop(self, seq: Sequence) -> None:
        """Take a running sequence out of the batch and keep its cache for the next one."""
        if seq in self.running:
            self.running.remove(seq)
        if seq.cache is not None:
            self._seal_pages(seq)  # the next turn reuses the tail's whole pages
            self.caches.give_back(seq.cache)
            seq.cache = None
        self._publish()

    def _seal_pages(self, seq: Sequence, prompt_end: bool = False) -> None:
        """Store the whole pages of ``seq``'s tail as a partial chunk (``prompt_end``: only
        those a prompt of this length can reuse). Only an optimisation: a failure is
        logged, never the request's."""
        cache = seq.cache
        if cache is None:
            return
        page = cache.config.page_tokens
        upto = ((len(seq.ids) - 1) // page) * page if prompt_end else None
        try:
            cache.seal_partial(upto)
        except Exception:
            log.exception("storing the last pages of request %s failed", seq.handle.request_id)

    def _finish_cancelled(self, seq: Sequence) -> None:
        self.metrics.add("cancelled")
        seq.handle.put(TokenEvent(seq.handle.request_id, None, "", True, "cancelled"))

    def _fail(self, seq: Sequence, exc: Exception) -> None:
        """End ``seq`` with ``exc``, logged with its traceback for the operator."""
        log.error("request %s failed: %r", seq.handle.request_id, exc, exc_info=exc)
        self.metrics.add("failed")
        seq.handle.fail(exc)
        self._publish()

    def _publish(self) -> None:
        """Tell the hand-off who waits, runs and waits to resume (stats, bound, cancels)."""
        self.handoff.publish(
            (s.handle for s in self.waiting),
            (s.handle for s in self.running),
            (s.handle for s in self.preempted),
        )
