"""Benchmark ``serve``: a production trace replayed against ``kvtier serve``, by tier set.

Question: serving real chat traffic, how many more prompt tokens does kvtier reuse, and how
much sooner does the first token come, when the KV that leaves the device can go to a large
host tier, or to a small host tier and a disk, instead of only a device-sized prefix cache?

Trace: the Mooncake "conversation" trace (``benchmarks/traces/conversation_trace.jsonl.xz``, read
at run time, ``--trace``). Each 512-token block id becomes a fixed block of ``--block-tokens``
(64) token ids drawn from a generator seeded with the id, so equal leading ids are equal
leading tokens; prompts are cut to ``--max-prompt-tokens`` (1024; the embedded model's context
is 8K) and outputs to ``--max-output-tokens`` (16). Conversations are the requests that share
more than block 0 (the system prompt every request starts with). A window of consecutive
trace requests shares almost nothing but block 0 (the next turn of a conversation comes
minutes later), so the window is the first ``--requests`` (40) requests of a seeded sample
of ``--user-fraction`` (3 %) of the conversations, in arrival order: fewer users, each with
all their turns. Arrival times are the trace's divided by ``--time-factor`` (3): the window's
arrivals then span about as long as ``device_only`` needs to serve it here (load near 1).
The JSON records how much prefix the window shares, and how little a consecutive window
would.

Method: for each configuration the benchmark starts a ``kvtier serve`` process (embedded
model, one torch thread, ``--max-batch-size 4``: continuous batching, ``--chunk-tokens``
equal to the block size, so one trace block is one chunk), sends one unmeasured warm-up
request, then replays the window: each request is a streaming ``POST /v1/completions`` of
the token ids (greedy, ``ignore_eos``) sent at its arrival time on its own thread. TTFT is
send → first streamed token, inter-token latency the gaps between streamed chunks. Reused
tokens by tier come from ``/metrics`` (after minus before the replay). The server is then
stopped with SIGTERM. Each sequence's device budget (``--device-budget-mb``, 64 MiB) holds
a capped request's whole KV (1040 tokens × 45 KiB for the embedded model), so no request
streams from the host and the configurations differ only in what they can reuse. They run
one after another on the same window (``--repeats`` alternates them A B C A B C):

- ``device_only``: kvtier always keeps sealed chunks in its host tier, so a device-only
  prefix cache is expressed as a host tier of the device's size (``--device-budget-mb`` ×
  ``--max-batch-size``) and no disk: only what a device-sized cache holds is reusable.
- ``device_host``: a host tier ``--host-factor`` (8) × that size.
- ``device_host_disk``: the device-sized host tier plus a ``--disk-mb`` disk tier in a
  temporary folder, which receives the chunks the host evicts (write-back).

Summary: reused tokens and p50 TTFT of each configuration ÷ ``device_only``'s. Every
server's host and disk evict by ``--eviction-policy`` (LRU by default); docs/benchmarks.md
(eviction) compares policies with ``--configs device_only``, whose host tier evicts.

Modules: the trace and the window are ``kvbench.trace``; the streaming client, the
replay and ``/metrics`` are ``kvbench.serve_client``; this module is the flow: the three
server configurations, starting and stopping ``kvtier serve``, one replay per configuration,
the summary, the printed table and the JSON.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvbench.common import base_parser, finish, fmt, header, present_median, ratio
from kvbench.serve_client import Reply, metric_figures, replay, reply_figures, stream_one
from kvbench.server_process import Server, ServerConfig
from kvbench.trace import (
    DEFAULT_TRACE,
    TOKEN_ID_RANGE,
    ReplayRequest,
    Scaling,
    build_window,
    load_trace,
    sample_window,
    window_sharing,
)
from kvtier.policy import EVICTION_POLICIES

CONFIGS = ("device_only", "device_host", "device_host_disk")


# ---- the server ------------------------------------------------------------------------------


def server_configs(
    device_budget_mb: int,
    max_batch_size: int,
    host_factor: float,
    disk_mb: int,
    chunk_tokens: int,
    max_queued: int,
    eviction_policy: str = "lru",
) -> dict[str, ServerConfig]:
    """The three configurations; the device-only host tier is the whole device budget;
    host and disk evict by ``eviction_policy``."""
    device_mb = device_budget_mb * max_batch_size
    if host_factor < 1:
        raise ValueError(f"--host-factor: must be >= 1, got {host_factor}")
    if disk_mb < 1:
        raise ValueError(f"--disk-mb: must be >= 1, got {disk_mb}")
    common: dict[str, Any] = dict(
        device_budget_mb=device_budget_mb,
        max_batch_size=max_batch_size,
        chunk_tokens=chunk_tokens,
        max_queued=max_queued,
        eviction_policy=eviction_policy,
    )
    return {
        "device_only": ServerConfig("device_only", host_mb=device_mb, **common),
        "device_host": ServerConfig(
            "device_host", host_mb=round(device_mb * host_factor), **common
        ),
        "device_host_disk": ServerConfig(
            "device_host_disk", host_mb=device_mb, disk_mb=disk_mb, **common
        ),
    }


# ---- one configuration -----------------------------------------------------------------------


def run_config(
    config: ServerConfig,
    window: list[ReplayRequest],
    workdir: Path,
    model: str | None,
    timeout_s: float,
) -> tuple[dict[str, Any], list[Reply]]:
    """Start the server, warm it up, replay the window, stop it; its figures and replies."""
    server = Server(config, workdir, model, timeout_s)
    load_before = os.getloadavg()[0]  # the machine is shared: record how busy it was
    server.start()
    try:
        # Warm-up: shorter than a chunk, so it seals nothing that the window could reuse.
        warm_ids = np.random.default_rng(1 << 40).integers(
            *TOKEN_ID_RANGE, config.chunk_tokens // 2
        )
        stream_one(server.port, [int(t) for t in warm_ids], 4, timeout_s)
        before = server.metrics()
        replies = replay(server.port, window, timeout_s)
        after = server.metrics()
    finally:
        exit_code = server.stop()
        if server.disk_dir is not None:
            shutil.rmtree(server.disk_dir, ignore_errors=True)
    figures = {
        "config": asdict(config),
        "flags": config.flags(server.disk_dir),
        **reply_figures(replies),
        **metric_figures(before, after),
        "server_exit_code": exit_code,
        "load_avg_1m": [load_before, os.getloadavg()[0]],
    }
    if exit_code != 0:
        figures["server_log_tail"] = server.log_tail()
    return figures, replies


# ---- summary ---------------------------------------------------------------------------------


def headline(runs: list[dict[str, Any]]) -> dict[str, float | None]:
    """A configuration's headline figures: the median over its runs (repeats)."""
    return {
        "reused_tokens": present_median([r["reused_tokens"] for r in runs]),
        "reused_fraction": present_median([r["reused_fraction"] for r in runs]),
        "ttft_p50_s": present_median([r["ttft_s"]["p50"] for r in runs]),
        "ttft_p90_s": present_median([r["ttft_s"]["p90"] for r in runs]),
        "ttft_p99_s": present_median([r["ttft_s"]["p99"] for r in runs]),
        "itl_p50_s": present_median([r["itl_s"]["p50"] for r in runs]),
        "itl_p99_s": present_median([r["itl_s"]["p99"] for r in runs]),
        "output_tokens_per_s": present_median([r["output_tokens_per_s"] for r in runs]),
    }


def summarize(headlines: dict[str, dict[str, float | None]]) -> dict[str, Any]:
    """The summary: each configuration's reused tokens and p50 TTFT ÷ ``device_only``'s
    (``device_host_disk``'s under the plain names, ``device_host``'s prefixed), and every
    configuration's headline figures under ``NAME_FIGURE``."""
    base = headlines.get("device_only", {})
    summary: dict[str, Any] = {}
    for name, prefix in (("device_host_disk", ""), ("device_host", "device_host_")):
        case = headlines.get(name, {})
        summary[f"{prefix}reused_tokens_ratio_vs_device_only"] = ratio(
            case.get("reused_tokens"), base.get("reused_tokens")
        )
        summary[f"{prefix}ttft_p50_ratio_vs_device_only"] = ratio(
            case.get("ttft_p50_s"), base.get("ttft_p50_s")
        )
    for name, figures in headlines.items():
        for figure, value in figures.items():
            summary[f"{name}_{figure}"] = value
    return summary


def same_texts(texts: dict[str, list[dict[int, str | None]]]) -> tuple[int, int]:
    """(requests whose text is the same in every run of every configuration, requests);
    a failed request (None) is never the same."""
    runs = [run for config_runs in texts.values() for run in config_runs]
    if not runs:
        return 0, 0
    indices = sorted(set().union(*(run.keys() for run in runs)))
    same = 0
    for index in indices:
        seen = {run.get(index) for run in runs}
        same += len(seen) == 1 and None not in seen
    return same, len(indices)


# ---- main ------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = base_parser("serve", __doc__)
    add = parser.add_argument
    add("--trace", type=Path, default=DEFAULT_TRACE, help="the JSONL trace (Mooncake format)")
    parser.sized("--requests", 40, 8, "requests in the window", type=int)
    add("--user-fraction", type=float, default=0.03, help="conversations sampled (1: consecutive)")
    add("--block-tokens", type=int, default=64, help="token ids per trace block (of 512)")
    parser.sized("--max-prompt-tokens", 1024, 512, "prompt cap", type=int)
    parser.sized("--max-output-tokens", 16, 8, "output cap", type=int)
    parser.sized("--time-factor", 3.0, 15.0, "trace s per replay s", type=float)
    add("--device-budget-mb", type=int, default=64, minimum=1, help="device KV budget per sequence")
    add("--max-batch-size", type=int, default=4, minimum=1, help="sequences run together")
    add("--host-factor", type=float, default=8.0, help="device_host's host tier ÷ device budget")
    add("--disk-mb", type=int, default=4096, help="device_host_disk's disk tier")
    add("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS, help="which to run")
    add(
        "--eviction-policy",
        default="lru",
        choices=sorted(EVICTION_POLICIES),
        help="every server's host and disk eviction policy (kvtier serve --eviction-policy)",
    )
    add(
        "--repeats",
        type=int,
        default=1,
        minimum=1,
        help="replays of each configuration (A B C A B C …)",
    )
    add("--model", default=None, help="HF folder or .gguf for the server (default: embedded)")
    add("--dir", type=Path, default=None, help="where the disk tier and server logs go")
    add("--timeout-s", type=float, default=600.0, help="per request and per server start/stop")
    return parser.parse(argv)


def print_table(runs: dict[str, list[dict[str, Any]]]) -> None:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1e3:.0f}"

    print(
        f"{'config':<18}{'host MB':>8}{'disk MB':>8}{'reused':>8}{'%':>5}{'host':>7}{'disk':>7}"
        f"{'TTFT p50':>9}{'p90':>7}{'p99':>7}{'ITL p50':>8}{'p99':>6}{'tok/s':>7}{'ok':>5}"
    )
    print(f"{'':<47}{'(ms)':>9}")
    for name, config_runs in runs.items():
        for case in config_runs:
            config, by_tier = case["config"], case["reused_tokens_by_tier"]
            disk_mb = config["disk_mb"] or 0
            rate = case["output_tokens_per_s"] or 0.0
            print(
                f"{name:<18}{config['host_mb']:>8}{disk_mb:>8}{case['reused_tokens']:>8}"
                f"{case['reused_fraction'] * 100:>5.0f}{by_tier.get('host', 0):>7}"
                f"{by_tier.get('disk', 0):>7}{ms(case['ttft_s']['p50']):>9}"
                f"{ms(case['ttft_s']['p90']):>7}{ms(case['ttft_s']['p99']):>7}"
                f"{ms(case['itl_s']['p50']):>8}{ms(case['itl_s']['p99']):>6}{rate:>7.1f}"
                f"{case['ok']:>3}/{case['requests']}"
            )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    scaling = Scaling(
        args.block_tokens, args.max_prompt_tokens, args.max_output_tokens, args.time_factor
    )
    configs = server_configs(
        args.device_budget_mb,
        args.max_batch_size,
        args.host_factor,
        args.disk_mb,
        args.block_tokens,  # one trace block = one chunk
        max(64, 2 * args.requests),  # never 429: every request waits its turn
        args.eviction_policy,
    )
    trace = load_trace(args.trace)
    window = build_window(
        trace, sample_window(trace, args.requests, args.user_fraction, args.seed), scaling
    )
    consecutive = build_window(trace, list(range(args.requests)), scaling)
    sharing = window_sharing(window, args.block_tokens)
    torch.set_num_threads(1)  # as the server's (OMP_NUM_THREADS=1), so the header says so
    info = header({"host<->disk": "real (local disk, O_DIRECT where it is supported)"})
    print(
        f"trace: {args.trace.name}, {sharing['requests']} requests of {sharing['conversations']} "
        f"conversations ({args.user_fraction:.0%} of them sampled, seed {args.seed}), "
        f"{args.block_tokens} tokens a block, prompts <= {args.max_prompt_tokens}, outputs <= "
        f"{args.max_output_tokens}, time / {args.time_factor:g} "
        f"(arrivals over {sharing['arrival_span_s']:.0f} s)"
    )
    print(
        f"window: {sharing['prompt_tokens']} prompt tokens, at most {sharing['shareable_tokens']} "
        f"({sharing['shareable_fraction']:.0%}) reusable, "
        f"{sharing['shareable_tokens_beyond_first_chunk']} beyond the system prompt"
    )
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-bench-serve-", dir=args.dir))
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in args.configs}
    texts: dict[str, list[dict[int, str | None]]] = {name: [] for name in args.configs}
    try:
        for _ in range(args.repeats):
            for name in args.configs:
                case, replies = run_config(
                    configs[name], window, workdir, args.model, args.timeout_s
                )
                runs[name].append(case)
                texts[name].append({r.index: r.text if r.error is None else None for r in replies})
                case["replies"] = [
                    {**asdict(r), "gaps_s": [round(g, 4) for g in r.gaps_s]} for r in replies
                ]
                p50 = case["ttft_s"]["p50"]
                print(
                    f"  {name}: reused {case['reused_tokens']} of {case['prompt_tokens']} prompt "
                    f"tokens {case['reused_tokens_by_tier']}, TTFT p50 "
                    f"{'-' if p50 is None else f'{p50:.2f} s'}, {case['ok']}/{case['requests']} "
                    f"ok, {case['wall_s']:.0f} s",
                    flush=True,
                )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    headlines = {name: headline(config_runs) for name, config_runs in runs.items()}
    summary = summarize(headlines)
    same, total = same_texts(texts)
    summary["same_text_requests"] = same
    summary["requests"] = total
    summary["all_ok"] = all(c["ok"] == c["requests"] for rs in runs.values() for c in rs)
    print_table(runs)
    result = {
        "summary": summary,
        "cases": runs,
        "config": {
            "quick": args.quick,
            "seed": args.seed,
            "trace": str(args.trace),
            "window": {
                "selection": "first requests of a seeded sample of the conversations",
                "user_fraction": args.user_fraction,
                "requests": args.requests,
                "trace_indices": [r.index for r in window],
            },
            "scaling": asdict(scaling),
            "window_sharing": sharing,
            "consecutive_window_sharing": window_sharing(consecutive, args.block_tokens),
            "servers": {name: asdict(configs[name]) for name in args.configs},
            "device_only_meaning": (
                "host tier = the device budget of all running sequences, no disk: kvtier "
                "keeps sealed chunks in its host tier, so this is a device-sized prefix cache"
            ),
            "repeats": args.repeats,
            "model": args.model or "embedded",
            "server_torch_threads": 1,
            "request": "POST /v1/completions, token ids, stream, temperature 0, ignore_eos",
        },
    }

    def show(value: float | None) -> str:
        return fmt(value, missing="-")

    finish(
        args.json,
        result,
        info,
        f"summary: reused tokens vs device-only: device+host "
        f"{show(summary['device_host_reused_tokens_ratio_vs_device_only'])}x, device+host+disk "
        f"{show(summary['reused_tokens_ratio_vs_device_only'])}x; TTFT p50 vs device-only: "
        f"device+host {show(summary['device_host_ttft_p50_ratio_vs_device_only'])}x, "
        f"device+host+disk {show(summary['ttft_p50_ratio_vs_device_only'])}x; same text "
        f"{same}/{total}",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
