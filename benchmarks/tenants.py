"""``kvtier bench tenants`` as a script; the code is ``kvbench.tenants``."""

from __future__ import annotations

from kvbench.tenants import main

if __name__ == "__main__":
    raise SystemExit(main())
