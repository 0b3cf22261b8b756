"""Long-context decode step time at a device budget vs the bound and the baselines
(``kvtier bench decode``)."""

from __future__ import annotations

from kvtier.bench.decode import main

if __name__ == "__main__":
    raise SystemExit(main())
