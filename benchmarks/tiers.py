"""Put/get throughput per tier against same-run memcpy and O_DIRECT (``kvtier bench tiers``)."""

from __future__ import annotations

from kvtier.bench.tiers import main

if __name__ == "__main__":
    raise SystemExit(main())
