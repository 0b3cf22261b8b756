"""``kvtier bench serve`` as a script; the code is ``kvbench.serve``."""

from __future__ import annotations

from kvbench.serve import main

if __name__ == "__main__":
    raise SystemExit(main())
