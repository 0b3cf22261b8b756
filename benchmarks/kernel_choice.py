"""``kvtier bench kernel_choice`` as a script; the code is ``kvbench.kernel_choice``."""

from __future__ import annotations

from kvbench.kernel_choice import main

if __name__ == "__main__":
    raise SystemExit(main())
