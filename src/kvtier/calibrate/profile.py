"""Calibration profiles on disk: one JSON per machine and model.

``save_profile`` writes a profile (atomically) to
``<kvtier cache>/profiles/<machine>-<model>.json``; ``load_profile`` finds the one that
matches this machine (``machine_identity``: CPU model, cores, memory, accelerator, torch)
and a model identity (``kvtier.models.model_identity``).
Reads and writes only those files.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

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
