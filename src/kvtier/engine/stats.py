"""Engine counters and latency histograms, read as consistent snapshots.

Histograms have fixed buckets (what Prometheus exposes) and also keep the most recent
samples, so benchmarks can report exact percentiles without unbounded memory.
"""

from __future__ import annotations

import bisect
import threading
from collections import deque
from dataclasses import dataclass, field

from kvtier.manager import ManagerStats
from kvtier.runtime import CacheStats

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


@dataclass(frozen=True)
class HistogramSnapshot:
    """A histogram at one moment.

    Attributes:
        bounds_s: upper bounds of the buckets (seconds); an implicit +Inf bucket follows.
        counts: samples per bucket, not cumulative; one more entry than ``bounds_s``.
        sum_s: sum of every sample.
        count: number of samples.
        recent_s: the most recent samples (at most ``LatencyHistogram.keep_recent``).
    """

    bounds_s: tuple[float, ...]
    counts: tuple[int, ...]
    sum_s: float
    count: int
    recent_s: tuple[float, ...] = ()

    def percentile(self, q: float) -> float:
        """The ``q``-th percentile (0-100) of the recent samples; 0.0 when empty."""
        if not self.recent_s:
            return 0.0
        ordered = sorted(self.recent_s)
        index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
        return ordered[index]


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


@dataclass(frozen=True)
class EngineStats:
    """What the engine has done so far.

    Attributes:
        requests_submitted: requests accepted into the queue.
        requests_finished: requests that ended with ``stop`` or ``length``.
        requests_cancelled: requests cancelled by their caller.
        requests_failed: requests that raised inside the engine.
        requests_rejected: ``submit`` calls refused because the queue was full.
        queue_depth: requests waiting for admission now.
        running: requests being generated now.
        prompt_tokens: prompt tokens of admitted requests.
        generated_tokens: tokens generated.
        reused_tokens: prompt tokens whose KV was adopted from the tiers, not computed.
        reused_tokens_by_tier: the same, by the tier that held each chunk at admission.
        ttft: time to first token, from submission (queueing included).
        inter_token: time between consecutive tokens of a request.
        manager: the shared tiers (host, disk) and the host⇄disk link.
        cache: the sequences' caches added up (their device tiers, tails and device⇄host
            links); None once the engine is closed.
        decode_steps: step forwards that carried at least one decoding sequence's token
            (alone or packed with prefill pieces).
        decode_rows: decoding sequences over those forwards (their sum of batch sizes).
        max_decode_batch: the most decoding sequences one forward has carried.
        preemptions: running sequences preempted to make room (resumed later).
        prefetched_chunks: chunks of queued requests whose disk→host move started while
            they waited.
        isolated_failures: forwards of several sequences that raised; each of their
            sequences retried alone, so only one that fails on its own fails.
        recovered_sequences: sequences that lost KV from every tier mid-generation
            (corrupt or evicted) and resumed by recomputing it.
    """

    requests_submitted: int
    requests_finished: int
    requests_cancelled: int
    requests_failed: int
    requests_rejected: int
    queue_depth: int
    running: int
    prompt_tokens: int
    generated_tokens: int
    reused_tokens: int
    reused_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    ttft: HistogramSnapshot | None = None
    inter_token: HistogramSnapshot | None = None
    manager: ManagerStats | None = None
    cache: CacheStats | None = None
    decode_steps: int = 0
    decode_rows: int = 0
    max_decode_batch: int = 0
    preemptions: int = 0
    prefetched_chunks: int = 0
    isolated_failures: int = 0
    recovered_sequences: int = 0

    @property
    def mean_decode_batch(self) -> float:
        """Average sequences per decode forward (0.0 before any)."""
        return self.decode_rows / self.decode_steps if self.decode_steps else 0.0


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


class EngineCounters:
    """The engine's counters and latency histograms, written by its worker and read by
    ``Engine.stats``. Every method is thread-safe (one lock; the histograms have their own).

    Attributes:
        ttft: submission → first token, per request.
        inter_token: the gap between consecutive tokens of a request.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(COUNTER_NAMES, 0)
        self._reused_by_tier: dict[str, int] = {}
        self._max_decode_batch = 0
        self._service_s: float | None = None  # moving average of arrival → finish
        self.ttft = LatencyHistogram()
        self.inter_token = LatencyHistogram()

    def add(self, name: str, amount: int = 1) -> None:
        """Add ``amount`` to the counter ``name`` (one of ``COUNTER_NAMES``)."""
        with self._lock:
            self._counts[name] += amount

    def add_prompt(
        self, prompt_tokens: int, reused: int, tiers: list[str], chunk_tokens: int
    ) -> None:
        """An admitted prompt: its tokens, those reused, and the tier of each reused chunk."""
        with self._lock:
            self._counts["prompt_tokens"] += prompt_tokens
            self._counts["reused_tokens"] += reused
            for name in tiers[: reused // chunk_tokens]:
                self._reused_by_tier[name] = self._reused_by_tier.get(name, 0) + chunk_tokens

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

    def snapshot(self) -> tuple[dict[str, int], dict[str, int], int]:
        """Copies of the counters, the reused tokens by tier, and the largest decode batch."""
        with self._lock:
            return dict(self._counts), dict(self._reused_by_tier), self._max_decode_batch
