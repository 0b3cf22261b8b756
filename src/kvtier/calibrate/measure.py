"""The measurements of ``kvtier calibrate``, each through the code path that uses the rate
(see ``kvtier.calibrate``). Each function allocates its own buffers, runs on the calling
thread (a ``Link`` measurement also on the links' worker threads) and restores torch's
thread count; none mutates shared state except the scratch file it creates and removes.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvtier import native
from kvtier.attention import attend_flat
from kvtier.config import RemoteConfig
from kvtier.engine import SamplingParams
from kvtier.kv import KVLayout
from kvtier.kv.chunk import Chunk, ChunkRef
from kvtier.tiers import disk_io
from kvtier.tiers.remote_client import safe_url
from kvtier.transfer import CopyStep, Link

MiB = 1 << 20


def _best_s(run: Callable[[], object], repeats: int) -> float:
    run()  # first touch and warm-up, untimed
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def measure_link(
    device: torch.device, step_bytes: int, total_bytes: int, repeats: int
) -> dict[str, Any]:
    """GB/s of the device⇄host link: host→device, device→host, and each way with both
    busy (two links, as the engine has), through ``Link`` in ``step_bytes`` steps."""
    steps = max(1, total_bytes // step_bytes)
    elems = step_bytes // 4
    pin = device.type == "cuda"
    host = [torch.ones(elems, pin_memory=pin) for _ in range(steps)]
    dev = [torch.ones(elems, device=device) for _ in range(steps)]
    nbytes = steps * elems * 4

    def copy(dst: torch.Tensor, src: torch.Tensor) -> Callable[[], None]:
        def run() -> None:
            dst.copy_(src, non_blocking=True)

        return run

    def copies(dst: list[torch.Tensor], src: list[torch.Tensor]) -> list[CopyStep]:
        return [CopyStep(elems * 4, range(0), copy(d, s)) for d, s in zip(dst, src, strict=True)]

    with (
        Link("host->device", nbytes, device=device) as up,
        Link("device->host", nbytes, device=device) as down,
    ):

        def one(link: Link, dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
            link.submit(copies(dst, src), 0).wait()

        def both() -> None:
            a = up.submit(copies(dev, host), 0)
            b = down.submit(copies(host, dev), 0)
            a.wait()
            b.wait()

        h2d = nbytes / _best_s(lambda: one(up, dev, host), repeats) / 1e9
        d2h = nbytes / _best_s(lambda: one(down, host, dev), repeats) / 1e9
        each = nbytes / _best_s(both, repeats) / 1e9
    return {
        "kind": "pcie/c2c (pinned host memory)" if pin else "memcpy (no accelerator)",
        "h2d_gbps": h2d,
        "d2h_gbps": d2h,
        "each_way_both_busy_gbps": each,
        "step_bytes": elems * 4,
    }


def measure_attention(
    layout: KVLayout,
    groups: int,
    tokens: int,
    thread_counts: Sequence[int],
    repeats: int,
    device: torch.device,
) -> dict[str, Any]:
    """GB/s of K and V read by one decode query (the ``groups`` query heads of every KV
    head) over ``tokens`` tokens in every layer (so the bytes come from memory, not the
    CPU's caches).

    ``host``: over the slot-major host pool, per torch thread count, with torch's kernel
    (``attend_flat`` over the slots gathered, what ``kvtier.runtime.dispatch`` runs for
    many queries) and, where it is built, kvtier's ``attend_slots`` (read in place, what a
    decode's ``Decision.HOST`` chunks take). ``device``: over ``device``'s pool at the
    current thread count: kvtier's ``decode_attend`` over a one-seat slab where the device
    is this CPU and the kernel is built, else torch's kernel on ``device``."""
    num_layers, _, heads, size, dim = layout.chunk_shape
    slots = -(-tokens // size)
    nbytes = 2 * num_layers * heads * slots * size * dim * 4
    scale = dim**-0.5
    gen = torch.Generator().manual_seed(0)
    pool = torch.randn(slots, num_layers, 2, heads, size, dim, generator=gen)
    query = torch.randn(heads * groups, 1, dim, generator=gen)
    q4 = query.reshape(1, heads, groups, dim)
    ops = native.ops()

    def gathered_pass() -> None:
        for layer in range(num_layers):
            keys = pool[:, layer, 0].transpose(0, 1).reshape(1, heads, slots * size, dim)
            values = pool[:, layer, 1].transpose(0, 1).reshape(1, heads, slots * size, dim)
            attend_flat(q4, keys, values, None, scale)

    host_cases: dict[str, Callable[[], None]] = {"torch": gathered_pass}
    if ops is not None:
        index = torch.arange(slots, dtype=torch.long)
        out = torch.empty(1, heads * groups, dim)
        lse = torch.empty(1, heads * groups)

        def slots_pass() -> None:
            for layer in range(num_layers):
                ops.attend_slots(pool, layer, index, query, out, lse, scale)

        host_cases["kvtier"] = slots_pass
    before = torch.get_num_threads()
    host: dict[str, dict[str, float]] = {name: {} for name in host_cases}
    try:
        for threads in thread_counts:
            torch.set_num_threads(threads)
            for name, run in host_cases.items():
                host[name][str(threads)] = nbytes / _best_s(run, repeats) / 1e9
    finally:
        torch.set_num_threads(before)
    kernel, run = _device_attention(layout, groups, slots, device, ops, gen)
    return {
        "host": host,
        "device": {"kernel": kernel, "gbps": nbytes / _best_s(run, repeats) / 1e9},
    }


def _device_attention(
    layout: KVLayout,
    groups: int,
    slots: int,
    device: torch.device,
    ops: Any,
    gen: torch.Generator,
) -> tuple[str, Callable[[], None]]:
    """The kernel name and one decode pass over ``slots`` chunks of every layer in the
    device pool (see ``measure_attention``)."""
    num_layers, _, heads, size, dim = layout.chunk_shape
    scale = dim**-0.5
    if device.type == "cpu" and ops is not None:
        slab = torch.randn(1, num_layers, 2, heads, 1 + slots, size, dim, generator=gen)
        one = torch.zeros(1, dtype=torch.long)
        lo, hi = torch.tensor([size]), torch.tensor([(1 + slots) * size])
        query = torch.randn(heads * groups, 1, dim, generator=gen)
        new = torch.randn(heads, 1, dim, generator=gen)
        out = torch.empty(1, heads * groups, dim)

        def kernel_pass() -> None:
            for layer in range(num_layers):
                ops.decode_attend(
                    slab, layer, one, one, lo, hi, one, query, new, new, out, None, scale
                )

        return "kvtier", kernel_pass
    kv = torch.randn(num_layers, 2, 1, heads, slots * size, dim, generator=gen).to(device)
    q4 = torch.randn(1, heads, groups, dim, generator=gen).to(device)

    def torch_pass() -> None:
        for layer in range(num_layers):
            attend_flat(q4, kv[layer, 0], kv[layer, 1], None, scale)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return "torch", torch_pass


def measure_disk(folder: Path, nbytes: int, repeats: int) -> dict[str, Any]:
    """Sequential write (then ``fdatasync``) and read GB/s of a scratch file in ``folder``
    (removed afterwards), 4 MiB at a time, with ``O_DIRECT`` where the filesystem has it."""
    folder.mkdir(parents=True, exist_ok=True)
    block = 4 * MiB
    blocks = max(1, nbytes // block)
    staging = disk_io.Staging(block)
    staging.array[:] = 7
    fd_probe, name = tempfile.mkstemp(prefix="kvtier-calibrate-", dir=folder)
    os.close(fd_probe)
    try:
        direct = disk_io.probe_writes(str(folder), want_direct=True)
        flags = os.O_RDWR | (disk_io.O_DIRECT if direct else 0)

        def write() -> None:
            fd = os.open(name, flags)
            try:
                for i in range(blocks):
                    disk_io.pwrite_all(fd, staging.view, i * block)
                disk_io.datasync(fd)
            finally:
                os.close(fd)

        def read() -> None:
            fd = os.open(name, flags)
            try:
                for i in range(blocks):
                    disk_io.pread_upto(fd, staging.view, i * block)
            finally:
                os.close(fd)

        total = blocks * block
        write_gbps = total / _best_s(write, repeats) / 1e9
        read_gbps = total / _best_s(read, repeats) / 1e9
    finally:
        os.unlink(name)
    return {
        "folder": str(folder),
        "write_gbps": write_gbps,
        "read_gbps": read_gbps,
        "direct": direct,
        "note": None if direct else "no O_DIRECT here: reads may come from the page cache",
    }


def measure_compute(
    engine: Any, prompt_tokens: Sequence[int], decode_tokens: int, vocab: int
) -> dict[str, Any]:
    """Prefill seconds and decode ms per token at each prompt length, through ``engine``
    (one request at a time, fresh token ids so nothing is reused), with their fits."""
    params = SamplingParams(temperature=0, max_tokens=decode_tokens + 1, ignore_eos=True)
    gen = torch.Generator().manual_seed(1234)
    prefill_s: list[float] = []
    decode_ms: list[float] = []
    engine.submit([1, 2, 3, 4], SamplingParams(max_tokens=2, ignore_eos=True)).result()
    for n in prompt_tokens:
        ids = torch.randint(10, vocab, (n,), generator=gen).tolist()
        start = time.perf_counter()
        stamps = [time.perf_counter() for e in engine.submit(ids, params) if e.token_id is not None]
        first = stamps[0] - start
        prefill_s.append(first)
        tokens = max(1, len(stamps) - 1)
        decode_ms.append((stamps[-1] - stamps[0]) / tokens * 1e3)
    contexts = [n + decode_tokens / 2 for n in prompt_tokens]
    return {
        "prefill": {
            "prompt_tokens": list(prompt_tokens),
            "seconds": prefill_s,
            "fit": fit(prompt_tokens, prefill_s, ("s_per_token", "s_per_token_squared")),
        },
        "decode": {
            "context_tokens": contexts,
            "ms_per_token": decode_ms,
            "fit": fit(contexts, decode_ms, ("ms", "ms_per_context_token"), intercept=True),
        },
    }


def measure_batch_decode(
    engine: Any,
    batches: Sequence[int],
    decode_tokens: int,
    vocab: int,
    repeats: int = 1,
    prompt_tokens: int = 64,
) -> dict[str, Any]:
    """Decode step milliseconds with ``B`` sequences decoding together, for each ``B`` in
    ``batches`` (short prompts, so the step is the model's weights and per-row work, not
    attention), with the fit ``ms = e + f·B``: what a batch shares and what each row adds.
    The step is the median gap between consecutive tokens of the first request while
    all ``B`` decode (the engine's decode steps carry one token per sequence), the best of
    ``repeats`` runs."""
    params = SamplingParams(temperature=0, max_tokens=decode_tokens + 4, ignore_eos=True)
    gen = torch.Generator().manual_seed(4321)
    step_ms: list[float] = []
    for batch in batches:
        handles = [
            engine.submit(
                torch.randint(10, vocab, (prompt_tokens,), generator=gen).tolist(), params
            )
            for _ in range(batch)
        ]
        stamps = [time.perf_counter() for e in handles[0] if e.token_id is not None]
        for other in handles[1:]:
            other.result()
        gaps = np.diff(np.asarray(stamps[2:-2]))  # the middle: every sequence decoding
        step_ms.append(float(np.median(gaps)) * 1e3)
    return {
        "batch": list(batches),
        "step_ms": step_ms,
        "fit": fit(batches, step_ms, ("ms", "ms_per_row"), intercept=True),
    }


def fit(
    xs: Sequence[float], ys: Sequence[float], names: tuple[str, str], intercept: bool = False
) -> dict[str, float]:
    """Least squares, coefficients clipped at 0: ``y = a + b·x`` (intercept) or
    ``y = a·x + b·x²``."""
    x = np.asarray(xs, dtype=np.float64)
    y = np.asarray(ys, dtype=np.float64)
    basis = np.stack([np.ones_like(x), x] if intercept else [x, x * x], axis=1)
    coef, *_ = np.linalg.lstsq(basis, y, rcond=None)
    coef = np.maximum(coef, 0.0)
    if not coef.any():  # degenerate (one point): the first term alone
        coef[0] = float(y.mean() / (basis[:, 0].mean() or 1.0))
    return {names[0]: float(coef[0]), names[1]: float(coef[1])}


def measure_remote(url: str, layout: KVLayout, nbytes: int, repeats: int) -> dict[str, Any]:
    """Write and read GB/s of the shared tier at ``url`` through ``RemoteTier`` itself
    (chunk-sized values, checksummed, pipelined writes), under a scratch key prefix that
    is deleted afterwards.

    Raises:
        ValueError: the store cannot be reached.
    """
    from kvtier.tiers.remote import RemoteTier  # redis-py is imported only when used

    config = RemoteConfig(url=url, key_prefix=f"kvtier-calibrate-{os.getpid()}", ttl_s=600.0)
    tier = RemoteTier(layout, config)
    count = max(1, nbytes // layout.chunk_nbytes)
    chunks = [
        Chunk(
            ChunkRef(i.to_bytes(16, "little"), ()), torch.rand(layout.chunk_shape).to(layout.dtype)
        )
        for i in range(count)
    ]
    outs = [layout.empty_chunk() for _ in chunks]
    try:
        if not tier.available or tier.put(chunks[:1]).stored == []:
            raise ValueError(f"remote: {url} did not take a write")
        tier.remove([c.ref for c in chunks])

        def write() -> None:
            tier.remove([c.ref for c in chunks])
            tier.put(chunks)

        write_gbps = count * layout.chunk_nbytes / _best_s(write, repeats) / 1e9
        read_gbps = (
            count * layout.chunk_nbytes
            / _best_s(lambda: tier.get_into([c.ref for c in chunks], outs), repeats)
            / 1e9
        )  # fmt: skip
        return {"url": safe_url(url), "write_gbps": write_gbps, "read_gbps": read_gbps}
    finally:
        tier.clear()
        tier.close()
