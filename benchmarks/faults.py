"""``kvtier bench faults`` as a script; the code is ``kvbench.faults``."""

from __future__ import annotations

from kvbench.faults import main

if __name__ == "__main__":
    raise SystemExit(main())
