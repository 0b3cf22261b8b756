"""The ``kvtier`` command line.

Expected failures (bad flags, a missing model, an unwritable path, a full tier) print one
line naming the problem and the fix, and exit with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from kvtier.hugepages import request_huge_pages
from kvtier.tiers.base import TierFullError

EXPECTED_ERRORS = (ValueError, FileNotFoundError, PermissionError, TierFullError, OSError)


def _benchmarks() -> tuple[str, ...]:
    """The benchmarks of the source checkout kvtier runs from (``benchmarks/kvbench``).

    The benchmark code is not part of the installed package: it lives beside it in the
    repository, and ``kvtier bench`` puts ``benchmarks/`` on the import path.

    Raises:
        FileNotFoundError: kvtier is not installed from a checkout that has them.
    """
    folder = Path(__file__).resolve().parents[2] / "benchmarks"
    if not (folder / "kvbench" / "__init__.py").is_file():
        raise FileNotFoundError(
            f"bench: no benchmarks at {folder}; kvtier bench runs from a source checkout "
            "(pip install -e .)"
        )
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    return tuple(importlib.import_module("kvbench").BENCHMARKS)


def _bench(argv: list[str]) -> int:
    benchmarks = _benchmarks()
    if not argv or argv[0] in ("-h", "--help"):
        print(
            f"usage: kvtier bench NAME [--quick] [--json PATH]\nbenchmarks: {', '.join(benchmarks)}"
        )
        return 0
    name, rest = argv[0], argv[1:]
    if name not in benchmarks:
        raise ValueError(f"bench: unknown benchmark {name!r}; accepted: {', '.join(benchmarks)}")
    module = importlib.import_module(f"kvbench.{name}")
    return int(module.main(rest))


def main(argv: list[str] | None = None) -> int:
    request_huge_pages()  # before any torch buffer exists (kvtier.hugepages)
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="kvtier", description="tiered KV-cache engine")
    commands = ["run", "serve", "bench", "calibrate", "plan"]
    parser.add_argument("command", choices=commands, help="what to run")
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    try:
        command, rest = argv[0], argv[1:]
        if command == "bench":
            return _bench(rest)
        if command == "run":
            from kvtier.run import main as run_main

            return run_main(rest)
        if command == "serve":
            from kvtier.server.launch import main as serve_main

            return serve_main(rest)
        if command == "calibrate":
            from kvtier.calibrate import main as calibrate_main

            return calibrate_main(rest)
        if command == "plan":
            from kvtier.plan import main as plan_main

            return plan_main(rest)
        parser.parse_args(argv)  # prints the usage error for an unknown command
        return 2
    except EXPECTED_ERRORS as exc:
        print(f"kvtier: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvtier: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
