"""``kvtier bench profile_step`` as a script; the code is ``kvbench.profile_step``."""

from __future__ import annotations

from kvbench.profile_step import main

if __name__ == "__main__":
    raise SystemExit(main())
