"""The engine's results, read by callers and by the server's ``/metrics``: ``EngineStats``
and ``HistogramSnapshot``.

Frozen snapshots: built by ``kvtier.engine.metrics.EngineMetrics.stats``, never mutated,
safe to pass between threads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.manager import ManagerStats
from kvtier.runtime import CacheStats
from kvtier.runtime.ledger import DecisionCost


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
        reuse_decisions: for prefixes whose chunks lay below host, by decision (``load``:
            chunks adopted from a lower tier; ``recompute``: chunks computed while the rest
            loaded), with predicted and measured seconds (``kvtier.engine.overlap``).
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
    reuse_decisions: dict[str, DecisionCost] = field(default_factory=dict)

    @property
    def mean_decode_batch(self) -> float:
        """Average sequences per decode forward (0.0 before any)."""
        return self.decode_rows / self.decode_steps if self.decode_steps else 0.0
