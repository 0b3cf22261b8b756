"""``kvtier bench eviction`` as a script; the code is ``kvbench.eviction``."""

from __future__ import annotations

from kvbench.eviction import main

if __name__ == "__main__":
    raise SystemExit(main())
