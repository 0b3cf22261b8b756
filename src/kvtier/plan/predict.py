"""The planner's predictions: a decode step, a reused prompt's TTFT, sessions per SLO.

A decode step of ``B`` sequences of ``C`` tokens each, a share ``r`` of their KV resident
on the device, is the runtime's own cost model (``kvtier.runtime.cost.predict_s``) with
the machine's rates:

- compute: the measured batch fit ``e + f·B`` (this machine), or on paper
  ``max(weights ÷ memory rate, B × FLOPs per token ÷ TFLOP/s)``, plus the resident KV
  ``B·C·r`` bytes ÷ the device memory rate;
- the non-resident ``B·C·(1 - r)`` bytes: streamed over the link, attended on the host
  (what host DRAM cannot hold lies in CXL memory, attended at the smaller rate), or
  split by ``choose_hosted`` (``auto``).

Each resource's busy seconds in the step are kept (``Step.busy_s``): the binding one is
the stave the step waits on. Pure functions; thread-safe.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvtier.config import PlacementRates
from kvtier.plan.hardware import GB, Hardware
from kvtier.plan.shapes import ModelShape
from kvtier.runtime.cost import choose_hosted, predict_s

STRATEGIES = ("resident", "stream", "host", "auto")
CHUNK_TOKENS = 256


@dataclass(frozen=True)
class Step:
    """One predicted decode step.

    Attributes:
        seconds: the step.
        busy_s: each resource's seconds in it (compute, device memory, link, host).
        binding: the resource the step waits on.
        hosted_fraction: the share of non-resident bytes attended on the host.
    """

    seconds: float
    busy_s: dict[str, float]
    binding: str
    hosted_fraction: float


def compute_s(model: ModelShape, hw: Hardware, batch: int) -> float:
    """A decode step's work besides attention."""
    if hw.decode_ms is not None:
        return (hw.decode_ms + (hw.decode_ms_per_row or 0.0) * batch) / 1e3
    weights_s = model.weight_bytes / (hw.device_memory_gbps * GB)
    flops_s = batch * model.flops_per_token / (hw.device_tflops * 1e12)
    return max(weights_s, flops_s)


def rates(
    model: ModelShape, hw: Hardware, batch: int, resident_nbytes: float, outside_nbytes: float
) -> PlacementRates:
    """The cost model's rates for a step with ``resident_nbytes`` of KV on the device and
    ``outside_nbytes`` off it: host DRAM holds what it can, a CXL tier the rest (attended
    at the smaller of its rate and the host's), so the host rate is their mix."""
    host = hw.host_attention_gbps
    if hw.cxl_memory_gb and outside_nbytes > 0:
        in_dram = min(outside_nbytes, hw.host_memory_gb * GB)
        in_cxl = outside_nbytes - in_dram
        seconds = in_dram / host + in_cxl / min(host, hw.cxl_gbps)
        host = outside_nbytes / seconds
    return PlacementRates(
        link_gbps=hw.link_gbps,
        host_attention_gbps=host,
        device_attention_gbps=hw.device_memory_gbps,
        compute_s=compute_s(model, hw, batch) + resident_nbytes / (hw.device_memory_gbps * GB),
        concurrent=hw.concurrent,
    )


def decode_step(
    model: ModelShape,
    hw: Hardware,
    batch: int,
    context: int,
    resident_fraction: float,
    strategy: str,
    link_gbps: float | None = None,
) -> Step:
    """The step of ``strategy`` (``STRATEGIES``; ``resident`` ignores the fraction), over
    a link throttled to ``link_gbps`` (None: the machine's)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy: unknown {strategy!r}; accepted: {list(STRATEGIES)}")
    total = float(batch * context * model.kv_bytes_per_token)
    fraction = 1.0 if strategy == "resident" else min(1.0, max(0.0, resident_fraction))
    resident = total * fraction
    outside = total - resident
    r = rates(model, hw, batch, resident, outside)
    chunk = CHUNK_TOKENS * model.kv_bytes_per_token
    chunks = math.ceil(outside / chunk) if outside else 0
    if strategy == "host":
        hosted = outside
    elif strategy == "auto" and chunks:
        hosted = min(outside, choose_hosted(chunks, chunk, r, link_gbps) * chunk)
    else:
        hosted = 0.0
    streamed = outside - hosted
    link = r.link_gbps if link_gbps is None else min(r.link_gbps, link_gbps)
    busy = {
        "compute": compute_s(model, hw, batch),
        "device memory": resident / (hw.device_memory_gbps * GB)
        + streamed / (r.device_attention_gbps * GB),
        "link": streamed / (link * GB),
        "host attention": hosted / (r.host_attention_gbps * GB),
    }
    if not hw.concurrent:  # the copy is traffic on the one memory
        busy["device memory"] += streamed / (r.link_gbps * GB)
    seconds = predict_s(r, int(streamed), int(hosted), link_gbps)
    return Step(seconds, busy, _binding(busy, hw.concurrent), hosted / outside if outside else 0.0)


def _binding(busy: dict[str, float], concurrent: bool) -> str:
    """The stave the step waits on: the longest lane (``concurrent``: every resource its
    own lane; otherwise the link beside the device's serial compute, memory and host
    work, whose largest part names it)."""
    if concurrent:
        return max(busy, key=lambda k: busy[k])
    serial = {k: v for k, v in busy.items() if k != "link"}
    if busy["link"] > sum(serial.values()):
        return "link"
    return max(serial, key=lambda k: serial[k])


def prefill_s(model: ModelShape, hw: Hardware, tokens: int) -> float:
    """Seconds to compute a ``tokens``-token prompt's KV from scratch."""
    if hw.prefill_s_per_token is not None:
        return tokens * hw.prefill_s_per_token
    flops = (
        tokens * model.flops_per_token + tokens * tokens / 2 * model.attention_flops_per_token_pair
    )
    return flops / (hw.device_tflops * 1e12)


def reuse_ttft(model: ModelShape, hw: Hardware, tokens: int, tier_gbps: float) -> dict[str, float]:
    """TTFT of a prompt whose KV lies in a tier read at ``tier_gbps``: load it all,
    recompute it all, or recompute the front while the back loads (they meet where the
    two take the same time)."""
    load = tokens * model.kv_bytes_per_token / (tier_gbps * GB)
    recompute = prefill_s(model, hw, tokens)
    lo, hi = 0, tokens  # the front's tokens: recompute(front) rises, load(back) falls
    while hi - lo > 1:
        mid = (lo + hi) // 2
        back = (tokens - mid) * model.kv_bytes_per_token / (tier_gbps * GB)
        if prefill_s(model, hw, mid) < back:
            lo = mid
        else:
            hi = mid
    back_s = (tokens - hi) * model.kv_bytes_per_token / (tier_gbps * GB)
    overlap = max(prefill_s(model, hw, hi), back_s)
    return {"load_s": load, "recompute_s": recompute, "overlap_s": overlap, "front_tokens": hi}


@dataclass(frozen=True)
class Capacity:
    """The most sessions a step time bound allows, and how their KV is placed."""

    sessions: int
    step_s: float
    resident_fraction: float
    strategy: str
    binding: str
    device_kv_gb: float
    host_kv_gb: float


def resident_fraction(model: ModelShape, hw: Hardware, batch: int, context: int) -> float:
    """The share of ``batch`` sequences' KV the device memory left by the weights holds
    (10 % of it kept for activations)."""
    free = hw.device_memory_gb * GB * 0.9 - model.weight_bytes
    total = batch * context * model.kv_bytes_per_token
    return max(0.0, min(1.0, free / total)) if total else 1.0


def max_sessions(
    model: ModelShape, hw: Hardware, context: int, tpot_s: float, limit: int = 4096
) -> Capacity | None:
    """The largest batch (up to ``limit``) whose best strategy's step is within ``tpot_s``
    and whose KV fits in device plus host (plus CXL) memory; None when not even one fits.
    The step grows with the batch, so the batch is found by bisection."""

    def at(batch: int) -> Capacity | None:
        fraction = resident_fraction(model, hw, batch, context)
        total_gb = batch * context * model.kv_bytes_per_token / GB
        if total_gb * (1 - fraction) > hw.host_memory_gb + hw.cxl_memory_gb:
            return None
        strategies = ("resident",) if fraction >= 1 else ("stream", "host", "auto")
        step, name = min(
            ((decode_step(model, hw, batch, context, fraction, s), s) for s in strategies),
            key=lambda pair: pair[0].seconds,
        )
        if step.seconds > tpot_s:
            return None
        kv = (total_gb * fraction, total_gb * (1 - fraction))
        return Capacity(batch, step.seconds, fraction, name, step.binding, *kv)

    best = at(1)
    if best is None:
        return None
    lo, hi = 1, limit + 1  # at(lo) fits; at(hi) does not (or is past the limit)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        found = at(mid)
        if found is None:
            hi = mid
        else:
            lo, best = mid, found
    return best
