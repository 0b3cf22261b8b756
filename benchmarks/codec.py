"""``kvtier bench codec`` as a script; the code is ``kvbench.codec``."""

from __future__ import annotations

from kvbench.codec import main

if __name__ == "__main__":
    raise SystemExit(main())
