"""``kvtier bench crash`` as a script; the code is ``kvbench.crash``."""

from __future__ import annotations

from kvbench.crash import main

if __name__ == "__main__":
    raise SystemExit(main())
