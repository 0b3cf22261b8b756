"""Benchmark ``librarian``: does the cost model's plan match the best fixed strategy?

Question: with most of the KV off the device, is the plan ``placement="auto"`` chooses
(per pass and layer group: stream each non-resident chunk over the link, or attend it in
the host pool where it lies) as fast as the better of the fixed strategies, stream-only
and host-only, in every setting, and how much faster than stream-only is it where the link
is the short stave?

Settings: context × device budget (10 %, 25 % of the KV) × link (the real one; and two
throttles derived in the run, at the longest context and the 10 % budget, from the bytes a
stream-only decode step moves, B, and the resident ``DynamicCache`` step, T: *link-bound*
``B / (2.5 T)`` and *compute-bound* ``B / (1.1 T)`` GB/s, where stream-only would take 2.5×
and 1.1× the resident step). Each setting runs stream, host and auto (in a new random
order each round), interleaved over rounds with the resident baseline; the figure is the
fastest round's decode step (noise on a shared machine only adds; the medians are in the
JSON too). Where auto's decisions are a fixed strategy's, both are one configuration: they
share the fastest of their pooled rounds (``same_plan_as``; ``unpooled_regret`` keeps the
two samples apart).

The rates auto chooses from (``PlacementRates``) are measured in the run: host and device
attention GB/s by ``kvtier.calibrate.measure_attention`` at the run's thread count, the
link by the real link's memcpy (a throttle reaches the cost model through the cache's
link config), and the compute a pass does besides
non-resident attention as T less the non-resident KV bytes ÷ the device attention rate.

Greedy tokens of every run are compared with the resident baseline's.
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from kvbench.common import finish, fmt, header, median, ratio
from kvbench.setup import (
    DecodeRun,
    Workload,
    budget_bytes_of,
    decode_dynamic,
    decode_tiered,
    link_gbps,
    load_bench,
    model_parser,
    new_manager,
    prefill_dynamic,
    random_prompt,
)
from kvtier.calibrate import measure_attention
from kvtier.config import PlacementRates
from kvtier.manager import KVManager

BUDGETS = (0.10, 0.25)
LINK_BOUND_RATIO = 2.5  # stream-only step ÷ resident step at the link-bound throttle
COMPUTE_BOUND_RATIO = 1.1
STRATEGIES = ("stream", "host", "auto")
FIXED = ("stream", "host")


@dataclass(frozen=True)
class Setting:
    """One point of the sweep: a context, a device budget and a link."""

    context: int
    budget: float
    link: str  # "real", "compute-bound", "link-bound"
    gbps: float | None  # the throttle; None: the real link

    @property
    def name(self) -> str:
        return f"{self.context} {self.budget:.0%} {self.link}"


@dataclass
class Context:
    """One context's prompt, baseline and host tier (filled by a kvtier prefill)."""

    work: Workload
    manager: KVManager
    prefilled: Any  # the resident baseline's DynamicCache (each run decodes from a copy)
    reference: list[int]
    resident_s: list[float]
    stream_bytes_per_step: float  # at the 10 % budget, real link


def prepare(bench: Any, context: int, new_tokens: int, seed: int) -> Context:
    """The resident baseline (reference tokens, a first step time) and the host tier that
    every kvtier run of this context adopts its prompt chunks from."""
    prompt = random_prompt(int(bench.model.config.vocab_size), context, seed)
    work = Workload(bench, prompt, new_tokens)
    prefilled = prefill_dynamic(work)
    decode_dynamic(work, prefilled)  # warm-up, untimed
    warm = decode_dynamic(work, prefilled)
    manager = new_manager(work)
    first = decode_tiered(work, manager, budget_bytes_of(work, BUDGETS[0]), None, True)
    if first.tokens != warm.tokens:
        raise RuntimeError(f"context {context}: kvtier's tokens differ from DynamicCache's")
    return Context(work, manager, prefilled, warm.tokens, [warm.step_s], first.bytes_per_step)


def rates_for(
    ctx: Context, budget: float, resident_s: float, attention: dict[str, Any], real: float
) -> PlacementRates:
    """What auto is told about this setting (see the module docstring)."""
    work = ctx.work
    host = attention["host"]
    host_gbps = next(iter((host.get("kvtier") or host["torch"]).values()))
    device_gbps = float(attention["device"]["gbps"])
    outside = max(0, work.final_kv_nbytes - budget_bytes_of(work, budget))
    compute_s = max(0.0, resident_s - outside / (device_gbps * 1e9))
    return PlacementRates(  # the throttle reaches auto through the cache's link config
        link_gbps=real,
        host_attention_gbps=float(host_gbps),
        device_attention_gbps=device_gbps,
        compute_s=compute_s,
        concurrent=work.device.type != "cpu",
    )


def run(
    bench: Any, contexts: tuple[int, ...], new_tokens: int, repeats: int, seed: int
) -> dict[str, Any]:
    real, real_desc = link_gbps(bench.device)
    started = time.perf_counter()
    prepared = {c: prepare(bench, c, new_tokens, seed) for c in contexts}
    longest = prepared[max(contexts)]
    step_t = longest.resident_s[0]
    nbytes = longest.stream_bytes_per_step
    link_bound = float(f"{nbytes / (LINK_BOUND_RATIO * step_t) / 1e9:.3g}")
    compute_bound = float(f"{nbytes / (COMPUTE_BOUND_RATIO * step_t) / 1e9:.3g}")
    print(
        f"derived at {max(contexts)} tokens, 10 % budget: {nbytes / 1e6:.1f} MB streamed per "
        f"step, resident step {step_t * 1e3:.1f} ms -> link-bound {link_bound} GB/s, "
        f"compute-bound {compute_bound} GB/s (real link {real:.2f} GB/s, {real_desc})"
    )
    threads = torch.get_num_threads()
    layout = longest.work.layout
    groups = int(bench.model.config.num_attention_heads) // layout.num_kv_heads
    attention = measure_attention(layout, groups, max(contexts), [threads], 3, bench.device)
    links = {"real": None, "compute-bound": compute_bound, "link-bound": link_bound}
    settings = [
        Setting(c, b, name, gbps) for c in contexts for b in BUDGETS for name, gbps in links.items()
    ]
    runs: dict[tuple[str, str], list[DecodeRun]] = {}
    order = random.Random(seed)  # the strategies of a setting run in a new order each round
    for round_ in range(repeats):  # interleaved: every case once per round
        for c, ctx in prepared.items():
            ctx.resident_s.append(decode_dynamic(ctx.work, ctx.prefilled).step_s)
            for setting in (s for s in settings if s.context == c):
                rates = rates_for(ctx, setting.budget, median(ctx.resident_s), attention, real)
                for strategy in order.sample(STRATEGIES, len(STRATEGIES)):
                    got = decode_tiered(
                        ctx.work,
                        ctx.manager,
                        budget_bytes_of(ctx.work, setting.budget),
                        setting.gbps,
                        True,
                        placement=strategy,
                        rates=rates if strategy == "auto" else None,
                    )
                    runs.setdefault((setting.name, strategy), []).append(got)
        print(f"round {round_ + 1}/{repeats} done ({time.perf_counter() - started:.0f} s)")
    for ctx in prepared.values():
        ctx.manager.close()
    results = {s.name: summarize(s, runs, prepared[s.context]) for s in settings}
    return {
        "summary": headline(results, max(contexts)),
        "settings": results,
        "derived": {
            "stream_bytes_per_step_10": nbytes,
            "resident_step_s": step_t,
            "link_bound_gbps": link_bound,
            "compute_bound_gbps": compute_bound,
            "real_link_gbps": real,
            "attention": attention,
            "threads": threads,
        },
        "config": {
            "model": bench.description,
            "contexts": list(contexts),
            "budgets": list(BUDGETS),
            "new_tokens": new_tokens,
            "repeats": repeats,
            "link_bound_ratio": LINK_BOUND_RATIO,
            "compute_bound_ratio": COMPUTE_BOUND_RATIO,
        },
        "seconds": time.perf_counter() - started,
    }


def summarize(
    setting: Setting, runs: dict[tuple[str, str], list[DecodeRun]], ctx: Context
) -> dict[str, Any]:
    """Per strategy the fastest and the median step over the rounds; auto's regret (on the
    fastest: on a shared machine noise only adds) against the better fixed strategy; the
    share of auto's non-resident chunk reads it placed on the host.

    Where auto's plan is a fixed strategy's (every run made the same decisions for the
    same chunk reads), the two are one configuration measured twice: both take the
    fastest of their pooled runs, so the regret compares plans, not two samples of one
    (the unpooled figure stays in ``unpooled_regret``)."""
    of = {s: runs[(setting.name, s)] for s in STRATEGIES}
    steps = {s: min(r.step_s for r in of[s]) for s in STRATEGIES}
    medians = {s: median([r.step_s for r in of[s]]) for s in STRATEGIES}
    resident = min(ctx.resident_s)
    best_unpooled = min(FIXED, key=lambda s: steps[s])
    unpooled_regret = steps["auto"] / steps[best_unpooled] - 1
    same = next(
        (
            s
            for s in FIXED
            if all(
                Counter(a.decided_chunks) == Counter(b.decided_chunks)
                for a in of["auto"]
                for b in of[s]
            )
        ),
        None,
    )
    if same is not None:
        pooled = [*of["auto"], *of[same]]
        steps["auto"] = steps[same] = min(r.step_s for r in pooled)
        medians["auto"] = medians[same] = median([r.step_s for r in pooled])
    best = min(FIXED, key=lambda s: steps[s])
    decided: Counter[str] = Counter()
    for r in of["auto"]:
        decided.update(r.decided_chunks)
    placed = decided["stream"] + decided["host"]
    return {
        "same_plan_as": same,
        "unpooled_regret": unpooled_regret,
        "context": setting.context,
        "budget": setting.budget,
        "link": setting.link,
        "gbps": setting.gbps,
        "step_s": steps,
        "median_step_s": medians,
        "vs_resident": {s: steps[s] / resident for s in STRATEGIES},
        "resident_step_s": resident,
        "best_fixed": best,
        "regret": steps["auto"] / steps[best] - 1,
        "auto_host_share": decided["host"] / placed if placed else None,
        "tokens_identical": all(
            r.tokens == ctx.reference for s in STRATEGIES for r in runs[(setting.name, s)]
        ),
    }


def headline(results: dict[str, dict[str, Any]], context: int) -> dict[str, Any]:
    """The stable summary keys."""

    def step(link: str, strategy: str) -> float:
        key = f"{context} {BUDGETS[0]:.0%} {link}"
        return float(results[key]["step_s"][strategy]) if key in results else math.nan

    return {
        "speedup_vs_stream_only_link_bound": ratio(
            step("link-bound", "stream"), step("link-bound", "auto")
        ),
        "ratio_vs_stream_only_compute_bound": ratio(
            step("compute-bound", "auto"), step("compute-bound", "stream")
        ),
        "max_regret": max(r["regret"] for r in results.values()),
        "max_unpooled_regret": max(r["unpooled_regret"] for r in results.values()),
        "settings": len(results),
        "stream_only_vs_resident_link_bound": next(
            (r["vs_resident"]["stream"] for r in results.values() if _is(r, context, "link-bound")),
            None,
        ),
        "stream_only_vs_resident_compute_bound": next(
            (
                r["vs_resident"]["stream"]
                for r in results.values()
                if _is(r, context, "compute-bound")
            ),
            None,
        ),
        "tokens_identical": all(r["tokens_identical"] for r in results.values()),
    }


def _is(result: dict[str, Any], context: int, link: str) -> bool:
    return bool(
        result["context"] == context and result["budget"] == BUDGETS[0] and result["link"] == link
    )


def print_table(results: dict[str, dict[str, Any]]) -> None:
    print(
        f"{'setting':<26}{'GB/s':>7}{'stream ms':>10}{'host ms':>9}{'auto ms':>9}"
        f"{'x res':>7}{'best':>8}{'regret':>8}{'auto host':>10}  tokens"
    )
    for name, r in results.items():
        s = r["step_s"]
        gbps = f"{r['gbps']:.3g}" if r["gbps"] is not None else "real"
        share = r["auto_host_share"]
        print(
            f"{name:<26}{gbps:>7}{s['stream'] * 1e3:>10.1f}{s['host'] * 1e3:>9.1f}"
            f"{s['auto'] * 1e3:>9.1f}{r['vs_resident']['auto']:>7.2f}{r['best_fixed']:>8}"
            f"{r['regret']:>+8.1%}{'' if share is None else f'{share:.0%}':>10}  "
            f"{'same' if r['tokens_identical'] else 'DIFF'}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = model_parser("librarian", __doc__)
    parser.sized("--contexts", "2048,4096", "1024", "comma-separated prompt tokens")
    parser.sized("--new-tokens", 16, 6, "decoded", type=int, minimum=3)
    parser.sized("--repeats", 3, 1, "interleaved rounds", type=int, minimum=1)
    args = parser.parse(argv)
    contexts = tuple(int(c) for c in args.contexts.split(","))
    new_tokens, repeats = args.new_tokens, args.repeats
    if min(contexts) < 512:
        raise ValueError(f"--contexts: each must be >= 512, got {args.contexts}")
    bench = load_bench(args, max(contexts) + new_tokens)
    info = header()
    print(f"model: {bench.description}; contexts {contexts} + {new_tokens} new tokens")
    result = run(bench, contexts, new_tokens, repeats, args.seed)
    print_table(result["settings"])
    s = result["summary"]
    finish(
        args.json,
        result,
        info,
        f"summary: {fmt(s['speedup_vs_stream_only_link_bound'])}x stream-only where the link "
        f"binds, {fmt(s['ratio_vs_stream_only_compute_bound'])}x stream-only's step where "
        f"compute binds, max regret {s['max_regret']:+.1%} over {s['settings']} settings, "
        f"tokens identical {s['tokens_identical']}",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
