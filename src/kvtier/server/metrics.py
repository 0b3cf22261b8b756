"""Prometheus metrics of one engine, read from its stats on every scrape.

A custom collector (no state of its own): tier counters and occupancy, link bytes, rate
and stall time, placement decisions with predicted and measured seconds, queue depth,
request and token counters, and the TTFT and inter-token latency histograms that the
engine keeps.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kvtier.engine import Engine, EngineStats, HistogramSnapshot
from kvtier.tiers.base import TierStats
from kvtier.transfer import LinkStats

_TIER_COUNTERS = (  # (metric name after kvtier_tier_, TierStats field, help)
    ("hits", "hits", "chunk reads served"),
    ("misses", "misses", "chunk reads not found"),
    ("bytes_in", "bytes_in", "bytes written into the tier"),
    ("bytes_out", "bytes_out", "bytes read out of the tier"),
    ("evictions", "evictions", "chunks evicted"),
    ("corrupt_chunks", "corrupt_dropped", "chunks dropped because their bytes failed checks"),
    ("io_errors", "io_errors", "failed I/O calls"),
    ("writes_skipped", "writes_skipped", "chunks not written because writes are disabled"),
)


class EngineCollector(Collector):
    """Reads ``engine.stats()`` (and tier occupancy) at scrape time."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats()
        tiers: dict[str, TierStats] = {}
        links: dict[str, LinkStats] = {}
        if stats.cache is not None:
            tiers["device"] = stats.cache.device
            links["device<->host"] = stats.cache.link
        if stats.manager is not None:
            tiers.update(stats.manager.tiers)
            links.update(stats.manager.links)
        for metric, attr, doc in _TIER_COUNTERS:
            family = CounterMetricFamily(
                f"kvtier_tier_{metric}", f"KV tier: {doc}", labels=["tier"]
            )
            for name, tier in tiers.items():
                family.add_metric([name], getattr(tier, attr))
            yield family
        disabled = GaugeMetricFamily(
            "kvtier_tier_writes_disabled",
            "1 while an I/O error keeps the tier off",
            labels=["tier"],
        )
        for name, tier in tiers.items():
            disabled.add_metric([name], tier.writes_disabled)
        yield disabled
        policies = GaugeMetricFamily(
            "kvtier_tier_eviction_policy",
            "1 for the eviction policy each tier runs (kvtier serve --eviction-policy)",
            labels=["tier", "policy"],
        )
        for name, policy in (stats.manager.eviction_policies if stats.manager else {}).items():
            policies.add_metric([name, policy], 1)
        yield policies
        codecs = GaugeMetricFamily(
            "kvtier_tier_codec",
            "1 for the chunk codec each tier stores in (raw is exact; kvtier serve --*-codec)",
            labels=["tier", "codec"],
        )
        for store in self.engine.manager.tiers:
            codecs.add_metric([store.name, store.codec.name], 1)
        yield codecs
        yield from self._faults(stats)
        yield from self._occupancy(stats)
        yield from self._decisions(stats)
        link_bytes = CounterMetricFamily("kvtier_link_bytes", "bytes moved", labels=["link"])
        gbps = GaugeMetricFamily("kvtier_link_gbps", "achieved GB/s while busy", labels=["link"])
        stall = CounterMetricFamily(
            "kvtier_link_stall_seconds", "seconds compute waited on the link", labels=["link"]
        )
        for name, link in links.items():
            link_bytes.add_metric([name], link.bytes)
            gbps.add_metric([name], link.achieved_gbps)
            stall.add_metric([name], link.wait_s)
        yield from (link_bytes, gbps, stall)
        yield GaugeMetricFamily("kvtier_queue_depth", "requests waiting", value=stats.queue_depth)
        yield GaugeMetricFamily("kvtier_requests_running", "requests generating", stats.running)
        requests = CounterMetricFamily("kvtier_requests", "requests by outcome", labels=["outcome"])
        for outcome, value in (
            ("finished", stats.requests_finished),
            ("cancelled", stats.requests_cancelled),
            ("failed", stats.requests_failed),
            ("rejected", stats.requests_rejected),
        ):
            requests.add_metric([outcome], value)
        yield requests
        yield CounterMetricFamily("kvtier_prompt_tokens", "prompt tokens", stats.prompt_tokens)
        yield CounterMetricFamily(
            "kvtier_generation_tokens", "generated tokens", stats.generated_tokens
        )
        reused = CounterMetricFamily(
            "kvtier_reused_tokens", "prompt tokens reused, by source tier", labels=["tier"]
        )
        for name, value in stats.reused_tokens_by_tier.items():
            reused.add_metric([name], value)
        yield reused
        if stats.ttft is not None:
            yield _histogram(
                "kvtier_time_to_first_token_seconds", "submission to first token", stats.ttft
            )
        if stats.inter_token is not None:
            yield _histogram(
                "kvtier_inter_token_latency_seconds", "gap between tokens", stats.inter_token
            )

    def _faults(self, stats: EngineStats) -> Iterator[Metric]:
        """Recompute caused by storage faults, and write-through copies dropped."""
        recomputed = CounterMetricFamily(
            "kvtier_recomputed_chunks",
            "cached chunks recomputed instead (corrupt: failed checks; missing: gone)",
            labels=["cause"],
        )
        dropped = 0
        if stats.manager is not None:
            for cause, value in stats.manager.recomputed_chunks_by_cause.items():
                recomputed.add_metric([cause], value)
            dropped = stats.manager.write_through_dropped
        yield recomputed
        yield CounterMetricFamily(
            "kvtier_write_through_dropped_chunks",
            "sealed chunks whose write-through disk copy was dropped (link full or disk off)",
            dropped,
        )

    def _decisions(self, stats: EngineStats) -> Iterator[Metric]:
        """Chunk reads per placement decision, with the cost model's predicted seconds and
        the measured ones (a series only where there is a figure)."""
        chunks = CounterMetricFamily(
            "kvtier_decision_chunks", "chunk reads (chunk x pass) by decision", labels=["decision"]
        )
        nbytes = CounterMetricFamily(
            "kvtier_decision_bytes", "bytes of those chunk reads", labels=["decision"]
        )
        predicted = CounterMetricFamily(
            "kvtier_decision_predicted_seconds",
            "the cost model's seconds for them",
            labels=["decision"],
        )
        measured = CounterMetricFamily(
            "kvtier_decision_measured_seconds",
            "the seconds they took (stream: link busy; host: host attention calls; load, "
            "recompute: admission until the chunks were in place)",
            labels=["decision"],
        )
        decisions = dict(stats.cache.decisions) if stats.cache is not None else {}
        decisions.update(stats.reuse_decisions)  # load / recompute: distinct names
        for name, cost in decisions.items():
            chunks.add_metric([name], cost.chunks)
            nbytes.add_metric([name], cost.nbytes)
            if cost.predicted_s is not None:
                predicted.add_metric([name], cost.predicted_s)
            if cost.measured_s is not None:
                measured.add_metric([name], cost.measured_s)
        yield from (chunks, nbytes, predicted, measured)

    def _occupancy(self, stats: EngineStats) -> Iterator[Metric]:
        used = GaugeMetricFamily("kvtier_tier_used_bytes", "bytes held", labels=["tier"])
        capacity = GaugeMetricFamily("kvtier_tier_capacity_bytes", "bytes budget", labels=["tier"])
        if stats.cache is not None:  # every sequence's device tier and tail together
            used.add_metric(["device"], stats.cache.device_nbytes)
            capacity.add_metric(["device"], stats.cache.device_budget_bytes)
        for tier in self.engine.manager.tiers:
            used.add_metric([tier.name], tier.used_bytes)
            capacity.add_metric([tier.name], tier.capacity_bytes)
        yield from (used, capacity)


def _histogram(name: str, doc: str, snap: HistogramSnapshot) -> HistogramMetricFamily:
    buckets: list[tuple[str, float]] = []
    running = 0
    for bound, count in zip(snap.bounds_s, snap.counts, strict=False):
        running += count
        buckets.append((repr(float(bound)), running))
    buckets.append(("+Inf", snap.count))
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=snap.sum_s)


def registry_for(engine: Engine) -> CollectorRegistry:
    """A fresh registry holding only this engine's collector (one per app)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine))
    return registry
