"""``kvtier bench multiturn`` as a script; the code is ``kvbench.multiturn``."""

from __future__ import annotations

from kvbench.multiturn import main

if __name__ == "__main__":
    raise SystemExit(main())
