"""One calibration run: ``Settings``, ``calibrate`` (every measurement, with a progress
bar), ``calibrate_model`` (through an engine of its own), ``ensure_profile`` (calibrate once
when this machine has no profile of a model), ``report`` (the terminal lines) and ``main``
(the ``kvtier calibrate`` command). Above the engine: it measures through one."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from kvtier.calibrate.measure import (
    MiB,
    measure_attention,
    measure_batch_decode,
    measure_compute,
    measure_disk,
    measure_link,
    measure_remote,
)
from kvtier.config import HostConfig, ManagerConfig, TieredCacheConfig
from kvtier.engine import Engine, EngineConfig
from kvtier.kv import KVLayout
from kvtier.machine import machine_info, print_machine
from kvtier.models import cache_root, load_model
from kvtier.profiles import PROFILE_VERSION, load_profile, machine_identity, save_profile
from kvtier.tiers.remote_client import safe_url

log = logging.getLogger(__name__)

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
        decode_batches: sequences decoding together in the batch measurement.
        repeats: timed repetitions of each rate (the best is kept).
        remote_url: the shared tier to measure (None: none configured).
        remote_bytes: bytes written and read there.
    """

    link_bytes: int = 256 * MiB
    attention_tokens: int = 4096
    thread_counts: tuple[int, ...] = ()
    disk_bytes: int = 256 * MiB
    disk_dir: Path | None = None
    prefill_tokens: tuple[int, ...] = (256, 1024, 2048)
    decode_tokens: int = 16
    decode_batches: tuple[int, ...] = (1, 2, 4)
    repeats: int = 3
    remote_url: str | None = None
    remote_bytes: int = 64 * MiB

    @classmethod
    def quick(cls, **overrides: Any) -> Settings:
        """A run of seconds, for tests and a first look."""
        base = cls(
            link_bytes=32 * MiB,
            attention_tokens=1024,
            disk_bytes=32 * MiB,
            prefill_tokens=(64, 256),
            decode_tokens=8,
            decode_batches=(1, 2),
            repeats=2,
        )
        return dataclasses.replace(base, **overrides)


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
            "attention",
            lambda: measure_attention(
                layout, groups, settings.attention_tokens, threads, settings.repeats, device
            ),
        ),
        ("disk", lambda: measure_disk(Path(folder), settings.disk_bytes, settings.repeats)),
        (
            "compute",
            lambda: measure_compute(engine, settings.prefill_tokens, settings.decode_tokens, vocab),
        ),
        (
            "decode_batch",
            lambda: measure_batch_decode(
                engine, settings.decode_batches, settings.decode_tokens, vocab, settings.repeats
            ),
        ),
    ]
    if settings.remote_url is not None:
        url = settings.remote_url
        stages.insert(
            3,
            (
                "remote",
                lambda: measure_remote(url, layout, settings.remote_bytes, settings.repeats),
            ),
        )
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
            "memory_gb": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9,
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
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in {**settings.__dict__, "remote_url": _url(settings.remote_url)}.items()
        },
        **results,
    }


def calibrate_model(
    model: Any, tokenizer: Any, model_id: str, settings: Settings, progress: bool = True
) -> dict[str, Any]:
    """``calibrate`` through an engine of its own over ``model`` (the largest decode batch,
    a device budget per sequence that holds the longest prompt, a host tier twice them
    all), closed afterwards."""
    layout = KVLayout.from_model_config(model.config, next(model.parameters()).dtype, CHUNK_TOKENS)
    longest = max(settings.prefill_tokens) + settings.decode_tokens + 2
    budget = (longest // layout.chunk_tokens + 2) * layout.chunk_nbytes
    batch = max(settings.decode_batches)
    config = EngineConfig(
        max_batch_size=batch,
        cache=TieredCacheConfig(device_budget_bytes=budget),
        manager=ManagerConfig(
            chunk_tokens=CHUNK_TOKENS, host=HostConfig(capacity_bytes=2 * batch * budget)
        ),
    )
    with Engine(model, tokenizer, config, model_id=model_id) as engine:
        return calibrate(engine, settings, progress)


def ensure_profile(model: Any, tokenizer: Any, model_id: str) -> Path | None:
    """Calibrate ``model`` with ``Settings.quick()`` and save the profile when this machine
    has none of ``model_id`` (what ``placement="auto"`` needs: ``kvtier serve`` calls this
    at start); the path written, or None when a profile was already there."""
    if load_profile(model_id) is not None:
        return None
    log.warning(
        "placement auto: no calibration profile of %s on this machine; calibrating now "
        "(once; `kvtier calibrate` measures more)",
        model_id,
    )
    path = save_profile(calibrate_model(model, tokenizer, model_id, Settings.quick()))
    log.info("calibration profile written to %s", path)
    return path


def report(profile: dict[str, Any]) -> str:
    """A few lines of what was measured, for the terminal."""
    link, disk, compute = profile["link"], profile["disk"], profile["compute"]
    batch = profile["decode_batch"]
    attention = profile["attention"]
    att = "; ".join(
        f"{kernel}: " + ", ".join(f"{t} thr {g:.1f}" for t, g in by_threads.items())
        for kernel, by_threads in attention["host"].items()
    )
    dev = attention["device"]
    prefill, decode = compute["prefill"], compute["decode"]
    pre, dec = prefill["fit"], decode["fit"]
    lines = [
        f"link ({link['kind']}): h2d {link['h2d_gbps']:.1f} GB/s, d2h {link['d2h_gbps']:.1f} "
        f"GB/s, each way with both busy {link['each_way_both_busy_gbps']:.1f} GB/s",
        f"host attention (K+V read): {att} GB/s; device ({dev['kernel']}): {dev['gbps']:.1f} GB/s",
        f"disk ({disk['folder']}, O_DIRECT {'yes' if disk['direct'] else 'no'}): write "
        f"{disk['write_gbps']:.2f} GB/s, read {disk['read_gbps']:.2f} GB/s",
        "prefill: "
        + _pairs(prefill["prompt_tokens"], prefill["seconds"], "{:.0f} tok {:.2f} s")
        + f"  (fit: {pre['s_per_token'] * 1e3:.3f} ms/token + "
        f"{pre['s_per_token_squared'] * 1e6:.4f} µs/token²)",
        "decode: "
        + _pairs(decode["context_tokens"], decode["ms_per_token"], "ctx {:.0f} {:.1f} ms")
        + f"  (fit: {dec['ms']:.1f} ms + {dec['ms_per_context_token'] * 1e3:.2f} µs/context token)",
        "decode batch: "
        + _pairs(batch["batch"], batch["step_ms"], "{:.0f} rows {:.1f} ms")
        + f"  (fit: {batch['fit']['ms']:.1f} ms + {batch['fit']['ms_per_row']:.2f} ms/row)",
        _remote_line(profile.get("remote")),
    ]
    return "\n".join(lines)


def _url(url: str | None) -> str | None:
    """A URL without its password (profiles are shared)."""
    return None if url is None else safe_url(url)


def _remote_line(remote: dict[str, Any] | None) -> str:
    if remote is None:
        return "shared tier: not configured (--remote URL measures one)"
    return (
        f"shared tier ({remote['url']}): write {remote['write_gbps']:.2f} GB/s, "
        f"read {remote['read_gbps']:.2f} GB/s"
    )


def _pairs(xs: list[float], ys: list[float], fmt: str) -> str:
    """``fmt`` of each (x, y), comma-separated."""
    return ", ".join(fmt.format(x, y) for x, y in zip(xs, ys, strict=True))


def main(argv: list[str] | None = None) -> int:
    """``kvtier calibrate``: measure, print, write the profile."""
    parser = argparse.ArgumentParser(
        prog="kvtier calibrate",
        description="measure the rates kvtier's cost model needs, on this machine",
    )
    parser.add_argument("--model", default=None, help="HF folder (default: the embedded model)")
    parser.add_argument("--quick", action="store_true", help="a run of seconds, smaller sizes")
    parser.add_argument("--out", default=None, help="profile path (default: the kvtier cache)")
    parser.add_argument("--disk-dir", default=None, help="folder for the disk scratch file")
    parser.add_argument("--threads", type=int, default=None, help="torch threads for compute")
    parser.add_argument("--remote", default=None, help="a shared tier (redis://…) to measure too")
    args = parser.parse_args(argv)

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    settings = Settings.quick() if args.quick else Settings()
    if args.disk_dir is not None:
        settings = dataclasses.replace(settings, disk_dir=Path(args.disk_dir))
    if args.remote is not None:
        settings = dataclasses.replace(settings, remote_url=args.remote)
    print_machine(machine_info())
    loaded = load_model(args.model)
    profile = calibrate_model(loaded.model, loaded.tokenizer, loaded.model_id, settings)
    path = save_profile(profile, args.out)
    print(report(profile))
    print(f"wrote {path} ({profile['seconds']:.0f} s)")
    return 0
