"""``kvtier bench librarian`` as a script; the code is ``kvbench.librarian``."""

from __future__ import annotations

from kvbench.librarian import main

if __name__ == "__main__":
    raise SystemExit(main())
