"""``kvtier plan``: the report (``plan``, ``render``), the figures (``plot``) and ``main``.

``plan`` gathers every prediction for one model, machine and workload into a JSON-ready
dict; ``render`` writes it as text; ``plot`` draws step time against context for each
strategy and the barrel (each resource's busy share of the step at the operating point)
as PNGs. Nothing is measured here: the rates come from the hardware (a calibration
profile, or a preset on paper).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from kvtier.plan.hardware import GB, Hardware, hardware
from kvtier.plan.predict import (
    STRATEGIES,
    decode_step,
    max_sessions,
    resident_fraction,
    reuse_ttft,
)
from kvtier.plan.shapes import ModelShape, model_shape
from kvtier.plan.workload import Workload, workload

CONTEXTS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


def plan(model: ModelShape, hw: Hardware, load: Workload, tpot_s: float) -> dict[str, Any]:
    """Every prediction (see the module docstring)."""
    capacity = max_sessions(model, hw, load.context, tpot_s)
    batch = capacity.sessions if capacity else 1
    fraction = resident_fraction(model, hw, batch, load.context)
    strategies = STRATEGIES if fraction >= 1 else [s for s in STRATEGIES if s != "resident"]
    steps = {
        s: decode_step(model, hw, batch, load.context, fraction, s).__dict__ for s in strategies
    }
    at = decode_step(
        model, hw, batch, load.context, fraction, capacity.strategy if capacity else "auto"
    )
    kv_gb = load.context * model.kv_bytes_per_token / GB
    idle_gb = load.sessions * kv_gb  # every live conversation's KV, kept for its next turn
    device_gb = max(0.0, hw.device_memory_gb * 0.9 - model.weight_bytes / GB)
    below_gb = hw.host_memory_gb + hw.cxl_memory_gb
    tiers = {"lower": hw.disk_gbps, "host": hw.link_gbps}
    ttft = {name: reuse_ttft(model, hw, load.context, gbps) for name, gbps in tiers.items() if gbps}
    return {
        "model": {
            **model.__dict__,
            "params": model.params,
            "weight_gb": model.weight_bytes / GB,
            "kv_kb_per_token": model.kv_bytes_per_token / 1e3,
        },
        "hardware": hw.__dict__,
        "workload": load.__dict__,
        "tpot_slo_s": tpot_s,
        "capacity": capacity.__dict__ if capacity else None,
        "operating_point": {"batch": batch, "resident_fraction": fraction, "step": at.__dict__},
        "steps_at_operating_point": steps,
        "reuse_ttft": ttft,
        "memory": {
            "kv_gb_per_session": kv_gb,
            "live_sessions_kv_gb": idle_gb,
            "device_kv_gb": device_gb,
            "host_gb_worth_buying": max(0.0, idle_gb - device_gb),
            "host_gb_have": below_gb,
            "disk_gb_for_the_rest": max(0.0, idle_gb - device_gb - below_gb),
        },
        "on_paper": not hw.measured,
    }


def render(p: dict[str, Any]) -> str:
    """The text report."""
    m, hw, load, mem = p["model"], p["hardware"], p["workload"], p["memory"]
    cap: dict[str, Any] | None = p["capacity"]
    op = p["operating_point"]
    lines = [
        f"model    {m['name']}: {m['params'] / 1e9:.2f} B params, {m['weight_gb']:.1f} GB weights, "
        f"{m['kv_kb_per_token']:.1f} KB KV per token",
        f"hardware {hw['name']}: {hw['description']}",
        f"workload {load['source']}: context {load['context']} (p90 {load['context_p90']}), "
        f"{load['output']} out, {load['sessions']} live sessions, {load['rate_per_s']:.2f} req/s",
        "",
        f"decode step at {op['batch']} sessions x {load['context']} tokens, "
        f"{op['resident_fraction']:.0%} of their KV on the device:",
    ]
    for name, step in p["steps_at_operating_point"].items():
        lines.append(f"  {name:<9}{step['seconds'] * 1e3:>9.1f} ms   binding: {step['binding']}")
    busy = op["step"]["busy_s"]
    lines.append("  barrel:  " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in busy.items()))
    if cap is None:
        lines.append(f"sessions within {p['tpot_slo_s'] * 1e3:.0f} ms per token: none fit")
    else:
        lines.append(
            f"sessions within {p['tpot_slo_s'] * 1e3:.0f} ms per token: {cap['sessions']} "
            f"({cap['strategy']}, {cap['step_s'] * 1e3:.1f} ms; binding {cap['binding']}; "
            f"KV {cap['device_kv_gb']:.1f} GB device + {cap['host_kv_gb']:.1f} GB host)"
        )
    for tier, t in p["reuse_ttft"].items():
        lines.append(
            f"reuse TTFT from {tier} tier: load {t['load_s']:.2f} s, recompute "
            f"{t['recompute_s']:.2f} s, overlap {t['overlap_s']:.2f} s "
            f"(recompute the first {t['front_tokens']} tokens while the rest loads)"
        )
    lines.append(
        f"memory: {mem['kv_gb_per_session']:.2f} GB KV per session; the live sessions hold "
        f"{mem['live_sessions_kv_gb']:.1f} GB: {mem['device_kv_gb']:.1f} GB fit on the "
        f"device, {mem['host_gb_worth_buying']:.1f} GB of host memory is worth buying "
        f"(have {mem['host_gb_have']:.0f}), disk for {mem['disk_gb_for_the_rest']:.1f} GB more"
    )
    if p["on_paper"]:
        lines.append(
            "note: these GPU figures are on paper (spec sheets x efficiency) until a GPU run "
            "validates them"
        )
    return "\n".join(lines)


def plot(model: ModelShape, hw: Hardware, p: dict[str, Any], folder: Path) -> list[Path]:
    """Two PNGs in ``folder``: step time against context per strategy, and the barrel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    batch = p["operating_point"]["batch"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for strategy in STRATEGIES:
        xs, ys = [], []
        for context in CONTEXTS:
            fraction = resident_fraction(model, hw, batch, context)
            xs.append(context)
            ys.append(decode_step(model, hw, batch, context, fraction, strategy).seconds * 1e3)
        resident = strategy == "resident"
        label = "resident (if the device held it all)" if resident else strategy
        ax.plot(xs, ys, marker="o", label=label, linestyle="--" if resident else "-")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens per session)")
    ax.set_ylabel("decode step (ms)")
    paper = " (on paper)" if p["on_paper"] else ""
    ax.set_title(f"{model.name} on {hw.name}{paper}: {batch} sessions")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    steps = folder / f"plan-{model.name}-{hw.name}-steps.png"
    fig.tight_layout()
    fig.savefig(steps, dpi=110)
    plt.close(fig)
    busy = p["operating_point"]["step"]["busy_s"]
    total = p["operating_point"]["step"]["seconds"]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    names = list(busy)
    ax.barh(names, [busy[n] / total * 100 for n in names], color="tab:blue")
    ax.set_xlabel("busy share of the step (%)")
    ax.set_title(f"the barrel at {batch} sessions x {p['workload']['context']} tokens{paper}")
    ax.set_xlim(0, 100)
    barrel = folder / f"plan-{model.name}-{hw.name}-barrel.png"
    fig.tight_layout()
    fig.savefig(barrel, dpi=110)
    plt.close(fig)
    return [steps, barrel]


def main(argv: list[str] | None = None) -> int:
    """``kvtier plan``."""
    parser = argparse.ArgumentParser(
        prog="kvtier plan",
        description="predict decode step time, reuse TTFT, sessions per SLO and the binding "
        "resource for a model, a machine and a workload",
    )
    parser.add_argument("--model", default=None, help="preset or HF config folder (embedded)")
    parser.add_argument(
        "--hardware", default="this", help="this (the calibration profile), a preset, or a profile"
    )
    parser.add_argument(
        "--workload", default="context=4096,sessions=16,rate=0.5", help="k=v,… or a trace"
    )
    parser.add_argument("--tpot-ms", type=float, default=100.0, help="the per-token SLO")
    parser.add_argument("--dtype-bytes", type=int, default=None, help="2 (bf16) or 4 (fp32)")
    parser.add_argument("--plots", type=Path, default=None, help="write the PNGs here")
    parser.add_argument("--json", type=Path, default=None, help="write every figure here")
    args = parser.parse_args(argv)
    if args.tpot_ms <= 0:
        parser.error(f"--tpot-ms: must be > 0, got {args.tpot_ms}")
    profile = None
    if args.hardware == "this":
        from kvtier.models import load_model
        from kvtier.plan.shapes import PRESETS as MODEL_PRESETS
        from kvtier.profiles import load_profile

        if args.model in MODEL_PRESETS:
            parser.error(
                "--hardware this: the profile is of a model kvtier ran here; pass its folder "
                "(or nothing: the embedded model), or a GPU preset for a preset model"
            )
        profile = load_profile(load_model(args.model).model_id)
    dtype_bytes = args.dtype_bytes or (4 if args.hardware == "this" else 2)
    model = model_shape(args.model, dtype_bytes)
    hw = hardware(args.hardware, profile)
    result = plan(model, hw, workload(args.workload), args.tpot_ms / 1e3)
    print(render(result))
    if args.plots is not None:
        for path in plot(model, hw, result, args.plots):
            print(f"wrote {path}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1, default=str) + "\n")
        print(f"wrote {args.json}")
    return 0
