"""Calibration profiles on disk (one JSON per machine and model) and the cost model's rates
read from them.

``save_profile`` writes a profile (atomically) to
``<kvtier cache>/profiles/<machine>-<model>.json``; ``load_profile`` finds the one that
matches this machine (``machine_identity``: CPU model, cores, memory, accelerator, torch)
and a model identity (``kvtier.models.model_identity``). ``placement_rates`` reads a
profile into ``kvtier.config.PlacementRates`` (what ``placement="auto"`` chooses from and
the stats predict costs with); ``resolve_rates`` fills a ``TieredCacheConfig``'s missing
rates from this machine's profile of a model.

Below both the code that writes profiles (``kvtier.calibrate``, which measures through the
engine) and the code that reads them (the engine, the transformers cache, the planner).
Reads and writes only the profile files; thread-safe.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from kvtier.config import PlacementRates, TieredCacheConfig
from kvtier.machine import machine_info
from kvtier.models import cache_root

PROFILE_VERSION = 2


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


class ProfileMissingError(ValueError):
    """``placement="auto"`` without rates, and no profile of the model on this machine."""


def placement_rates(profile: dict[str, Any], threads: int | None = None) -> PlacementRates:
    """The rates of ``profile`` at ``threads`` torch threads (default: the current count;
    the nearest measured count at or below it).

    - ``link_gbps``: host→device (``link.h2d_gbps``);
    - ``host_attention_gbps``: kvtier's ``attend_slots`` where it was measured, else torch's;
    - ``device_attention_gbps``: ``attention.device.gbps``;
    - ``compute_s``: a decode pass's time at no context (the decode fit's intercept);
    - ``concurrent``: the device is not the host's CPU.
    """
    try:
        host = profile["attention"]["host"]
        by_threads: dict[str, float] = host.get("kvtier") or host["torch"]
        want = threads if threads is not None else torch.get_num_threads()
        counts = sorted(int(t) for t in by_threads)
        below = [t for t in counts if t <= want]
        chosen = below[-1] if below else counts[0]
        return PlacementRates(
            link_gbps=float(profile["link"]["h2d_gbps"]),
            host_attention_gbps=float(by_threads[str(chosen)]),
            device_attention_gbps=float(profile["attention"]["device"]["gbps"]),
            compute_s=float(profile["compute"]["decode"]["fit"]["ms"]) / 1e3,
            concurrent=not str(profile["machine"]["device"]).startswith("cpu"),
        )
    except (KeyError, IndexError, TypeError) as exc:
        raise ValueError(
            f"the calibration profile lacks {exc}; run `kvtier calibrate` again"
        ) from exc


def resolve_rates(
    config: TieredCacheConfig,
    model_id: str,
    cache_dir: str | os.PathLike[str] | None = None,
) -> TieredCacheConfig:
    """``config`` with ``rates`` from this machine's profile of ``model_id`` when none were
    given (with them the stats predict every decision's cost; ``auto`` chooses from them);
    ``config`` itself when it has rates, or has no profile and does not need one.

    Raises:
        ProfileMissingError: ``placement`` is ``auto`` and no profile matches this machine
            and model.
    """
    if config.rates is not None:
        return config
    profile = load_profile(model_id, cache_dir)
    if profile is None:
        if config.placement != "auto":
            return config
        raise ProfileMissingError(
            f"placement 'auto' needs this machine's rates for model {model_id}: run "
            "`kvtier calibrate` (with --model for another model), or pass rates"
        )
    return dataclasses.replace(config, rates=placement_rates(profile))
