"""Benchmark ``tenants``: does the prefix cache leak another tenant's prompt through timing?

Question: a client B sends the very prompt another client A has just sent. With a shared
prefix cache B's first token comes far sooner than a fresh prompt's (the published
prefix-cache timing side channel) and ``cached_tokens`` tells B outright. With per-key
salting (``kvtier serve --salt-by-key``) B must see neither: ``cached_tokens`` 0 and a TTFT
within noise of a fresh prompt's.

Method: one ``kvtier serve`` process per configuration (embedded model, two API keys from
``$KVTIER_API_KEYS``, ``--max-batch-size 1``): ``shared`` (no salting: the channel open)
and ``salted`` (``--salt-by-key``). For each of ``--repeats`` rounds, A sends a new random
prompt of ``--prompt-tokens`` token ids (unmeasured: its KV is now cached), then, in an
order that rotates every round, three measured streaming requests of one output token:
``other`` (B, A's prompt), ``same`` (A, its prompt again: a real hit) and ``fresh`` (A, a
prompt nobody sent). TTFT is send → first streamed token.

Summary: per configuration, median TTFT of ``other`` and ``same`` ÷ ``fresh``, and the
cached tokens B was told of.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvbench.common import base_parser, finish, header, median
from kvbench.serve_client import stream_one
from kvbench.server_process import Server, ServerConfig

KEYS = {"a": "sk-bench-tenant-a", "b": "sk-bench-tenant-b"}
CASES = ("other", "same", "fresh")


def first_token(port: int, key: str, prompt: list[int], timeout_s: float) -> tuple[float, int]:
    """One streaming completion of one token: (TTFT seconds, cached tokens reported)."""
    reply = stream_one(port, prompt, 1, timeout_s, api_key=key)
    assert reply.ttft_s is not None  # stream_one raises when no token came
    return reply.ttft_s, reply.cached_tokens


def run_config(name: str, salted: bool, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    config = ServerConfig(
        name=name,
        device_budget_mb=256,
        max_batch_size=1,
        host_mb=2048,
        chunk_tokens=256,
        max_queued=8,
    )
    server = Server(config, workdir, args.model, timeout_s=600)
    if salted:
        server.command.append("--salt-by-key")
    os.environ["KVTIER_API_KEYS"] = ",".join(KEYS.values())
    rng = np.random.default_rng(args.seed)
    ttft: dict[str, list[float]] = {case: [] for case in CASES}
    cached: dict[str, list[int]] = {case: [] for case in CASES}
    server.start()
    try:

        def prompt() -> list[int]:
            return [int(t) for t in rng.integers(1000, 40000, size=args.prompt_tokens)]

        first_token(server.port, KEYS["a"], prompt(), args.timeout)  # warm-up, unmeasured
        for round_index in range(args.repeats):
            shared_prompt = prompt()
            first_token(server.port, KEYS["a"], shared_prompt, args.timeout)  # A's KV cached
            sends = {
                "other": (KEYS["b"], shared_prompt),
                "same": (KEYS["a"], shared_prompt),
                "fresh": (KEYS["a"], prompt()),
            }
            order = CASES[round_index % 3 :] + CASES[: round_index % 3]
            for case in order:
                seconds, tokens = first_token(server.port, *sends[case], args.timeout)
                ttft[case].append(seconds)
                cached[case].append(tokens)
    finally:
        server.stop()
    fresh = median(ttft["fresh"])
    return {
        "salted": salted,
        "ttft_s": ttft,
        "cached_tokens": cached,
        "median_ttft_s": {case: median(values) for case, values in ttft.items()},
        "other_vs_fresh": median(ttft["other"]) / fresh,
        "same_vs_fresh": median(ttft["same"]) / fresh,
        "other_cached_tokens": sum(cached["other"]),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = base_parser("tenants", __doc__)
    parser.add_argument("--model", default=None, help="HF folder (default: the embedded model)")
    parser.add_argument(
        "--prompt-tokens", type=int, default=2048, minimum=257, help="more than one chunk (256)"
    )
    parser.add_argument("--repeats", type=int, default=8, minimum=1)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    args = parser.parse(argv)
    if args.quick:
        args.prompt_tokens, args.repeats = min(args.prompt_tokens, 512), min(args.repeats, 3)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # as the server's (OMP_NUM_THREADS=1), so the header says so
    info = header()
    print(f"{args.repeats} rounds of {args.prompt_tokens}-token prompts, one output token")
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="kvtier-tenants-") as tmp:
        for name, salted in (("shared", False), ("salted", True)):
            print(f"{name}: starting kvtier serve{' --salt-by-key' if salted else ''}…")
            results[name] = run_config(name, salted, args, Path(tmp))
    print(
        f"{'config':<8}{'fresh ms':>10}{'other ms':>10}{'same ms':>10}"
        f"{'other/fresh':>13}{'same/fresh':>12}{'B told':>8}"
    )
    for name, r in results.items():
        m = r["median_ttft_s"]
        print(
            f"{name:<8}{m['fresh'] * 1e3:>10.0f}{m['other'] * 1e3:>10.0f}{m['same'] * 1e3:>10.0f}"
            f"{r['other_vs_fresh']:>13.2f}{r['same_vs_fresh']:>12.2f}"
            f"{r['other_cached_tokens']:>8}"
        )
    summary = {
        "salted_other_vs_fresh_ttft": results["salted"]["other_vs_fresh"],
        "salted_other_cached_tokens": results["salted"]["other_cached_tokens"],
        "shared_other_vs_fresh_ttft": results["shared"]["other_vs_fresh"],
        "same_tenant_vs_fresh_ttft": results["salted"]["same_vs_fresh"],
    }
    finish(
        args.json,
        {"args": vars(args), "summary": summary, "results": results},
        info,
        f"summary: with --salt-by-key another tenant's TTFT on a prompt just sent is "
        f"{summary['salted_other_vs_fresh_ttft']:.2f}x a fresh prompt's and it is told of "
        f"{summary['salted_other_cached_tokens']} cached tokens; without salting "
        f"{summary['shared_other_vs_fresh_ttft']:.2f}x",
    )
    return 0
