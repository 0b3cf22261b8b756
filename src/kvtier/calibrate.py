"""``kvtier calibrate``: the rates kvtier's cost model needs, measured here for one model.

FlexGen's cost model warns that rates taken from single-op microbenchmarks or the internet
"will not be accurate"; so every rate here is measured through the code path that will use
it, on the machine that runs it:

- ``link``: the device⇄host link (``kvtier.transfer.Link`` copying a chunk-sized buffer
  per step) each way alone and both ways at once. Without an accelerator the "device" is
  host memory, so the link is a memcpy (``kind`` says which).
- ``host_attention_gbps``: one decode query over host-resident KV (``attend_flat``, the
  kernel a host-side segment runs), bytes of K and V read per second, per thread count.
- ``disk``: sequential write (``fdatasync``) and read of a scratch file through the disk
  tier's I/O helpers, with ``O_DIRECT`` where the filesystem takes it (``direct``).
- ``compute``: the model's prefill seconds for prompts of several lengths and its decode
  milliseconds per token at several contexts, through the engine (``kvtier.engine``,
  batch 1, all KV resident), each with a least-squares fit: prefill ``s = a·n + b·n²``
  (matmuls grow with the tokens, attention with their square), decode ``ms = c + d·n``.
- ``shared_tier``: null until a shared tier is configured (the Redis tier is not built).

``calibrate`` returns the profile (a JSON-ready dict) and ``save_profile`` writes it to
``<kvtier cache>/profiles/<machine>-<model>.json``; ``load_profile`` finds the one that
matches this machine (``machine_identity``: CPU model, cores, memory, accelerator, torch)
and a model identity (``kvtier.models.model_identity``). Nothing here mutates shared
state; measurements run on the calling thread (the link's worker thread for the link),
with torch's thread count restored afterwards.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from kvtier.attention import attend_flat
from kvtier.kv import KVLayout
from kvtier.machine import machine_info, print_machine
from kvtier.models import cache_root, load_model
from kvtier.tiers import disk_io
from kvtier.transfer import CopyStep, Link

PROFILE_VERSION = 1
MiB = 1 << 20
CHUNK_TOKENS = 256
"""Chunk size of the engine ``kvtier calibrate`` measures compute on (the serving default)."""


@dataclass(frozen=True)
class Settings:
    """What ``calibrate`` measures and how much.

    Attributes:
        link_bytes: bytes per link measurement (in chunk-sized steps).
        attention_tokens: host KV tokens one decode query reads.
        thread_counts: torch thread counts of the host-attention measurement.
        disk_bytes: size of the disk scratch file.
        disk_dir: where the scratch file goes (None: the kvtier cache folder).
        prefill_tokens: prompt lengths of the compute measurement.
        decode_tokens: tokens decoded after each prompt.
        repeats: timed repetitions of each rate (the best is kept).
    """

    link_bytes: int = 256 * MiB
    attention_tokens: int = 4096
    thread_counts: tuple[int, ...] = ()
    disk_bytes: int = 256 * MiB
    disk_dir: Path | None = None
    prefill_tokens: tuple[int, ...] = (256, 1024, 2048)
    decode_tokens: int = 16
    repeats: int = 3

    @classmethod
    def quick(cls, **overrides: Any) -> Settings:
        """A run of seconds, for tests and a first look."""
        base = cls(
            link_bytes=32 * MiB,
            attention_tokens=1024,
            disk_bytes=32 * MiB,
            prefill_tokens=(64, 256),
            decode_tokens=8,
            repeats=2,
        )
        return cls(**{**base.__dict__, **overrides})


# ---- identities and files ----------------------------------------------------------------


def machine_identity() -> str:
    """A digest of what the rates depend on: CPU model and cores, memory size, the
    accelerator, torch's version."""
    info = machine_info()
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    key = (info["cpu"], info["cores"], info["device"], info["torch"], memory // (1 << 30))
    return hashlib.blake2b(repr(key).encode(), digest_size=6).hexdigest()


def profile_path(model_id: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where this machine's profile of a model lives."""
    return cache_root(cache_dir) / "profiles" / f"{machine_identity()}-{model_id}.json"


def save_profile(profile: dict[str, Any], path: str | os.PathLike[str] | None = None) -> Path:
    """Write ``profile`` (atomically: a temporary file renamed) to ``path`` or its default
    place; returns the path."""
    target = Path(path) if path is not None else profile_path(profile["model"]["id"])
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = target.with_suffix(".tmp")
    scratch.write_text(json.dumps(profile, indent=1) + "\n")
    scratch.replace(target)
    return target


def load_profile(
    model_id: str, cache_dir: str | os.PathLike[str] | None = None
) -> dict[str, Any] | None:
    """This machine's profile of ``model_id``; None when there is none (or it was made by
    another profile version or on another machine)."""
    path = profile_path(model_id, cache_dir)
    try:
        profile = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    ok = profile.get("version") == PROFILE_VERSION
    if not ok or profile.get("machine", {}).get("identity") != machine_identity():
        return None
    return dict(profile)


# ---- the measurements ----------------------------------------------------------------------


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


def measure_host_attention(
    layout: KVLayout, groups: int, tokens: int, thread_counts: Sequence[int], repeats: int
) -> dict[str, float]:
    """GB/s of K and V read by one decode query (the ``groups`` query heads of every KV
    head) over ``tokens`` host tokens of one layer, per torch thread count."""
    _, _, heads, _, dim = layout.chunk_shape
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(1, heads, tokens, dim, generator=gen)
    v = torch.randn(1, heads, tokens, dim, generator=gen)
    q = torch.randn(1, heads, groups, dim, generator=gen)
    nbytes = 2 * k.numel() * 4
    before = torch.get_num_threads()
    out: dict[str, float] = {}
    try:
        for threads in thread_counts:
            torch.set_num_threads(threads)
            seconds = _best_s(lambda: attend_flat(q, k, v, None, dim**-0.5), repeats)
            out[str(threads)] = nbytes / seconds / 1e9
    finally:
        torch.set_num_threads(before)
    return out


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
    from kvtier.engine import SamplingParams

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
            "fit": _fit(prompt_tokens, prefill_s, ("s_per_token", "s_per_token_squared")),
        },
        "decode": {
            "context_tokens": contexts,
            "ms_per_token": decode_ms,
            "fit": _fit(contexts, decode_ms, ("ms", "ms_per_context_token"), intercept=True),
        },
    }


def _fit(
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


# ---- the whole run -------------------------------------------------------------------------


def calibrate(
    engine: Any, settings: Settings | None = None, progress: bool = True
) -> dict[str, Any]:
    """Measure every rate for ``engine``'s model on this machine; the profile (JSON-ready).

    Args:
        engine: a ``kvtier.engine.Engine`` whose device budget holds the longest prompt
            plus its decode (the compute measurement runs there, one request at a time).
        settings: how much to measure (default ``Settings()``).
        progress: show a progress bar (stderr).
    """
    settings = settings or Settings()
    started = time.perf_counter()
    layout: KVLayout = engine.manager.layout
    device = engine.device
    threads = settings.thread_counts or tuple(range(1, (os.cpu_count() or 1) + 1))
    folder = settings.disk_dir or cache_root() / "calibrate-scratch"
    vocab = int(engine.vocab_size)
    text = engine.model.config.get_text_config()
    groups = int(text.num_attention_heads) // layout.num_kv_heads
    stages: list[tuple[str, Callable[[], Any]]] = [
        (
            "link",
            lambda: measure_link(
                device, layout.chunk_nbytes, settings.link_bytes, settings.repeats
            ),
        ),
        (
            "host_attention_gbps",
            lambda: measure_host_attention(
                layout, groups, settings.attention_tokens, threads, settings.repeats
            ),
        ),
        ("disk", lambda: measure_disk(Path(folder), settings.disk_bytes, settings.repeats)),
        (
            "compute",
            lambda: measure_compute(engine, settings.prefill_tokens, settings.decode_tokens, vocab),
        ),
    ]
    results: dict[str, Any] = {}
    bar = tqdm(stages, desc="calibrate", unit="stage", disable=not progress)
    for name, run in bar:
        bar.set_postfix_str(name)
        results[name] = run()
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    return {
        "version": PROFILE_VERSION,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "seconds": time.perf_counter() - started,
        "machine": {
            **machine_info(),
            "identity": machine_identity(),
            "platform": platform.platform(),
        },
        "model": {
            "id": engine.model_id,
            "type": str(engine.model.config.model_type),
            "weight_bytes": int(weights),
            "kv_bytes_per_token": layout.token_nbytes,
            "chunk_tokens": layout.chunk_tokens,
            "num_layers": layout.num_layers,
            "runner": engine.runner.name,
        },
        "settings": {
            k: (str(v) if isinstance(v, Path) else v) for k, v in settings.__dict__.items()
        },
        **results,
        "shared_tier": None,
    }


def report(profile: dict[str, Any]) -> str:
    """A few lines of what was measured, for the terminal."""
    link, disk, compute = profile["link"], profile["disk"], profile["compute"]
    att = ", ".join(f"{t} thr {g:.1f}" for t, g in profile["host_attention_gbps"].items())
    pre, dec = compute["prefill"]["fit"], compute["decode"]["fit"]
    lines = [
        f"link ({link['kind']}): h2d {link['h2d_gbps']:.1f} GB/s, d2h {link['d2h_gbps']:.1f} "
        f"GB/s, each way with both busy {link['each_way_both_busy_gbps']:.1f} GB/s",
        f"host attention (K+V read): {att} GB/s",
        f"disk ({disk['folder']}, O_DIRECT {'yes' if disk['direct'] else 'no'}): write "
        f"{disk['write_gbps']:.2f} GB/s, read {disk['read_gbps']:.2f} GB/s",
        "prefill: "
        + ", ".join(
            f"{n} tok {s:.2f} s"
            for n, s in zip(
                compute["prefill"]["prompt_tokens"], compute["prefill"]["seconds"], strict=True
            )
        )
        + f"  (fit: {pre['s_per_token'] * 1e3:.3f} ms/token + "
        f"{pre['s_per_token_squared'] * 1e6:.4f} µs/token²)",
        "decode: "
        + ", ".join(
            f"ctx {c:.0f} {m:.1f} ms"
            for c, m in zip(
                compute["decode"]["context_tokens"], compute["decode"]["ms_per_token"], strict=True
            )
        )
        + f"  (fit: {dec['ms']:.1f} ms + {dec['ms_per_context_token'] * 1e3:.2f} µs/context token)",
        "shared tier: not configured",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``kvtier calibrate``: measure, print, write the profile."""
    parser = argparse.ArgumentParser(prog="kvtier calibrate", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="HF folder (default: the embedded model)")
    parser.add_argument("--quick", action="store_true", help="a run of seconds, smaller sizes")
    parser.add_argument("--out", default=None, help="profile path (default: the kvtier cache)")
    parser.add_argument("--disk-dir", default=None, help="folder for the disk scratch file")
    parser.add_argument("--threads", type=int, default=None, help="torch threads for compute")
    args = parser.parse_args(argv)
    from kvtier.config import ManagerConfig, TieredCacheConfig
    from kvtier.engine import Engine, EngineConfig

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    settings = Settings.quick() if args.quick else Settings()
    if args.disk_dir is not None:
        settings = Settings(**{**settings.__dict__, "disk_dir": Path(args.disk_dir)})
    print_machine(machine_info())
    loaded = load_model(args.model)
    layout = KVLayout.from_model_config(
        loaded.model.config, next(loaded.model.parameters()).dtype, CHUNK_TOKENS
    )
    longest = max(settings.prefill_tokens) + settings.decode_tokens + 2
    budget = (longest // layout.chunk_tokens + 2) * layout.chunk_nbytes
    config = EngineConfig(
        max_batch_size=1,
        cache=TieredCacheConfig(device_budget_bytes=budget),
        manager=ManagerConfig(chunk_tokens=CHUNK_TOKENS),
    )
    with Engine(loaded.model, loaded.tokenizer, config, model_id=loaded.model_id) as engine:
        profile = calibrate(engine, settings)
    path = save_profile(profile, args.out)
    print(report(profile))
    print(f"wrote {path} ({profile['seconds']:.0f} s)")
    return 0
