"""The traffic the planner sizes for: ``Workload`` and ``workload``.

Either ``key=value`` pairs (``context=8192,sessions=64,turn_gap_s=60,rate=2,output=256``)
or a JSONL trace with ``timestamp`` (ms), ``input_length`` and ``output_length`` per request
(the Mooncake format of ``benchmarks/traces``; ``.jsonl``, ``.jsonl.xz`` or ``.jsonl.gz``).
Pure functions (``workload`` reads the trace file); thread-safe.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from kvtier.tracefile import is_trace_path, open_trace


@dataclass(frozen=True)
class Workload:
    """What arrives.

    Attributes:
        context: prompt tokens of the typical request (a trace's median).
        context_p90: its 90th percentile.
        output: tokens generated per request (a trace's mean).
        sessions: conversations alive at once (their KV is worth keeping for reuse).
        turn_gap_s: seconds between a session's turns.
        rate_per_s: requests per second.
        source: where it came from.
    """

    context: int
    context_p90: int
    output: int
    sessions: int
    turn_gap_s: float
    rate_per_s: float
    source: str


def workload(spec: str) -> Workload:
    """Parse ``spec`` (see the module docstring).

    Raises:
        ValueError: an unknown key, a bad number, or an empty trace.
    """
    path = Path(spec)
    if is_trace_path(path) or path.is_file():
        return _from_trace(path)
    fields: dict[str, float] = {}
    known = ("context", "sessions", "turn_gap_s", "rate", "output")
    for part in filter(None, spec.split(",")):
        key, _, value = part.partition("=")
        if key not in known:
            raise ValueError(f"--workload: unknown key {key!r}; accepted: {', '.join(known)}")
        try:
            fields[key] = float(value)
        except ValueError:
            raise ValueError(f"--workload: {key}={value!r} is not a number") from None
    context = int(fields.get("context", 4096))
    rate = fields.get("rate", 1.0)
    gap = fields.get("turn_gap_s", 60.0)
    return Workload(
        context=context,
        context_p90=context,
        output=int(fields.get("output", 256)),
        sessions=int(fields.get("sessions", max(1, round(rate * gap)))),
        turn_gap_s=gap,
        rate_per_s=rate,
        source=spec,
    )


def _from_trace(path: Path) -> Workload:
    with open_trace(path, "--workload") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if not rows:
        raise ValueError(f"--workload: {path} holds no requests")
    inputs = sorted(int(r["input_length"]) for r in rows)
    span_s = max(1e-3, (rows[-1]["timestamp"] - rows[0]["timestamp"]) / 1e3)
    rate = len(rows) / span_s
    gap = 60.0  # a trace has no session ids: one turn a minute per conversation
    return Workload(
        context=int(statistics.median(inputs)),
        context_p90=inputs[int(0.9 * (len(inputs) - 1))],
        output=round(statistics.mean(int(r["output_length"]) for r in rows)),
        sessions=max(1, round(rate * gap)),
        turn_gap_s=gap,
        rate_per_s=rate,
        source=f"{path.name} ({len(rows)} requests over {span_s / 60:.0f} min)",
    )
