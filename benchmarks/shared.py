"""``kvtier bench shared`` as a script; the code is ``kvbench.shared``."""

from __future__ import annotations

from kvbench.shared import main

if __name__ == "__main__":
    raise SystemExit(main())
