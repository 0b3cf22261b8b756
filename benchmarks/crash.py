"""Prompt KV reused after ``kill -9``: write-through vs write-back (``kvtier bench crash``)."""

from __future__ import annotations

from kvtier.bench.crash import main

if __name__ == "__main__":
    raise SystemExit(main())
