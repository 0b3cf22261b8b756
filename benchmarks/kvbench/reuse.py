"""Benchmark ``reuse``: next-turn time to first token with the history's KV in host or disk.

Question: when a conversation's next turn extends a history of 1K/2K/4K/8K tokens, how much
sooner does the first token come when kvtier reuses the history's KV from the host tier,
or from the disk tier after a restart, than when the whole prompt is recomputed?

Baseline (same run, interleaved): full prefill of history + follow-up with transformers'
``DynamicCache``. Method per history length H (the model's context is 8192 tokens, so "8K"
is 7936 history tokens), with a 64-token follow-up and a device budget of 25 % of the KV:

- recompute: ``model.generate`` over history + follow-up from an empty ``DynamicCache``;
- host: turn 1 (a ``TieredCache`` on a shared ``KVManager``) generates over the history;
  turn 2, a new ``TieredCache`` on the same manager, generates over history + follow-up;
- disk: turn 1 likewise on a manager with a disk tier, closed with
  ``flush_host_to_disk=True``; every turn 2 opens a new manager on that directory (host
  empty, so the history comes off the disk, O_DIRECT where the filesystem takes it).

Turn 2's tokens must equal the recompute's and its reused tokens must be > 0.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from kvbench.common import finish, header, interleave, median
from kvbench.setup import (
    BenchModel,
    describe_link,
    load_bench,
    model_parser,
    random_prompt,
    use_stock_attention,
)
from kvtier.config import DiskConfig, HostConfig, ManagerConfig, TieredCacheConfig
from kvtier.hf.cache import TieredCache
from kvtier.hf.generate import TokenClock, generate
from kvtier.manager import KVManager

HISTORIES = {"1k": 1024, "2k": 2048, "4k": 4096, "8k": 7936}
QUICK_HISTORIES = ("1k", "2k")
FOLLOW_UP_TOKENS = 64
NEW_TOKENS = 4
BUDGET_FRACTION = 0.25


@dataclass
class Turn:
    """One measured turn.

    Attributes:
        ttft_s: seconds from the call to the first generated token.
        tokens: the generated ids.
        reused_tokens: prompt tokens adopted from the tiers.
        open_s: seconds to open the manager (disk: scan the segment headers), not in TTFT.
        disk_hits: chunks the disk tier served.
        disk_read_gbps: the disk tier's read rate during the turn.
    """

    ttft_s: float
    tokens: list[int] = field(default_factory=list)
    reused_tokens: int = 0
    open_s: float = 0.0
    disk_hits: int = 0
    disk_read_gbps: float = 0.0


@dataclass(frozen=True)
class History:
    """One history length: its prompts and the tiers' sizes."""

    label: str
    history: torch.Tensor  # [1, H]
    prompt: torch.Tensor  # [1, H + follow-up]
    budget_bytes: int
    host_nbytes: int


def make_history(bench: BenchModel, label: str, seed: int) -> History:
    tokens = HISTORIES[label]
    vocab = int(bench.model.config.vocab_size)
    history = random_prompt(vocab, tokens, seed + tokens)
    follow_up = random_prompt(vocab, FOLLOW_UP_TOKENS, seed + tokens + 1)
    prompt = torch.cat([history, follow_up], dim=1)
    layout = bench.layout
    kv_nbytes = layout.kv_nbytes(prompt.shape[1] + NEW_TOKENS)
    budget = max(int(BUDGET_FRACTION * kv_nbytes), layout.chunk_nbytes)
    return History(label, history, prompt, budget, kv_nbytes + 4 * layout.chunk_nbytes)


def recompute(bench: BenchModel, prompt: torch.Tensor) -> Turn:
    """Time to first token of a full prefill with an empty ``DynamicCache``."""
    use_stock_attention(bench.model)
    clock = TokenClock()
    ids = prompt.to(bench.device)
    start = time.perf_counter()
    out = bench.model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        cache=DynamicCache(config=bench.model.config),
        streamer=clock,
        **bench.greedy_kwargs(NEW_TOKENS),
    )
    return Turn(clock.times[1] - start, out[0, ids.shape[1] :].tolist())


def manager_config(h: History, bench: BenchModel, disk: Path | None) -> ManagerConfig:
    layout = bench.layout
    lower_tiers: tuple[DiskConfig, ...] = ()
    if disk is not None:
        lower_tiers = (DiskConfig(path=str(disk), capacity_bytes=2 * h.host_nbytes),)
    return ManagerConfig(
        chunk_tokens=layout.chunk_tokens,
        host=HostConfig(capacity_bytes=h.host_nbytes),
        lower_tiers=lower_tiers,
    )


def tiered_turn(
    bench: BenchModel, manager: KVManager, h: History, ids: torch.Tensor, new_tokens: int
) -> Turn:
    """A new ``TieredCache`` on ``manager`` generates over ``ids``."""
    config = TieredCacheConfig(device_budget_bytes=h.budget_bytes)
    cache = TieredCache(bench.model, config, manager=manager, model_id=bench.model_id)
    try:
        res = generate(bench.model, cache, ids.to(bench.device), **bench.greedy_kwargs(new_tokens))
    finally:
        cache.close()
    return Turn(res.ttft_s, res.sequences[0, ids.shape[1] :].tolist(), res.reused_tokens)


def disk_turn(bench: BenchModel, h: History, disk: Path) -> Turn:
    """Turn 2 after a restart: a new manager on the disk directory, the host tier empty."""
    start = time.perf_counter()
    manager = KVManager(bench.layout, bench.model_id, manager_config(h, bench, disk))
    open_s = time.perf_counter() - start
    try:
        turn = tiered_turn(bench, manager, h, h.prompt, NEW_TOKENS)
        stats = manager.stats().tiers["disk"]
    finally:
        manager.close()
    turn.open_s = open_s
    turn.disk_hits = stats.hits
    turn.disk_read_gbps = stats.get_gbps
    return turn


def run_history(bench: BenchModel, h: History, repeats: int, workdir: Path) -> dict[str, Any]:
    """Turn 1 into host and into disk, then recompute / host / disk turn 2, interleaved."""
    host_manager = KVManager(bench.layout, bench.model_id, manager_config(h, bench, None))
    turn1_host = tiered_turn(bench, host_manager, h, h.history, 1)
    disk = workdir / f"disk-{h.label}"
    disk_manager = KVManager(bench.layout, bench.model_id, manager_config(h, bench, disk))
    turn1_disk = tiered_turn(bench, disk_manager, h, h.history, 1)
    disk_manager.close(flush_host_to_disk=True)
    cases = {
        "recompute": lambda _: recompute(bench, h.prompt),
        "host": lambda _: tiered_turn(bench, host_manager, h, h.prompt, NEW_TOKENS),
        "disk": lambda _: disk_turn(bench, h, disk),
    }
    try:
        turns = interleave(cases, repeats)
    finally:
        host_manager.close()
    expected = turns["recompute"][0].tokens
    ttft = {name: median([t.ttft_s for t in runs]) for name, runs in turns.items()}
    result: dict[str, Any] = {
        "history_tokens": int(h.history.shape[1]),
        "prompt_tokens": int(h.prompt.shape[1]),
        "budget_bytes": h.budget_bytes,
        "turn1_ttft_s": {"host": turn1_host.ttft_s, "disk": turn1_disk.ttft_s},
        "ttft_s": ttft,
        "ttft_samples_s": {name: [t.ttft_s for t in runs] for name, runs in turns.items()},
        "speedup_host": ttft["recompute"] / ttft["host"],
        "speedup_disk": ttft["recompute"] / ttft["disk"],
    }
    for name in ("host", "disk"):
        runs = turns[name]
        result[f"{name}_reused_tokens"] = min(t.reused_tokens for t in runs)
        result[f"{name}_tokens_identical"] = all(t.tokens == expected for t in runs)
    result["recompute_tokens_stable"] = all(t.tokens == expected for t in turns["recompute"])
    result["disk_open_s"] = median([t.open_s for t in turns["disk"]])
    result["disk_hits"] = min(t.disk_hits for t in turns["disk"])
    result["disk_read_gbps"] = median([t.disk_read_gbps for t in turns["disk"]])
    result["tokens"] = expected
    return result


def run(
    bench: BenchModel, labels: tuple[str, ...], repeats: int, seed: int, folder: Path | None
) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-bench-reuse-", dir=folder))
    results: dict[str, Any] = {}
    try:
        # Warm the code paths of both caches once on a short prompt (not reported).
        warm = make_history(bench, "1k", seed + 99)
        recompute(bench, warm.prompt[:, :300])
        with KVManager(bench.layout, bench.model_id, manager_config(warm, bench, None)) as m:
            tiered_turn(bench, m, warm, warm.prompt[:, :300], 2)
        for label in labels:
            h = make_history(bench, label, seed)
            results[label] = run_history(bench, h, repeats, workdir)
            r = results[label]
            print(
                f"  {label}: recompute {r['ttft_s']['recompute']:.2f} s, host "
                f"{r['ttft_s']['host']:.2f} s, disk {r['ttft_s']['disk']:.2f} s",
                flush=True,
            )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    summary: dict[str, Any] = {
        "ttft_speedup_host_4k": results["4k"]["speedup_host"] if "4k" in results else None,
        "ttft_speedup_disk_4k": results["4k"]["speedup_disk"] if "4k" in results else None,
    }
    for label, r in results.items():
        summary[f"ttft_speedup_host_{label}"] = r["speedup_host"]
        summary[f"ttft_speedup_disk_{label}"] = r["speedup_disk"]
    summary["tokens_identical"] = all(
        r["host_tokens_identical"] and r["disk_tokens_identical"] for r in results.values()
    )
    summary["reused"] = all(
        r["host_reused_tokens"] > 0 and r["disk_reused_tokens"] > 0 for r in results.values()
    )
    return {
        "summary": summary,
        "histories": results,
        "config": {
            "model": bench.description,
            "histories": {label: HISTORIES[label] for label in labels},
            "follow_up_tokens": FOLLOW_UP_TOKENS,
            "new_tokens": NEW_TOKENS,
            "budget_fraction": BUDGET_FRACTION,
            "repeats": repeats,
            "layout": bench.layout.fingerprint(),
            "disk_dir_parent": str(workdir.parent),
        },
    }


def print_table(results: dict[str, dict[str, Any]]) -> None:
    print(
        f"{'history':<9}{'tokens':>7}{'recompute s':>12}{'host s':>8}{'disk s':>8}"
        f"{'x host':>8}{'x disk':>8}{'reused':>8}{'turn1 s':>9}  tokens"
    )
    for label, r in results.items():
        t = r["ttft_s"]
        same = r["host_tokens_identical"] and r["disk_tokens_identical"]
        print(
            f"{label:<9}{r['prompt_tokens']:>7}{t['recompute']:>12.2f}{t['host']:>8.2f}"
            f"{t['disk']:>8.2f}{r['speedup_host']:>8.1f}{r['speedup_disk']:>8.1f}"
            f"{r['host_reused_tokens']:>8}{r['turn1_ttft_s']['host']:>9.2f}  "
            f"{'same' if same else 'DIFFERENT'}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = model_parser("reuse", __doc__)
    parser.sized("--repeats", 2, 1, "interleaved rounds", type=int, minimum=1)
    parser.add_argument("--dir", type=Path, default=None, help="where the disk tier writes")
    args = parser.parse(argv)
    labels = QUICK_HISTORIES if args.quick else tuple(HISTORIES)
    longest = max(HISTORIES[label] for label in labels) + FOLLOW_UP_TOKENS + NEW_TOKENS
    bench = load_bench(args, longest)
    info = header(
        {
            "host->device": describe_link(None, bench.device),
            "host<->disk": "real (local disk, O_DIRECT where the filesystem takes it)",
        }
    )
    print(
        f"model: {bench.description}; histories {', '.join(labels)} + {FOLLOW_UP_TOKENS}-token "
        f"follow-up, {NEW_TOKENS} new tokens; device budget {BUDGET_FRACTION:.0%} of the KV; "
        f"repeats {args.repeats}"
    )
    result = run(bench, labels, args.repeats, args.seed, args.dir)
    print_table(result["histories"])
    s = result["summary"]
    at = "4k" if "4k" in labels else labels[-1]
    finish(
        args.json,
        result,
        info,
        f"summary: next-turn TTFT at {at} {s[f'ttft_speedup_host_{at}']:.1f}x faster from host, "
        f"{s[f'ttft_speedup_disk_{at}']:.1f}x from disk than recompute; tokens identical "
        f"{s['tokens_identical']}, reused {s['reused']}",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
