"""``kvtier bench flood`` as a script; the code is ``kvbench.flood``."""

from __future__ import annotations

from kvbench.flood import main

if __name__ == "__main__":
    raise SystemExit(main())
