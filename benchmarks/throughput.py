"""Offline generation tokens/s: continuous batching vs transformers static batching
(``kvtier bench throughput``)."""

from __future__ import annotations

from kvtier.bench.throughput import main

if __name__ == "__main__":
    raise SystemExit(main())
