"""A production chat trace replayed against ``kvtier serve``: device-only vs device + host vs
device + host + disk (``kvtier bench serve``)."""

from __future__ import annotations

from kvtier.bench.serve import main

if __name__ == "__main__":
    raise SystemExit(main())
