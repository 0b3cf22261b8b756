"""Benchmark ``faults``: does anything get lost or go wrong when the shared tier fails?

Question: with the shared Redis Cluster tier under the engine, when a master dies, the
whole cluster stops, values in Redis (or bytes in the disk tier's files) are corrupt, the
disk fills or is read-only, or the server is killed mid-stream,
does every request still complete with the tokens of a fault-free run, how much latency
does a request add while the cluster is down, and does the tier recover when it returns?

Scenarios (each on its own key prefix of one real 3-master, 3-replica cluster):

- ``master_killed``: instance A serves the prompts (its chunks go to the cluster); a
  fresh instance B serves them again, and a master is killed (``kill -9``) after B's
  first; once the cluster has failed over, a third instance serves them from the
  promoted replicas;
- ``cluster_down``: every node is killed while an instance serves; its requests fall back
  to recompute; the nodes come back (same cluster config) and the tier answers again;
  *added latency* is a request's TTFT while down less the same-length recompute TTFT
  while up (the goal: at most the tier's timeout, ``timeout_s``; killed nodes refuse at
  once, so this one is near 0);
- ``cluster_paused``: every node stops answering (``CLIENT PAUSE``) with its connections
  open, so each call waits for the timeout; fresh prompts must complete, and the added
  latency is measured the same way;
- ``corrupt_values``: A's values in Redis get a flipped byte or are truncated; B must
  detect them (``corrupt_dropped``), never serve them, and recompute;
- the disk scenarios (``kvbench.faults_disk``): ``corrupt_disk`` (segment files get
  flipped bytes after a restart), ``disk_full`` (write-through onto a tmpfs that fills),
  ``disk_read_only`` (the folder's filesystem remounted read-only after a run), and
  ``kill9_mid_stream`` (``kvtier serve`` killed while a completion streams, restarted on
  the same folder: what ``/metrics`` reported on disk is found again).

Summary keys: ``lost_requests`` (requests that did not complete), ``wrong_outputs`` (tokens
different from the fault-free run's), ``recovered_after_cluster_restart``,
``worst_added_latency_down_s`` and ``timeout_s``. The tests
(``tests/faults/test_bench_faults.py``) run the same scenarios on a tiny random model.
"""

from __future__ import annotations

import random
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvbench import faults_disk
from kvbench.common import base_parser, finish, header
from kvbench.fault_bench import Bench, score, serve_one
from kvbench.redis_cluster import RedisCluster
from kvtier.engine import Engine, EngineConfig


def master_killed(bench: Bench, cluster: RedisCluster) -> dict[str, Any]:
    prefix = _prefix()
    config = bench.config(cluster, prefix)
    bench.serve(config, bench.prompts)  # A: the chunks go to the cluster
    killed = cluster.master_ports()[0]
    with Engine(bench.model, bench.tokenizer, config) as b:
        runs = [serve_one(b, bench.prompts[0])]
        cluster.kill_node(killed)
        runs += [serve_one(b, p) for p in bench.prompts[1:]]
    cluster.wait_failover(killed)  # a replica took over the dead master's slots
    after = bench.serve(config, bench.prompts)  # C: from the promoted replicas
    cluster.restart_node(killed)  # it rejoins, as a replica
    cluster.wait_ok(timeout_s=60)
    scored = score(bench, runs + after, bench.prompts * 2)
    return {**scored, "reused_after_failover": sum(r["reused"] for r in after)}


def cluster_down(bench: Bench, cluster: RedisCluster) -> dict[str, Any]:
    prefix = _prefix()
    config = bench.config(cluster, prefix)
    fresh = _fresh_prompts(bench, 2 * len(bench.prompts))
    up, down_prompts = fresh[: len(bench.prompts)], fresh[len(bench.prompts) :]
    with Engine(bench.model, bench.tokenizer, config) as engine:
        runs_up = [serve_one(engine, p) for p in up]  # recompute with the cluster up
        ports = list(cluster.procs)
        for port in ports:
            cluster.kill_node(port)
        runs_down = [serve_one(engine, p) for p in down_prompts]  # recompute, the cluster down
        for port in ports:
            cluster.restart_node(port)
        cluster.wait_ok(timeout_s=60)
        back = time.perf_counter()
        remote = engine.manager.tier("remote")
        tries: list[dict[str, Any]] = []
        for prompt in bench.prompts * 4:  # until a request's chunks reach the cluster again
            tries.append(serve_one(engine, prompt))
            remote.sync()
            if remote.stats().puts > 0:
                break
            time.sleep(0.5)  # inside the back-off the tier is skipped
        wrote = remote.stats().puts
        recovered_s = time.perf_counter() - back
    last = (bench.prompts * 4)[len(tries) - 1]
    later = bench.serve(config, [last])  # a new instance reads what was written
    added = _added_latency(runs_down, runs_up)
    lost = sum(r["tokens"] is None for r in runs_up + runs_down + tries + later)
    wrong = score(bench, [*tries, *later], [*(bench.prompts * 4)[: len(tries)], last])["wrong"]
    return {
        "requests": len(runs_up) + len(runs_down) + len(tries) + 1,
        "lost": lost,
        "wrong": wrong,
        "recovered": bool(wrote > 0 and later[0]["reused"] > 0),
        "recovered_after_s": recovered_s,
        "worst_added_latency_s": added,
        "ttft_up_s": [r["ttft_s"] for r in runs_up],
        "ttft_down_s": [r["ttft_s"] for r in runs_down],
    }


def cluster_paused(bench: Bench, cluster: RedisCluster, pause_s: float = 12.0) -> dict[str, Any]:
    """Every node stops answering (``CLIENT PAUSE``) but keeps its connections: each call
    waits for the tier's timeout. *Added latency*: TTFT while paused less TTFT while up,
    for prompts of the same length computed in full."""
    prefix = _prefix()
    config = bench.config(cluster, prefix)
    fresh = _fresh_prompts(bench, 2 * len(bench.prompts))
    up, paused = fresh[: len(bench.prompts)], fresh[len(bench.prompts) :]
    with Engine(bench.model, bench.tokenizer, config) as engine:
        runs_up = [serve_one(engine, p) for p in up]
        until = time.perf_counter() + pause_s
        for port in cluster.procs:
            cluster.cli(port, "CLIENT", "PAUSE", str(int(pause_s * 1000)), "ALL")
        runs_paused = []
        for p in paused:
            if time.perf_counter() > until - 0.5:
                break  # the pause is about to end: what follows would not be paused
            runs_paused.append(serve_one(engine, p))
    time.sleep(max(0.0, until - time.perf_counter()))
    lost = sum(r["tokens"] is None for r in runs_up + runs_paused)
    return {
        "requests": len(runs_up) + len(runs_paused),
        "lost": lost,
        "wrong": 0,  # fresh prompts: no fault-free reference; they must only complete
        "worst_added_latency_s": _added_latency(runs_paused, runs_up),
        "ttft_up_s": [r["ttft_s"] for r in runs_up],
        "ttft_paused_s": [r["ttft_s"] for r in runs_paused],
    }


def corrupt_values(bench: Bench, cluster: RedisCluster) -> dict[str, Any]:
    prefix = _prefix()
    config = bench.config(cluster, prefix)
    bench.serve(config, bench.prompts)
    from redis.cluster import RedisCluster as Client

    client = Client(host="127.0.0.1", port=cluster.ports[0])
    damaged = 0
    for i, key in enumerate(client.scan_iter(match=f"{prefix}:*")):
        raw = client.get(key)
        assert isinstance(raw, bytes)
        value = bytearray(raw)
        if i % 2:
            value[len(value) // 2] ^= 0x10  # a flipped bit in the data
        else:
            value = value[: len(value) // 3]  # truncated
        client.set(key, bytes(value))
        damaged += 1
    client.close()
    with Engine(bench.model, bench.tokenizer, config) as engine:
        runs = [serve_one(engine, p) for p in bench.prompts]
        corrupt = engine.manager.tier("remote").stats().corrupt_dropped
    return {**score(bench, runs, bench.prompts), "damaged": damaged, "detected": corrupt}


def _added_latency(faulty: list[dict[str, Any]], up: list[dict[str, Any]]) -> float | None:
    """The most a request's TTFT during the fault exceeds the same-length one's while up
    (pairs in order; None: no pair has both)."""
    added = [
        d["ttft_s"] - u["ttft_s"]
        for d, u in zip(faulty, up, strict=False)
        if d["ttft_s"] is not None and u["ttft_s"] is not None
    ]
    return max(added) if added else None


def _prefix() -> str:
    return f"faults{uuid.uuid4().hex[:10]}"


def _fresh_prompts(bench: Bench, count: int) -> list[list[int]]:
    """Prompts as long as the bench's, cached nowhere."""
    rng = random.Random(uuid.uuid4().int)
    length = len(bench.prompts[0])
    return [[rng.randrange(10, 30000) for _ in range(length)] for _ in range(count)]


def run_all(bench: Bench, cluster: RedisCluster) -> dict[str, Any]:
    """Every scenario, then the summary keys."""
    bench.reference = [r["tokens"] for r in bench.serve(bench.config(None, ""), bench.prompts)]
    folder = Path(tempfile.mkdtemp(prefix="kvtier-faults-"))
    scenarios: dict[str, Callable[[], dict[str, Any]]] = {
        "master_killed": lambda: master_killed(bench, cluster),
        "cluster_down": lambda: cluster_down(bench, cluster),
        "cluster_paused": lambda: cluster_paused(bench, cluster),
        "corrupt_values": lambda: corrupt_values(bench, cluster),
        "corrupt_disk": lambda: faults_disk.corrupt_disk(bench, folder / "corrupt"),
        "disk_full": lambda: faults_disk.disk_full(bench, folder),
        "disk_read_only": lambda: faults_disk.disk_read_only(bench, folder),
        "kill9_mid_stream": lambda: faults_disk.kill9_mid_stream(
            folder / "kill9", len(bench.prompts), words=len(bench.prompts[0]) // 2
        ),
    }
    results = {}
    for name, scenario in scenarios.items():
        started = time.perf_counter()
        results[name] = scenario()
        results[name]["seconds"] = time.perf_counter() - started
        print(f"{name}: {results[name]}", flush=True)
    down = results["cluster_down"]
    return {
        "scenarios": results,
        "summary": {
            "lost_requests": sum(r["lost"] for r in results.values()),
            "wrong_outputs": sum(r["wrong"] for r in results.values()),
            "recovered_after_cluster_restart": down["recovered"],
            "worst_added_latency_down_s": max(
                x
                for x in (
                    down["worst_added_latency_s"],
                    results["cluster_paused"]["worst_added_latency_s"],
                )
                if x is not None
            ),
            "timeout_s": bench.timeout_s,
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = base_parser("faults", __doc__)
    parser.sized("--prompts", 4, 2, "prompts per scenario", type=int)
    parser.sized("--context", 1024, 512, "prompt tokens", type=int)
    args = parser.parse(argv)
    from kvtier.models import load_model

    count, context = args.prompts, args.context
    info = header()
    loaded = load_model()
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(10, 30000) for _ in range(context)] for _ in range(count)]
    bench = Bench(loaded.model, loaded.tokenizer, EngineConfig(max_batch_size=1), prompts)
    with RedisCluster.start(masters=3, replicas=1) as cluster:
        result = run_all(bench, cluster)
    result["config"] = {"prompts": count, "context": context}
    s = result["summary"]
    finish(
        args.json,
        result,
        info,
        f"summary: lost {s['lost_requests']}, wrong {s['wrong_outputs']}, recovered after "
        f"cluster restart {s['recovered_after_cluster_restart']}, worst added latency while "
        f"down {s['worst_added_latency_down_s']:.3f} s (timeout {s['timeout_s']} s)",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
