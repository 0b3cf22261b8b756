"""Next-turn time to first token with the history's KV reused from host or disk vs
recompute (``kvtier bench reuse``)."""

from __future__ import annotations

from kvtier.bench.reuse import main

if __name__ == "__main__":
    raise SystemExit(main())
