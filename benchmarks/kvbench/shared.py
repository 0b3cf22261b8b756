"""Benchmark ``shared``: two ``kvtier serve`` processes on one Redis Cluster share KV.

Question: when instance A has served a long prompt, how much sooner does instance B's
first token come for the same prompt (B reads A's chunks from the cluster) than a prompt
B has to compute, and are the tokens identical?

Method. A real 3-master, 3-replica Redis Cluster on loopback (``kvbench.redis_cluster``)
and two ``kvtier serve`` processes (embedded model, ``--remote`` on the cluster, their
own host tiers, no disk). Each round, with a new random prompt of ``--context`` tokens:

1. A serves prompt P (a full prefill: the recompute baseline);
2. once the cluster holds P's chunks (A writes them behind, asynchronously), B serves P:
   the cross-instance reuse;
3. B serves a new prompt Q of the same length (a full prefill on B: the same baseline).

Requests go through the official ``openai`` client, streamed; TTFT is the time to the
first streamed chunk; ``usage.prompt_tokens_details.cached_tokens`` comes from the final
chunk. Greedy, 8 tokens: B's text for P must equal A's. B's ``/metrics``
``kvtier_reused_tokens{tier="remote"}`` says where the reused tokens came from.
``ttft_speedup_cross_instance`` = median recompute TTFT ÷ median cross-instance TTFT.
"""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path
from typing import Any

from kvbench.common import base_parser, finish, header, median
from kvbench.redis_cluster import RedisCluster
from kvbench.serve_client import MODEL_NAME, by_label, scrape_metrics
from kvbench.server_process import HttpServer, kvtier_server

NEW_TOKENS = 8
PREFIX = "kvtier"


def stream_one(port: int, prompt: list[int]) -> dict[str, Any]:
    """One streamed greedy completion; its TTFT, text and cached tokens."""
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=600)
    start = time.perf_counter()
    first: float | None = None
    text, cached = "", None
    stream = client.completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=NEW_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices:
            if first is None:
                first = time.perf_counter() - start
            text += chunk.choices[0].text
        if chunk.usage is not None and chunk.usage.prompt_tokens_details is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens
    return {"ttft_s": first, "text": text, "cached_tokens": cached}


def wait_for_chunks(cluster: RedisCluster, count: int, timeout_s: float = 120.0) -> float:
    """Until the cluster holds ``count`` chunk keys (A's write-behind); the seconds."""
    from redis.cluster import RedisCluster as Client

    client = Client(host="127.0.0.1", port=cluster.ports[0])
    start = time.perf_counter()
    try:
        while sum(1 for _ in client.scan_iter(match=f"{PREFIX}:*")) < count:
            if time.perf_counter() - start > timeout_s:
                raise RuntimeError(f"the cluster did not get {count} chunks in {timeout_s} s")
            time.sleep(0.1)
    finally:
        client.close()
    return time.perf_counter() - start


def run(context: int, rounds: int, threads: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-shared-"))
    cluster = RedisCluster.start(masters=3, replicas=1)
    flags = ["--remote", cluster.url, "--remote-prefix", PREFIX, "--max-batch-size", "1"]
    flags += ["--host-mb", "2048"]
    servers: list[HttpServer] = []
    try:
        a, b = (kvtier_server(flags, threads, workdir) for _ in range(2))
        for server in (a, b):
            server.log_path = workdir / f"kvtier-serve-{len(servers)}.log"
            server.start(timeout_s=600)
            servers.append(server)
        rounds_out: list[dict[str, Any]] = []
        chunk_tokens = 256
        for i in range(rounds):
            p = [rng.randrange(10, 49000) for _ in range(context)]
            q = [rng.randrange(10, 49000) for _ in range(context)]
            first = stream_one(a.port, p)
            # The cluster then holds P's chunks of every round so far and Q's of the rounds
            # before (B writes those behind too).
            written_s = wait_for_chunks(cluster, (2 * i + 1) * (context // chunk_tokens))
            again = stream_one(b.port, p)
            fresh = stream_one(b.port, q)
            rounds_out.append({"a": first, "b_same": again, "b_fresh": fresh, "write_s": written_s})
            print(
                f"round {i + 1}/{rounds}: A {first['ttft_s']:.2f} s, B same prompt "
                f"{again['ttft_s']:.2f} s ({again['cached_tokens']} cached), B fresh "
                f"{fresh['ttft_s']:.2f} s",
                flush=True,
            )
        by_tier = by_label(scrape_metrics(b.port), "kvtier_reused_tokens")
    finally:
        for server in servers:
            server.stop()
        cluster.stop()
    recompute = [r["a"]["ttft_s"] for r in rounds_out] + [
        r["b_fresh"]["ttft_s"] for r in rounds_out
    ]
    cross = [r["b_same"]["ttft_s"] for r in rounds_out]
    return {
        "context_tokens": context,
        "rounds": rounds_out,
        "reused_tokens_by_tier_b": by_tier,
        "summary": {
            "ttft_speedup_cross_instance": median(recompute) / median(cross),
            "recompute_ttft_s": median(recompute),
            "cross_instance_ttft_s": median(cross),
            "tokens_identical": all(r["a"]["text"] == r["b_same"]["text"] for r in rounds_out),
            "cached_tokens": [r["b_same"]["cached_tokens"] for r in rounds_out],
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = base_parser("shared", __doc__)
    parser.sized("--context", 4096, 1024, "prompt tokens", type=int)
    parser.sized("--rounds", 3, 1, "rounds", type=int)
    parser.add_argument("--threads", type=int, default=2, help="torch threads per server")
    args = parser.parse(argv)
    info = header()
    result = run(args.context, args.rounds, args.threads, args.seed)
    s = result["summary"]
    finish(
        args.json,
        result,
        info,
        f"summary: ttft_speedup_cross_instance {s['ttft_speedup_cross_instance']:.1f}x "
        f"(goal >= 20; recompute {s['recompute_ttft_s']:.2f} s, from the cluster "
        f"{s['cross_instance_ttft_s']:.2f} s), tokens identical {s['tokens_identical']}, "
        f"B reused by tier {result['reused_tokens_by_tier_b']}",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
