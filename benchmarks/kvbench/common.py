"""What every benchmark shares: interleaved timing, flags and JSON output (the machine
description is ``kvtier.machine``'s, which ``kvtier run`` prints too)."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtier.kv import KVLayout
from kvtier.machine import machine_info, print_machine

EMBEDDED_LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, chunk_tokens=256)
"""The embedded SmolLM2-135M's KV layout (fp32, 256-token chunks: 11.25 MiB each)."""

__all__ = [
    "EMBEDDED_LAYOUT",
    "base_parser",
    "interleave",
    "machine_info",
    "median",
    "print_machine",
    "timed",
    "write_json",
]


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
