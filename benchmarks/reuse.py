"""``kvtier bench reuse`` as a script; the code is ``kvbench.reuse``."""

from __future__ import annotations

from kvbench.reuse import main

if __name__ == "__main__":
    raise SystemExit(main())
