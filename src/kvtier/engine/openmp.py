"""Torch's OpenMP runtime and the engine's thread: idle helpers of other threads released.

libgomp keeps, for every thread that has run a parallel region, a pool of helper threads,
and counts them all. Once that count passes the CPUs (the process's first thread has a
pool from loading the model and building the engine, and the engine's worker gets its
own), an idle helper spins only ~100 iterations before it sleeps in the kernel, so every
torch operator the worker runs in parallel pays a futex wake-up: a 393 KB ``torch.cat``
takes 38-53 us from a second thread against 8-12 from the first, and a 16 x 512-token
prefill step runs ~1,100 such regions (copies into the KV, norms, attention, matmuls).
Releasing the first thread's idle helpers (OpenMP 5's ``omp_pause_resource_all``, which
libgomp implements by letting that thread's pool exit) brings the count back to the CPUs,
and the worker's regions cost what they cost on the first thread (9 us: measured on the
2-core AMD EPYC, torch 2.13.0+cpu).

``release_idle_helpers`` acts on the calling thread's pool only; a later parallel region
on that thread makes a new pool (and the count grows again). Thread-safe: each call
touches its caller's pool.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

log = logging.getLogger(__name__)

_OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: threads released, state kept
_RUNTIMES = ("libgomp", "libiomp", "libomp")


def _loaded_runtime() -> Path | None:
    """The OpenMP runtime this process has loaded (torch's), from ``/proc/self/maps``; None
    off Linux or when none is loaded."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) > 5 and Path(fields[-1]).name.startswith(_RUNTIMES):
            return Path(fields[-1])
    return None


def release_idle_helpers() -> bool:
    """Let the calling thread's idle OpenMP helpers exit (``omp_pause_resource_all``);
    True when the runtime did. False, with nothing changed, where no OpenMP runtime is
    loaded, it lacks the call (before OpenMP 5), or it refused (the caller is inside a
    parallel region)."""
    runtime = _loaded_runtime()
    if runtime is None:
        return False
    try:
        pause = ctypes.CDLL(str(runtime)).omp_pause_resource_all
    except (OSError, AttributeError):
        log.debug("OpenMP runtime %s: no omp_pause_resource_all", runtime)
        return False
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    return bool(pause(_OMP_PAUSE_SOFT) == 0)
