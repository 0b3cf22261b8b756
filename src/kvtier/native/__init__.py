"""kvtier's hand-written CPU operators (``cpu_ops.cpp``, ``attend_prefill.cpp``,
``codec_ops.cpp``; shared vector helpers in ``vec.h``), compiled once per machine.

``ops()`` gives ``torch.ops.kvtier_cpu`` (decode attention over the seat slab, a prefill
pass's causal attention, RMSNorm with and without a residual add, RoPE in place, SiLU·mul,
a few-row matmul, a decode batch's every layer in one call (``decode_layers.cpp``, made of
the others through ``ops.h``), the chunk codecs' encode and decode), or None where they
cannot be had: the kernels are off (``KVTIER_NATIVE=0``), or the build failed (no C++
compiler or ``ninja``).
Callers then take their torch path; the reason is logged once and kept in ``status()``.

The first call compiles the sources with ``torch.utils.cpp_extension`` (``-O3
-march=native``, OpenMP; about 11 s on the 2-core AMD EPYC) into ``<kvtier
cache>/native/<digest>`` (``KVTIER_NATIVE_DIR`` moves the folder), where the digest covers
the sources, the compiler flags, torch's version and the CPU's model and flags; a later
process on the same machine loads that library (well under a second) instead of compiling
again. ``status()`` says which happened and how long it took.

Thread-safety: ``ops()`` may be called from any thread; the build runs once, under a lock
(and torch's file lock in the build folder across processes).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvtier.models import cache_root

log = logging.getLogger(__name__)

_HERE = Path(__file__).parent
SOURCES = (
    _HERE / "cpu_ops.cpp",
    _HERE / "attend_prefill.cpp",
    _HERE / "attend_bf16.cpp",
    _HERE / "codec_ops.cpp",
    _HERE / "linear_ops.cpp",
    _HERE / "pool.cpp",
    _HERE / "decode_layers.cpp",
)
HEADERS = (_HERE / "vec.h", _HERE / "pool.h", _HERE / "ops.h", _HERE / "amx.h")
CFLAGS = ("-O3", "-march=native", "-fopenmp")
LDFLAGS = ("-fopenmp",)
ENV_SWITCH = "KVTIER_NATIVE"
"""``KVTIER_NATIVE=0`` turns the kernels off (every caller takes its torch path)."""
ENV_DIR = "KVTIER_NATIVE_DIR"
"""Where the built libraries go (default ``<kvtier cache>/native``)."""


@dataclass(frozen=True)
class NativeStatus:
    """How the kernels were had in this process.

    Attributes:
        available: the operators are registered.
        how: ``compiled``, ``cached`` (loaded a library built before), ``off`` or
            ``failed``.
        seconds: wall time of the build or load.
        path: the built library (None when not built).
        reason: why not available (None when available).
    """

    available: bool
    how: str
    seconds: float
    path: Path | None
    reason: str | None

    def line(self) -> str:
        """One line for a start-up log."""
        if self.available:
            return f"CPU kernels: {self.how} in {self.seconds:.1f} s ({self.path})"
        return f"CPU kernels: not used ({self.reason}); torch's ops instead"


_lock = threading.Lock()
_status: NativeStatus | None = None


def enabled() -> bool:
    """False when ``KVTIER_NATIVE`` is ``0`` (read on every call)."""
    return os.environ.get(ENV_SWITCH, "1") != "0"


def ops() -> Any | None:
    """``torch.ops.kvtier_cpu`` once built or loaded; None when off or unavailable."""
    if not enabled():
        return None
    status = load()
    return torch.ops.kvtier_cpu if status.available else None


KV_DTYPES = (torch.float32, torch.bfloat16)
"""KV element types the attention kernels (``decode_attend``, ``attend_prefill``,
``attend_slots``) read. bf16: ``attend_prefill`` widens it exactly as it is loaded (float32
arithmetic); ``decode_attend`` and ``attend_slots`` do too where ``bf16_prefill()`` is ``""``
or the head dim is not 64 or 128, and otherwise, like ``attend_prefill_bf16``, round the
queries and probabilities to bf16 and multiply on vdpbf16ps (kvtier's bf16 mode)."""


def kv_ops(kv: torch.Tensor) -> Any | None:
    """``ops()`` when the attention kernels read ``kv`` (a CPU tensor of a ``KV_DTYPES``
    type), else None: the caller takes its torch path."""
    return ops() if kv.is_cpu and kv.dtype in KV_DTYPES else None


def bf16_prefill() -> str:
    """What ``attend_prefill_bf16`` (``attend_bf16.cpp``) multiplies bf16 attention on
    here: ``"amx"`` (built for a CPU with AMX, and Linux grants the tile state),
    ``"avx512_bf16"`` (vdpbf16ps), or ``""`` (neither: the op does not run)."""
    global _bf16_prefill
    kernels = ops()
    if kernels is None:
        return ""
    if _bf16_prefill is None:
        _bf16_prefill = str(kernels.bf16_prefill())
    return _bf16_prefill


_bf16_prefill: str | None = None


def status() -> NativeStatus:
    """What ``ops()`` found (building or loading the kernels if not done yet)."""
    if not enabled():
        return NativeStatus(False, "off", 0.0, None, f"{ENV_SWITCH}=0")
    return load()


def load() -> NativeStatus:
    """Build (first time on this machine) or load the kernels, once per process."""
    global _status
    with _lock:
        if _status is None:
            _status = _build()
        return _status


def digest() -> str:
    """What the built library depends on: the source, flags, torch and the CPU."""
    h = hashlib.sha256()
    for path in (*SOURCES, *HEADERS):
        h.update(path.read_bytes())
    h.update(repr((CFLAGS, LDFLAGS, torch.__version__, platform.machine())).encode())
    h.update(_cpu_identity().encode())
    return h.hexdigest()[:16]


def _cpu_identity() -> str:
    """The CPU model and feature flags (``-march=native`` compiles for them)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep)))


def _build() -> NativeStatus:
    start = time.perf_counter()
    name = f"kvtier_cpu_{digest()}"
    folder = Path(os.environ.get(ENV_DIR) or cache_root() / "native") / name
    library = folder / f"{name}.so"
    try:
        if library.exists():
            torch.ops.load_library(str(library))
            how = "cached"
        else:
            folder.mkdir(parents=True, exist_ok=True)
            log.warning("compiling kvtier's CPU kernels once for this machine (~10-30 s)")
            from torch.utils.cpp_extension import load as build

            build(
                name=name,
                sources=[str(path) for path in SOURCES],
                extra_cflags=list(CFLAGS),
                extra_ldflags=list(LDFLAGS),
                build_directory=str(folder),
                is_python_module=False,
                verbose=False,
            )
            how = "compiled"
    except Exception as error:  # no compiler, no ninja, a failed build: torch's ops instead
        last = (str(error).strip().splitlines() or [""])[-1]
        reason = f"{type(error).__name__}: {last}"
        status = NativeStatus(False, "failed", time.perf_counter() - start, None, reason)
        log.warning(status.line())
        return status
    status = NativeStatus(True, how, time.perf_counter() - start, library, None)
    log.info(status.line())
    return status
