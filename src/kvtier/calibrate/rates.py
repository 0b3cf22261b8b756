"""The cost model's rates (``kvtier.config.PlacementRates``) from a calibration profile.

``placement_rates`` reads a profile (``kvtier.calibrate.calibrate``'s dict) and returns the
rates ``placement="auto"`` chooses from (and the stats predict costs with);
``resolve_rates`` fills a ``TieredCacheConfig``'s missing rates from this machine's profile
of a model. Pure functions of their arguments
(``resolve_rates`` also reads the profile file); thread-safe.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from kvtier.calibrate.profile import load_profile
from kvtier.config import PlacementRates, TieredCacheConfig


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
