"""``kvtier bench plan`` as a script; the code is ``kvbench.plan``."""

from __future__ import annotations

from kvbench.plan import main

if __name__ == "__main__":
    raise SystemExit(main())
