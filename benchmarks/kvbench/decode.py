"""Benchmark ``decode``: long-context decode step time with most of the KV off the device.

Question: at a device budget of 10/25/50 % of the KV, how close does kvtier's decode step
come to the bound max(compute, bytes streamed ÷ link bandwidth), and to the all-resident
step, when the link is (a) real, (b) fast enough that compute is the bound, (c) so slow
that the link is the bound?

Baselines (same run, interleaved with kvtier): transformers ``DynamicCache`` with the whole
KV resident (the compute step), kvtier with prefetch off (synchronous fetch), and
``DynamicCache(offloading=True)`` where it runs (it needs CUDA streams).

Method. A seeded random-token prompt. The resident baseline prefills once and decodes from
a deep copy every time. kvtier computes the prompt's KV once (a full kvtier prefill, the
calibration run) into a shared host tier; every measured kvtier run is a fresh
``TieredCache`` that adopts the prompt's whole chunks from the host tier (leaving the same
residency as after its own prefill: sink and newest chunks on the device, the rest
streamed every step), prefills the last partial chunk, then decodes. Only decode steps
(first generated token to last) are timed; link bytes are read at the same two instants.
Greedy tokens are compared with the resident baseline's before any speed is reported.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import torch

from kvbench.common import finish, fmt, header, interleave, median, ratio
from kvbench.setup import (
    STAGING_BYTES,
    DecodeRun,
    Workload,
    budget_bytes_of,
    decode_dynamic,
    decode_tiered,
    describe_link,
    link_gbps,
    load_bench,
    model_parser,
    new_manager,
    prefill_dynamic,
    random_prompt,
)

BUDGETS = (0.10, 0.25, 0.50)
CALIBRATION_BUDGET = 0.25
# The throttled links: bytes per step ÷ (factor × compute step) GB/s. At factor f > 1 the
# link is the bound; perfect overlap then beats synchronous fetch by at most (1 + f) / f, so
# f = 1.5 (1.67x at best) shows what overlap buys while the link still sets the pace.
LINK_BOUND_FACTOR = 1.5
COMPUTE_BOUND_FACTOR = 0.3


@dataclass(frozen=True)
class Case:
    """One configuration to measure."""

    name: str
    kind: str  # "resident", "offloading" or "kvtier"
    budget_fraction: float | None = None
    budget_bytes: int | None = None
    gbps: float | None = None  # None: the real link
    link: str = "real"  # "real", "link-bound", "compute-bound"
    prefetch: bool = True
    staging_bytes: int = STAGING_BYTES
    on_host: bool = False  # the chunks past the budget attended in the host pool


def offloading_equal_budget(work: Workload) -> tuple[int, int] | None:
    """kvtier (budget, staging) using the device bytes ``DynamicCache(offloading=True)``
    keeps: two layers of the final KV (the layer computed and the one prefetched)."""
    offload_nbytes = 2 * work.final_kv_nbytes // work.layout.num_layers
    staging = min(STAGING_BYTES, offload_nbytes // 4)
    budget = offload_nbytes - staging
    if staging < work.layout.layer_nbytes or budget < work.layout.chunk_nbytes:
        return None
    return budget, staging


def build_cases(
    work: Workload,
    budgets: tuple[float, ...],
    resident: bool,
    offloading: bool,
    throttles: dict[str, float],
    real_gbps: float,
    notes: list[str],
) -> list[Case]:
    """Every case, in the order they alternate; appends to ``notes`` what is skipped."""
    cases: list[Case] = []
    if resident:
        cases.append(Case("resident", "resident"))
    equal = offloading_equal_budget(work) if offloading else None
    if offloading:
        cases.append(Case("offloading", "offloading"))
    if equal is not None:
        budget, staging = equal
        fraction = budget / work.final_kv_nbytes
        for prefetch in (True, False):
            name = "kvtier equal-mem real" + ("" if prefetch else " no-prefetch")
            cases.append(
                Case(name, "kvtier", fraction, budget, prefetch=prefetch, staging_bytes=staging)
            )
    links: dict[str, float | None] = {"real": None}
    for name, gbps in throttles.items():
        if work.device.type == "cuda" and gbps >= real_gbps:
            notes.append(f"{name} throttle ({gbps:.1f} GB/s) skipped: above the real link")
        else:
            links[name] = gbps
    for fraction in budgets:
        budget = budget_bytes_of(work, fraction)
        for link, rate in links.items():
            cases.append(
                Case(f"kvtier {fraction:.0%} {link}", "kvtier", fraction, budget, rate, link)
            )
        if work.device.type == "cpu":  # the link is not used: one case per budget
            cases.append(
                Case(f"kvtier {fraction:.0%} on-host", "kvtier", fraction, budget, on_host=True)
            )
    if "link-bound" in links:
        fraction = CALIBRATION_BUDGET
        cases.append(
            Case(
                f"kvtier {fraction:.0%} link-bound no-prefetch",
                "kvtier",
                fraction,
                budget_bytes_of(work, fraction),
                links["link-bound"],
                "link-bound",
                prefetch=False,
            )
        )
    return cases


# ---- the run ---------------------------------------------------------------------------------


def run(
    work: Workload, repeats: int, real_gbps: float, budgets: tuple[float, ...] = BUDGETS
) -> dict[str, Any]:
    model_kv = work.final_kv_nbytes
    notes: list[str] = []

    # Resident baseline: fits?  (the kept prefill plus the copy each run decodes from)
    resident_ok = True
    if work.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(work.device)
        resident_ok = 2 * model_kv + (2 << 30) < free
        if not resident_ok:
            notes.append(f"resident DynamicCache skipped: 2 x {model_kv} B KV > {free} B free")
    prefilled = None
    ref_tokens: list[int] | None = None
    timings: dict[str, float] = {}
    compute_step = float("nan")
    if resident_ok:
        start = time.perf_counter()
        prefilled = prefill_dynamic(work)
        timings["resident_prefill_s"] = time.perf_counter() - start
        warm = decode_dynamic(work, prefilled)
        ref_tokens, compute_step = warm.tokens, warm.step_s

    offloading_error: str | None = None
    try:
        start = time.perf_counter()
        offload_warm = decode_dynamic(work, None)
        timings["offloading_prefill_and_decode_s"] = time.perf_counter() - start
        if ref_tokens is None:
            ref_tokens = offload_warm.tokens
    except (AssertionError, RuntimeError, AttributeError) as exc:
        offloading_error = f"{type(exc).__name__}: {exc}".splitlines()[0]
        notes.append(f"DynamicCache(offloading=True) unavailable here: {offloading_error}")

    # Calibration: kvtier's full prefill fills the shared host tier; its decode gives the
    # bytes streamed per step at the 25 % budget.
    manager = new_manager(work)
    cal_budget = budget_bytes_of(work, CALIBRATION_BUDGET)
    start = time.perf_counter()
    calibration = decode_tiered(work, manager, cal_budget, None, True)
    timings["kvtier_prefill_and_decode_s"] = time.perf_counter() - start
    if ref_tokens is None:
        ref_tokens = calibration.tokens
        compute_step = calibration.step_s
        notes.append("no baseline ran: compute step and reference tokens from kvtier itself")
    bytes_per_step = calibration.bytes_per_step
    # Rounded to 3 significant digits: the throttle descriptions stay readable.
    link_bound_gbps = float(f"{bytes_per_step / (LINK_BOUND_FACTOR * compute_step) / 1e9:.3g}")
    compute_bound_gbps = float(
        f"{bytes_per_step / (COMPUTE_BOUND_FACTOR * compute_step) / 1e9:.3g}"
    )
    print(
        f"calibration (25 % budget): {bytes_per_step / 1e6:.1f} MB streamed per step, compute "
        f"step {compute_step * 1e3:.1f} ms -> link-bound {link_bound_gbps:.3f} GB/s, "
        f"compute-bound {compute_bound_gbps:.3f} GB/s (real link {real_gbps:.2f} GB/s)"
    )
    for gbps in (None, compute_bound_gbps, link_bound_gbps):
        print(f"  link {describe_link(gbps, work.device)}")

    cases = build_cases(
        work,
        budgets,
        resident_ok,
        offloading_error is None,
        {"compute-bound": compute_bound_gbps, "link-bound": link_bound_gbps},
        real_gbps,
        notes,
    )

    def measure(case: Case, _round: int) -> DecodeRun:
        if case.kind == "resident":
            return decode_dynamic(work, prefilled)
        if case.kind == "offloading":
            return decode_dynamic(work, None)
        assert case.budget_bytes is not None
        return decode_tiered(
            work,
            manager,
            case.budget_bytes,
            case.gbps,
            case.prefetch,
            case.staging_bytes,
            "host" if case.on_host else "stream",
        )

    runs = interleave({c.name: partial(measure, c) for c in cases}, repeats)
    manager.close()

    calibration_compute_step = compute_step
    if resident_ok:
        compute_step = median([r.step_s for r in runs["resident"]])
    results = {}
    for case in cases:
        results[case.name] = summarize(case, runs[case.name], ref_tokens, compute_step, real_gbps)
    summary = headline(results, compute_step)
    return {
        "summary": summary,
        "cases": results,
        "calibration": {
            "bytes_per_step": bytes_per_step,
            "compute_step_s": calibration_compute_step,
            "link_bound_gbps": link_bound_gbps,
            "compute_bound_gbps": compute_bound_gbps,
            "real_link_gbps": real_gbps,
            "kvtier_calibration_run": asdict(calibration),
            "reference_tokens": ref_tokens,
        },
        "timings": timings,
        "notes": notes,
        "offloading_error": offloading_error,
        "config": {
            "model": work.bench.description,
            "context": int(work.prompt.shape[1]),
            "new_tokens": work.new_tokens,
            "repeats": repeats,
            "final_kv_nbytes": model_kv,
            "layout": work.layout.fingerprint(),
            "chunk_nbytes": work.layout.chunk_nbytes,
            "budgets": list(budgets),
            "link_bound_factor": LINK_BOUND_FACTOR,
            "compute_bound_factor": COMPUTE_BOUND_FACTOR,
        },
    }


def summarize(
    case: Case,
    case_runs: list[DecodeRun],
    ref_tokens: list[int],
    compute_step: float,
    real_gbps: float,
) -> dict[str, Any]:
    """Median figures of one case; the bound uses the case's link (throttle or real)."""
    step = median([r.step_s for r in case_runs])
    nbytes = median([r.bytes_per_step for r in case_runs])
    gbps = case.gbps if case.gbps is not None else real_gbps
    bound = max(compute_step, nbytes / (gbps * 1e9))  # on-host: nbytes 0, compute
    identical = all(r.tokens == ref_tokens for r in case_runs)
    mismatch = None
    for r in case_runs:
        diff = [i for i, (a, b) in enumerate(zip(r.tokens, ref_tokens, strict=False)) if a != b]
        if diff:
            mismatch = diff[0]
            break
    peaks = [r.peak_extra_nbytes for r in case_runs if r.peak_extra_nbytes is not None]
    return {
        **asdict(case),
        "step_s": step,
        "steps_s": [r.step_s for r in case_runs],
        "bytes_per_step": nbytes,
        "wait_s_per_step": median([r.wait_s_per_step for r in case_runs]),
        "bound_s": bound,
        "efficiency": bound / step,
        "vs_resident": step / compute_step,
        "tokens_identical": identical,
        "first_mismatch": mismatch,
        "reused_tokens": case_runs[0].reused_tokens,
        "peak_extra_nbytes": max(peaks) if peaks else None,
    }


def headline(results: dict[str, dict[str, Any]], compute_step: float) -> dict[str, Any]:
    """The stable summary keys (None where the run had no such case)."""

    def step(name: str) -> float:
        return float(results[name]["step_s"]) if name in results else math.nan

    b = f"{CALIBRATION_BUDGET:.0%}"
    link_bound = results.get(f"kvtier {b} link-bound", {})
    return {
        "link_bound_efficiency": link_bound.get("efficiency"),
        "speedup_vs_no_prefetch": ratio(
            step(f"kvtier {b} link-bound no-prefetch"), step(f"kvtier {b} link-bound")
        ),
        "compute_bound_vs_resident": ratio(step(f"kvtier {b} compute-bound"), compute_step),
        "real_link_vs_resident": ratio(step(f"kvtier {b} real"), compute_step),
        "offloading_vs_kvtier_equal_mem": ratio(step("offloading"), step("kvtier equal-mem real")),
        # attending the chunks past the budget in the host pool instead of streaming them
        "on_host_speedup_link_bound_10": ratio(
            step("kvtier 10% link-bound"), step("kvtier 10% on-host")
        ),
        "on_host_vs_stream_compute_bound_10": ratio(
            step("kvtier 10% on-host"), step("kvtier 10% compute-bound")
        ),
        "resident_step_ms": compute_step * 1e3 if math.isfinite(compute_step) else None,
        "tokens_identical": all(r["tokens_identical"] for r in results.values()),
    }


def print_table(results: dict[str, dict[str, Any]]) -> None:
    peaks = any(r["peak_extra_nbytes"] is not None for r in results.values())
    peak_head = f"{'peak MB':>9}" if peaks else ""
    print(
        f"{'case':<36}{'budget MB':>10}{'GB/s':>8}{'step ms':>9}{'MB/step':>9}"
        f"{'bound ms':>9}{'eff':>6}{'x res':>7}{peak_head}  tokens"
    )
    for name, r in results.items():
        budget = f"{r['budget_bytes'] / 1e6:.1f}" if r["budget_bytes"] else "all"
        gbps = f"{r['gbps']:.3g}" if r["gbps"] is not None else "real"
        ok = "same" if r["tokens_identical"] else f"DIFF@{r['first_mismatch']}"
        peak = ""
        if peaks:
            nbytes = r["peak_extra_nbytes"]
            peak = f"{nbytes / 1e6:>9.1f}" if nbytes is not None else f"{'':>9}"
        print(
            f"{name:<36}{budget:>10}{gbps:>8}{r['step_s'] * 1e3:>9.1f}"
            f"{r['bytes_per_step'] / 1e6:>9.1f}{r['bound_s'] * 1e3:>9.1f}"
            f"{r['efficiency']:>6.2f}{r['vs_resident']:>7.2f}{peak}  {ok}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = model_parser("decode", __doc__)
    parser.sized("--context", 4096, 2048, "prompt tokens", type=int, minimum=512)
    parser.sized("--new-tokens", 16, 6, "decoded", type=int, minimum=3)
    parser.sized("--repeats", 2, 1, "interleaved rounds", type=int, minimum=1)
    args = parser.parse(argv)
    context, new_tokens, repeats = args.context, args.new_tokens, args.repeats
    bench = load_bench(args, context + new_tokens)
    device = bench.device
    prompt = random_prompt(int(bench.model.config.vocab_size), context, args.seed)
    work = Workload(bench, prompt, new_tokens)
    real_gbps, real_desc = link_gbps(device)
    links = {
        "measured": f"{real_desc}: {real_gbps:.2f} GB/s",
        "kvtier unthrottled": describe_link(None, device),
    }
    info = header(links)
    print(
        f"model: {bench.description}; context {context} + {new_tokens} new tokens; "
        f"final KV {work.final_kv_nbytes / 1e6:.1f} MB; repeats {repeats}"
    )
    budgets = (CALIBRATION_BUDGET,) if args.quick else BUDGETS
    result = run(work, repeats, real_gbps, budgets)
    for name in ("link-bound", "compute-bound"):
        gbps = result["calibration"][name.replace("-", "_") + "_gbps"]
        links[f"kvtier {name}"] = describe_link(gbps, device)
    print_table(result["cases"])
    for note in result["notes"]:
        print(f"note: {note}")
    s = result["summary"]
    offloading = ""
    if s["offloading_vs_kvtier_equal_mem"] is not None:
        offloading = f", offloading step {fmt(s['offloading_vs_kvtier_equal_mem'])}x kvtier's"
    finish(
        args.json,
        result,
        info,
        f"summary: link-bound efficiency {fmt(s['link_bound_efficiency'])}, "
        f"{fmt(s['speedup_vs_no_prefetch'])}x vs no prefetch, compute-bound step "
        f"{fmt(s['compute_bound_vs_resident'])}x resident{offloading}, tokens identical "
        f"{s['tokens_identical']}",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
