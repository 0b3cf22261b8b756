"""Interleaved multi-turn users: next-round time to first token with kvtier's reuse vs
recompute (``kvtier bench multiturn``)."""

from __future__ import annotations

from kvtier.bench.multiturn import main

if __name__ == "__main__":
    raise SystemExit(main())
