"""The engine's counters and latency histograms: one ``EngineMetrics`` object that the
``Engine`` (submissions, rejections) and its scheduler (admissions, tokens, steps, faults)
both write, and ``Engine.stats`` reads as a consistent snapshot.

Owns and mutates only its own counts. Thread-safe: every method takes one lock (each
histogram has its own). Histograms have fixed buckets (what Prometheus exposes) and also
keep the most recent samples, so benchmarks can report exact percentiles without unbounded
memory.
"""

from __future__ import annotations

import bisect
import threading
from collections import deque
from collections.abc import Sequence

from kvtier.engine.stats import EngineStats, HistogramSnapshot
from kvtier.manager import ManagerStats
from kvtier.runtime import CacheStats
from kvtier.runtime.ledger import DecisionCost

# Seconds; spans an inter-token gap on a GPU to a long prefill behind a queue on a CPU.
LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    30.0,
    60.0,
)


class LatencyHistogram:
    """A thread-safe latency histogram with fixed buckets and a window of recent samples."""

    def __init__(
        self, bounds_s: tuple[float, ...] = LATENCY_BUCKETS_S, keep_recent: int = 10_000
    ) -> None:
        self.bounds_s = bounds_s
        self.keep_recent = keep_recent
        self._lock = threading.Lock()
        self._counts = [0] * (len(bounds_s) + 1)
        self._sum_s = 0.0
        self._count = 0
        self._recent: deque[float] = deque(maxlen=keep_recent)

    def observe(self, seconds: float) -> None:
        with self._lock:
            self._counts[bisect.bisect_left(self.bounds_s, seconds)] += 1
            self._sum_s += seconds
            self._count += 1
            self._recent.append(seconds)

    def snapshot(self) -> HistogramSnapshot:
        with self._lock:
            return HistogramSnapshot(
                self.bounds_s, tuple(self._counts), self._sum_s, self._count, tuple(self._recent)
            )


COUNTER_NAMES = (
    "submitted",
    "finished",
    "cancelled",
    "failed",
    "rejected",
    "prompt_tokens",
    "generated_tokens",
    "reused_tokens",
    "decode_steps",
    "decode_rows",
    "preemptions",
    "prefetched_chunks",
    "isolated_failures",
    "recovered_sequences",
)


class EngineMetrics:
    """The engine's counters and latency histograms, written by ``Engine.submit`` and by
    the scheduler on the worker, read by ``Engine.stats``. Every method is thread-safe
    (one lock; the histograms have their own).

    Attributes:
        ttft: submission → first token, per request.
        inter_token: the gap between consecutive tokens of a request.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(COUNTER_NAMES, 0)
        self._reused_by_tier: dict[str, int] = {}
        self._decisions: dict[str, DecisionCost] = {}
        self._max_decode_batch = 0
        self._service_s: float | None = None  # moving average of arrival → finish
        self.ttft = LatencyHistogram()
        self.inter_token = LatencyHistogram()

    def add(self, name: str, amount: int = 1) -> None:
        """Add ``amount`` to the counter ``name`` (one of ``COUNTER_NAMES``)."""
        with self._lock:
            self._counts[name] += amount

    def add_prompt(
        self, prompt_tokens: int, reused_tokens: int, tiers: Sequence[str], chunk_tokens: int
    ) -> None:
        """An admitted prompt: its tokens, those adopted from the tiers, and the tier of
        each chunk adopted (see ``add_reused``)."""
        with self._lock:
            self._counts["prompt_tokens"] += prompt_tokens
        self.add_reused(reused_tokens, tiers, chunk_tokens)

    def add_reused(self, reused_tokens: int, tiers: Sequence[str], chunk_tokens: int) -> None:
        """Prompt tokens adopted from the tiers (at admission, or later: the back of a
        prefix that loaded while its front was computed), with the tier that held each of
        their chunks in order: ``chunk_tokens`` each, the last one the rest (the pages of a
        partial chunk); tiers past the tokens are ignored."""
        with self._lock:
            self._counts["reused_tokens"] += reused_tokens
            for i, name in enumerate(tiers):
                tokens = min(chunk_tokens, reused_tokens - i * chunk_tokens)
                if tokens <= 0:
                    break
                self._reused_by_tier[name] = self._reused_by_tier.get(name, 0) + tokens

    def add_decision(self, name: str, cost: DecisionCost) -> None:
        """One reuse decision's chunks and seconds (``kvtier.engine.overlap``)."""
        with self._lock:
            self._decisions = DecisionCost.total([self._decisions, {name: cost}])

    def observe_batch(self, rows: int) -> None:
        """A decode forward of ``rows`` sequences."""
        with self._lock:
            self._max_decode_batch = max(self._max_decode_batch, rows)

    def observe_service(self, seconds: float) -> None:
        """A request that ended ``seconds`` after its arrival."""
        with self._lock:
            last = self._service_s
            self._service_s = seconds if last is None else 0.8 * last + 0.2 * seconds

    @property
    def service_s(self) -> float | None:
        """The moving average of arrival → finish (None before any request ended)."""
        with self._lock:
            return self._service_s

    def stats(
        self,
        queue_depth: int,
        running: int,
        manager: ManagerStats | None,
        cache: CacheStats | None,
    ) -> EngineStats:
        """A snapshot of every counter and histogram, with the occupancy and the tiers'
        stats the caller read (see ``EngineStats`` for each field)."""
        with self._lock:
            counts, by_tier = dict(self._counts), dict(self._reused_by_tier)
            decisions = dict(self._decisions)
            max_batch = self._max_decode_batch
        return EngineStats(
            requests_submitted=counts["submitted"],
            requests_finished=counts["finished"],
            requests_cancelled=counts["cancelled"],
            requests_failed=counts["failed"],
            requests_rejected=counts["rejected"],
            queue_depth=queue_depth,
            running=running,
            prompt_tokens=counts["prompt_tokens"],
            generated_tokens=counts["generated_tokens"],
            reused_tokens=counts["reused_tokens"],
            reused_tokens_by_tier=by_tier,
            ttft=self.ttft.snapshot(),
            inter_token=self.inter_token.snapshot(),
            manager=manager,
            cache=cache,
            decode_steps=counts["decode_steps"],
            decode_rows=counts["decode_rows"],
            max_decode_batch=max_batch,
            preemptions=counts["preemptions"],
            prefetched_chunks=counts["prefetched_chunks"],
            isolated_failures=counts["isolated_failures"],
            recovered_sequences=counts["recovered_sequences"],
            reuse_decisions=decisions,
        )
