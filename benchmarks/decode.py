"""``kvtier bench decode`` as a script; the code is ``kvbench.decode``."""

from __future__ import annotations

from kvbench.decode import main

if __name__ == "__main__":
    raise SystemExit(main())
