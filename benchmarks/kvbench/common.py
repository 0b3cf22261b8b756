"""What every benchmark shares: flags, the machine header, interleaved timing, ratios, the
machine's copy and read bandwidth, and the JSON and summary line a run ends with.

Contract. ``base_parser`` gives every benchmark ``--quick``, ``--json`` and ``--seed``;
``BenchParser.sized`` adds a flag whose default depends on ``--quick``, and ``BenchParser.parse``
fills those defaults and raises ``ValueError`` (``--FLAG: must be >= N, got V``) for a value
below a flag's ``minimum``, before anything runs. ``header`` prints the machine description
(``kvtier.machine``'s, which ``kvtier run`` prints too) and returns it; ``finish`` adds it
to the result as ``machine``, writes the JSON (when ``--json`` was given) and prints the
summary line last. ``interleave`` runs cases A B C A B C …; ``ratio`` and ``fmt`` are pure.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch

from kvtier.kv import KVLayout
from kvtier.machine import machine_info, print_machine

EMBEDDED_LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, chunk_tokens=256)
"""The embedded SmolLM2-135M's KV layout (fp32, 256-token chunks: 11.25 MiB each)."""

T = TypeVar("T")

__all__ = [
    "EMBEDDED_LAYOUT",
    "BenchParser",
    "base_parser",
    "finish",
    "fmt",
    "header",
    "interleave",
    "median",
    "memcpy_gbps",
    "present_median",
    "ratio",
    "read_gbps",
    "timed",
]


# ---- flags -----------------------------------------------------------------------------------


def _shown(value: Any) -> str:
    """A default as a flag's help shows it: ``2 1`` for a list, ``3`` for 3.0."""
    if isinstance(value, list | tuple):
        return " ".join(_shown(v) for v in value)
    return f"{value:g}" if isinstance(value, float) else str(value)


class BenchParser(argparse.ArgumentParser):
    """The flags of ``kvtier bench NAME`` (see the module docstring)."""

    def __init__(self, name: str, doc: str | None) -> None:
        super().__init__(prog=f"kvtier bench {name}", description=(doc or name).splitlines()[0])
        self._sized: dict[str, tuple[Any, Any]] = {}
        self._minimum: dict[str, float] = {}
        self.add_argument("--quick", action="store_true", help="CI smoke mode (under a minute)")
        self.add_argument("--json", type=Path, default=None, help="write every figure here")
        self.add_argument("--seed", type=int, default=0)

    def add_argument(
        self, *names: str, minimum: float | None = None, **kwargs: Any
    ) -> argparse.Action:
        """``argparse``'s, and ``minimum``: the least value ``parse`` accepts (each, for a
        list)."""
        action = super().add_argument(*names, **kwargs)
        if minimum is not None:
            self._minimum[action.dest] = minimum
        return action

    def sized(self, flag: str, full: Any, quick: Any, help: str, **kwargs: Any) -> None:
        """``flag``, ``full`` by default and ``quick`` under ``--quick``; its help ends
        ``(FULL; quick QUICK)``."""
        action = self.add_argument(
            flag, default=None, help=f"{help} ({_shown(full)}; quick {_shown(quick)})", **kwargs
        )
        self._sized[action.dest] = (full, quick)

    def parse(self, argv: list[str] | None) -> argparse.Namespace:
        """The flags, sized defaults filled in and minimums checked."""
        args = self.parse_args(argv)
        for dest, (full, quick) in self._sized.items():
            if getattr(args, dest) is None:
                setattr(args, dest, quick if args.quick else full)
        for dest, least in self._minimum.items():
            value = getattr(args, dest)
            values = value if isinstance(value, list | tuple) else [value]
            if any(v is not None and v < least for v in values):
                flag = dest.replace("_", "-")
                raise ValueError(f"--{flag}: must be >= {_shown(least)}, got {_shown(value)}")
        return args


def base_parser(name: str, doc: str | None) -> BenchParser:
    """The flags every benchmark has; ``doc`` (the module's docstring) gives the description."""
    return BenchParser(name, doc)


# ---- the run ---------------------------------------------------------------------------------


def header(links: dict[str, str] | None = None) -> dict[str, Any]:
    """The machine (and ``links``, described) the run happens on, printed; for ``finish``."""
    info = machine_info(links)
    print_machine(info)
    return info


def finish(
    path: Path | None, result: dict[str, Any], machine: dict[str, Any], summary: str
) -> None:
    """The end of every run: ``result`` (its ``summary`` key, and ``machine`` added) written
    to ``path`` where given, then the one-line ``summary`` printed."""
    result["machine"] = machine
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2, sort_keys=True, default=str) + "\n")
        print(f"wrote {path}")
    print(summary)


# ---- timing and figures ----------------------------------------------------------------------


def timed(fn: Callable[[], object]) -> float:
    """Seconds one call of ``fn`` takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleave(
    cases: Mapping[str, Callable[[int], T]],
    repeats: int,
    then: Callable[[int, str, T], None] | None = None,
) -> dict[str, list[T]]:
    """Run each case ``repeats`` times, alternating A B C A B C …; each is called with the
    round (from 0) and returns a figure; ``then(round, name, figure)`` after each (for
    progress lines)."""
    results: dict[str, list[T]] = {name: [] for name in cases}
    for round_ in range(repeats):
        for name, case in cases.items():
            results[name].append(case(round_))
            if then is not None:
                then(round_, name, results[name][-1])
    return results


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def present_median(values: Iterable[float | None]) -> float | None:
    """The median of the values that are there (None: none is)."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator``; None when either is missing, the denominator is 0, or
    the ratio is not finite (a case the run did not have is NaN)."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    value = numerator / denominator
    return value if math.isfinite(value) else None


def fmt(value: float | None, spec: str = ".2f", missing: str = "n/a") -> str:
    """``value`` formatted, or ``missing`` when the run had no such figure."""
    return missing if value is None else format(value, spec)


# ---- the machine's bandwidth -----------------------------------------------------------------


def memcpy_gbps(nbytes: int) -> float:
    """One ``copy_`` of ``nbytes`` between pre-touched buffers, GB/s."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.zeros_like(src)
    dst.copy_(src)  # warm
    return nbytes / timed(lambda: dst.copy_(src)) / 1e9


def read_gbps(nbytes: int, threads: int) -> float:
    """Streaming read bandwidth: best of 5 sums of a pre-touched fp32 tensor."""
    torch.set_num_threads(threads)
    data = torch.ones(nbytes // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9
