"""Reading request traces (JSONL, optionally xz- or gzip-compressed): ``open_trace``.

The Mooncake traces kvtier replays (``benchmarks/traces``) are committed compressed; the
planner and the benchmarks read them through this one function, so a plain ``.jsonl`` and a
``.jsonl.xz`` / ``.jsonl.gz`` are the same to every caller. Pure file reading; thread-safe.
"""

from __future__ import annotations

import gzip
import lzma
from pathlib import Path
from typing import TextIO

TRACE_SUFFIXES = (".jsonl", ".jsonl.xz", ".jsonl.gz")


def is_trace_path(path: Path) -> bool:
    """Whether ``path`` names a trace by its suffix (it need not exist)."""
    return path.name.endswith(TRACE_SUFFIXES)


def open_trace(path: Path, flag: str = "--trace") -> TextIO:
    """``path`` opened for reading text, decompressed by its suffix (``.xz``, ``.gz``).

    The caller owns the returned file and closes it.

    Raises:
        FileNotFoundError: no file at ``path`` (the message names it and ``flag``, the
            option that gave it).
    """
    if not path.is_file():
        raise FileNotFoundError(f"{flag}: {path} not found; pass {flag} PATH to a JSONL trace")
    if path.suffix == ".xz":
        return lzma.open(path, "rt", encoding="utf-8")
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    return path.open(encoding="utf-8")
