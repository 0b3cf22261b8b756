"""``kvtier bench throughput`` as a script; the code is ``kvbench.throughput``."""

from __future__ import annotations

from kvbench.throughput import main

if __name__ == "__main__":
    raise SystemExit(main())
