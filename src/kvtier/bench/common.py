"""What every benchmark shares: machine description, interleaved timing, JSON output."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def machine_info(links: dict[str, str] | None = None) -> dict[str, Any]:
    """The machine a run happened on, for the report header and the JSON."""
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (no GPU)"
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "device": device,
        "python": platform.python_version(),
        "links": links or {},
    }


def print_machine(info: dict[str, Any]) -> None:
    print(
        f"machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']} "
        f"({info['torch_threads']} threads), device {info['device']}"
    )
    for name, desc in info["links"].items():
        print(f"  link {name}: {desc}")


def timed(fn: Callable[[], object]) -> float:
    """Seconds one call of ``fn`` takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleave(cases: dict[str, Callable[[], float]], repeats: int) -> dict[str, list[float]]:
    """Run each case ``repeats`` times, alternating A B C A B C …; each returns a figure."""
    results: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, case in cases.items():
            results[name].append(case())
    return results


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def base_parser(name: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"kvtier bench {name}", description=description)
    parser.add_argument("--quick", action="store_true", help="CI smoke mode (under a minute)")
    parser.add_argument("--json", type=Path, default=None, help="write every figure here")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def write_json(path: Path | None, payload: dict[str, Any]) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n")
    print(f"wrote {path}")
