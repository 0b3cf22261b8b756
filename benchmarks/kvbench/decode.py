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

import copy
import dataclasses
import math
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from transformers import DynamicCache

from kvbench.common import base_parser, machine_info, median, print_machine, write_json
from kvbench.setup import (
    BenchModel,
    DecodeRun,
    StepClock,
    add_model_args,
    allocated_nbytes,
    describe_link,
    link_gbps,
    load_bench_model,
    random_prompt,
    setup_device,
    use_stock_attention,
)
from kvtier.config import (
    HostConfig,
    LinkConfig,
    ManagerConfig,
    PlacementRates,
    TieredCacheConfig,
)
from kvtier.hf.cache import TieredCache
from kvtier.hf.generate import prefill
from kvtier.kv.layout import KVLayout
from kvtier.manager import KVManager

BUDGETS = (0.10, 0.25, 0.50)
CALIBRATION_BUDGET = 0.25
# The throttled links: bytes per step ÷ (factor × compute step) GB/s. At factor f > 1 the
# link is the bound; perfect overlap then beats synchronous fetch by at most (1 + f) / f, so
# f = 1.5 (1.67x at best) shows what overlap buys while the link still sets the pace.
LINK_BOUND_FACTOR = 1.5
COMPUTE_BOUND_FACTOR = 0.3
STAGING_BYTES = 64 << 20


@dataclass(frozen=True)
class Workload:
    """The model and the prompt every case decodes."""

    bench: BenchModel
    prompt: torch.Tensor  # [1, S]
    new_tokens: int

    @property
    def model(self) -> Any:
        return self.bench.model

    @property
    def layout(self) -> KVLayout:
        return self.bench.layout

    @property
    def device(self) -> torch.device:
        return self.bench.device

    @property
    def final_kv_nbytes(self) -> int:
        return self.layout.kv_nbytes(self.prompt.shape[1] + self.new_tokens)

    def greedy_kwargs(self) -> dict[str, Any]:
        return self.bench.greedy_kwargs(self.new_tokens)


@torch.no_grad()
def prefill_dynamic(work: Workload) -> DynamicCache:
    """The prompt but its last token in a resident ``DynamicCache`` (kept, copied per run)."""
    use_stock_attention(work.model)
    cache = DynamicCache(config=work.model.config)
    ids = work.prompt[:, :-1].to(work.device)
    work.model(ids, cache=cache, use_cache=True, logits_to_keep=1)
    return cache


def decode_dynamic(work: Workload, prefilled: DynamicCache | None) -> DecodeRun:
    """Resident baseline (from a copy of ``prefilled``), or ``offloading=True`` when None."""
    use_stock_attention(work.model)
    clock = StepClock(lambda: (0, 0.0), work.device, allocated_nbytes(work.device))
    if prefilled is not None:
        cache = copy.deepcopy(prefilled)
    else:
        cache = DynamicCache(config=work.model.config, offloading=True)
    ids = work.prompt.to(work.device)
    out = work.model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        cache=cache,
        streamer=clock,
        **work.greedy_kwargs(),
    )
    del cache
    return clock.run(out, ids.shape[1])


def new_manager(work: Workload) -> KVManager:
    """A host tier holding the whole context (the KV every kvtier case streams from)."""
    layout = work.layout
    host_nbytes = work.final_kv_nbytes + 4 * layout.chunk_nbytes
    config = ManagerConfig(
        chunk_tokens=layout.chunk_tokens, host=HostConfig(capacity_bytes=host_nbytes)
    )
    return KVManager(layout, work.bench.model_id, config)


def decode_tiered(
    work: Workload,
    manager: KVManager,
    budget_bytes: int,
    gbps: float | None,
    prefetch: bool,
    staging_bytes: int = STAGING_BYTES,
    placement: str = "stream",
    rates: PlacementRates | None = None,
) -> DecodeRun:
    """A fresh ``TieredCache``: reuse the cached prompt chunks, prefill the rest, decode.
    ``placement`` (and ``rates`` for ``auto``) say where the chunks past the budget are
    attended; the run records the chunk reads by decision."""
    start_allocated = allocated_nbytes(work.device)
    config = TieredCacheConfig(
        device_budget_bytes=budget_bytes,
        staging_bytes=staging_bytes,
        prefetch=prefetch,
        link=LinkConfig(gbps=gbps),
        placement=placement,
        rates=rates,
    )
    cache = TieredCache(work.model, config, manager=manager, model_id=work.bench.model_id)
    try:
        ids = work.prompt.to(work.device)
        reused = prefill(work.model, cache, ids)

        def link_counters() -> tuple[int, float]:
            link = cache.stats().link
            return link.bytes, link.wait_s

        clock = StepClock(link_counters, work.device, start_allocated)
        out = work.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            cache=cache,
            streamer=clock,
            **work.greedy_kwargs(),
        )
        run = clock.run(out, ids.shape[1], reused)
        return dataclasses.replace(run, decided_chunks=cache.stats().decided_chunks)
    finally:
        cache.close()


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


def budget_bytes_of(work: Workload, fraction: float) -> int:
    """``fraction`` of the final KV, at least the one tail chunk the cache needs."""
    return max(int(fraction * work.final_kv_nbytes), work.layout.chunk_nbytes)


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

    def measure(case: Case) -> DecodeRun:
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

    runs: dict[str, list[DecodeRun]] = {c.name: [] for c in cases}
    for _ in range(repeats):  # interleaved: A B C … A B C …
        for case in cases:
            runs[case.name].append(measure(case))
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

    def ratio(num: float, den: float) -> float | None:
        value = num / den
        return value if math.isfinite(value) else None

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


def fmt(value: float | None, spec: str = ".2f") -> str:
    """``value`` formatted, or ``n/a`` when the run had no such figure."""
    return "n/a" if value is None else format(value, spec)


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
    parser = base_parser("decode", __doc__.splitlines()[0] if __doc__ else "decode")
    add_model_args(parser)
    parser.add_argument(
        "--context", type=int, default=None, help="prompt tokens (4096; quick 2048)"
    )
    parser.add_argument("--new-tokens", type=int, default=None, help="decoded (16; quick 6)")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved rounds (2; quick 1)")
    args = parser.parse_args(argv)
    context = args.context or (2048 if args.quick else 4096)
    new_tokens = args.new_tokens or (6 if args.quick else 16)
    repeats = args.repeats or (1 if args.quick else 2)
    if context < 512 or new_tokens < 3 or repeats < 1:
        raise ValueError("--context >= 512, --new-tokens >= 3 and --repeats >= 1 are needed")
    device = setup_device(args)
    bench = load_bench_model(args, device, context + new_tokens)
    prompt = random_prompt(int(bench.model.config.vocab_size), context, args.seed)
    work = Workload(bench, prompt, new_tokens)
    real_gbps, real_desc = link_gbps(device)
    links = {
        "measured": f"{real_desc}: {real_gbps:.2f} GB/s",
        "kvtier unthrottled": describe_link(None, device),
    }
    info = machine_info(links)
    print_machine(info)
    print(
        f"model: {bench.description}; context {context} + {new_tokens} new tokens; "
        f"final KV {work.final_kv_nbytes / 1e6:.1f} MB; repeats {repeats}"
    )
    budgets = (CALIBRATION_BUDGET,) if args.quick else BUDGETS
    result = run(work, repeats, real_gbps, budgets)
    for name in ("link-bound", "compute-bound"):
        gbps = result["calibration"][name.replace("-", "_") + "_gbps"]
        links[f"kvtier {name}"] = describe_link(gbps, device)
    result["machine"] = info
    print_table(result["cases"])
    for note in result["notes"]:
        print(f"note: {note}")
    write_json(args.json, result)
    s = result["summary"]
    offloading = ""
    if s["offloading_vs_kvtier_equal_mem"] is not None:
        offloading = f", offloading step {fmt(s['offloading_vs_kvtier_equal_mem'])}x kvtier's"
    print(
        f"summary: link-bound efficiency {fmt(s['link_bound_efficiency'])}, "
        f"{fmt(s['speedup_vs_no_prefetch'])}x vs no prefetch, compute-bound step "
        f"{fmt(s['compute_bound_vs_resident'])}x resident{offloading}, tokens identical "
        f"{s['tokens_identical']}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
