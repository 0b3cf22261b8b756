"""``kvtier bench peers`` as a script; the code is ``kvbench.peers``."""

from __future__ import annotations

from kvbench.peers import main

if __name__ == "__main__":
    raise SystemExit(main())
