"""``kvtier bench overlap`` as a script; the code is ``kvbench.overlap``."""

from __future__ import annotations

from kvbench.overlap import main

if __name__ == "__main__":
    raise SystemExit(main())
