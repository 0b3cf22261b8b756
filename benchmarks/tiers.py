"""``kvtier bench tiers`` as a script; the code is ``kvbench.tiers``."""

from __future__ import annotations

from kvbench.tiers import main

if __name__ == "__main__":
    raise SystemExit(main())
