"""``kvtier bench writeback`` as a script; the code is ``kvbench.writeback``."""

from __future__ import annotations

from kvbench.writeback import main

if __name__ == "__main__":
    raise SystemExit(main())
