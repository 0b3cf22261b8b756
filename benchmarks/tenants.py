"""Does the prefix cache leak another tenant's prompt through timing? Per-key salting vs a
shared cache (``kvtier bench tenants``)."""

from __future__ import annotations

from kvtier.bench.tenants import main

if __name__ == "__main__":
    raise SystemExit(main())
