"""``kvtier bench faults``'s scenarios, here on the tiny random model: the shared tier's
on a real Redis Cluster of their own (a master killed, the whole cluster down and back or
paused, corrupt and truncated values) and the disk's (corrupt files, a filesystem that
fills, one read-only at start). No request is lost, every output equals the fault-free
run's, the tier recovers. The disk's need no Redis."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvbench.fault_bench import Bench
from kvbench.faults import cluster_down, cluster_paused, corrupt_values, master_killed
from kvbench.faults_disk import corrupt_disk, disk_full, disk_read_only
from kvbench.redis_cluster import RedisCluster, available
from kvtier.engine import EngineConfig
from tests.engine.tiny import CHUNK, engine_config

pytestmark = pytest.mark.slow  # the slow phase of make test

needs_redis = pytest.mark.skipif(available() is not None, reason=f"no Redis: {available()}")

PROMPTS = [list(range(1000 + 97 * i, 1000 + 97 * i + 5 * CHUNK + 3)) for i in range(3)]


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisCluster]:
    """A cluster these tests may break (not the session's)."""
    with RedisCluster.start(masters=3, replicas=1) as c:
        yield c


@pytest.fixture(scope="module")
def bench(model: Any, tokenizer: Any) -> Bench:
    base: EngineConfig = engine_config()
    made = Bench(model, tokenizer, base, PROMPTS, timeout_s=0.3)
    made.reference = [r["tokens"] for r in made.serve(made.config(None, ""), PROMPTS)]
    return made


@needs_redis
def test_a_master_killed_mid_run_loses_nothing(bench: Bench, cluster: RedisCluster) -> None:
    result = master_killed(bench, cluster)
    assert (result["lost"], result["wrong"]) == (0, 0)
    assert result["reused_after_failover"] > 0  # the promoted replicas serve the chunks


@needs_redis
def test_the_whole_cluster_down_falls_back_to_recompute_and_recovers(
    bench: Bench, cluster: RedisCluster
) -> None:
    result = cluster_down(bench, cluster)
    assert (result["lost"], result["wrong"]) == (0, 0)
    assert result["recovered"]
    # A request waits at most one timeout on the dead cluster (plus noise), then computes.
    assert result["worst_added_latency_s"] <= bench.timeout_s + 0.5


@needs_redis
def test_corrupt_and_truncated_values_are_never_served(bench: Bench, cluster: RedisCluster) -> None:
    result = corrupt_values(bench, cluster)
    assert (result["lost"], result["wrong"]) == (0, 0)
    assert result["damaged"] > 0 and result["detected"] > 0


def test_corrupt_disk_files_are_never_served(bench: Bench, tmp_path: Path) -> None:
    result = corrupt_disk(bench, tmp_path)
    assert (result["lost"], result["wrong"]) == (0, 0)
    assert result["flipped_bytes"] > 0 and result["detected"] > 0


def test_a_disk_that_fills_or_is_read_only_loses_nothing(bench: Bench, tmp_path: Path) -> None:
    full = disk_full(bench, tmp_path)
    read_only = disk_read_only(bench, tmp_path)
    if "not_run" in full:
        pytest.skip(full["not_run"])
    assert (full["lost"], full["wrong"], read_only["lost"], read_only["wrong"]) == (0, 0, 0, 0)
    assert full["disk_puts"] > 0 and full["writes_disabled"] == 1
    assert read_only["reused_from_disk"] > 0 and read_only["disk_puts"] == 0


@needs_redis
def test_a_cluster_that_stops_answering_costs_at_most_the_timeout(
    bench: Bench, cluster: RedisCluster
) -> None:
    result = cluster_paused(bench, cluster, pause_s=4.0)
    assert result["lost"] == 0 and result["ttft_paused_s"]
    assert result["worst_added_latency_s"] <= bench.timeout_s + 0.5
