"""``bench faults``' disk scenarios: bytes flipped in the segment files, a filesystem that
fills, a folder that is read-only at start, and ``kill -9`` of a server mid-stream.

Each returns ``requests``, ``lost`` and ``wrong`` (see ``kvbench.fault_bench.score``) and
its own figures. The filesystems are real (``kvbench.mounts``: a small tmpfs, remounted
read-only); where mounting is not allowed the scenario says so (``not_run``) instead of
pretending.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvbench import crash, mounts
from kvbench.fault_bench import Bench, score, serve_one
from kvtier.engine import Engine


def corrupt_disk(bench: Bench, folder: Path) -> dict[str, Any]:
    """A served run leaves its chunks on disk; one byte in every 64 KiB of the segment files
    is flipped; a new engine must detect them (``corrupt_dropped``) and recompute."""
    disk = str(folder / "kv")
    config = bench.config(None, "", disk=disk)
    bench.serve(config, bench.prompts)  # closed: the chunks are on disk
    flipped = 0
    for segment in sorted(Path(disk).glob("*.kvseg")):
        data = bytearray(segment.read_bytes())
        for offset in range(4096 + 17, len(data), 1 << 16):  # past the first header block
            data[offset] ^= 0x01
            flipped += 1
        segment.write_bytes(bytes(data))
    with Engine(bench.model, bench.tokenizer, config) as engine:
        runs = [serve_one(engine, p) for p in bench.prompts]
        disk_stats = engine.manager.tier("disk").stats()
    return {
        **score(bench, runs, bench.prompts),
        "flipped_bytes": flipped,
        "detected": disk_stats.corrupt_dropped,
    }


def disk_full(bench: Bench, folder: Path) -> dict[str, Any]:
    """Write-through onto a tmpfs with room for about two chunks: the disk fills while the
    prompts are served; the tier stops writing (once, counted) and serving goes on, then a
    second pass reuses what host still holds."""
    chunk_nbytes = bench.chunk_nbytes()
    try:
        with mounts.tmpfs(folder / "full", size_kib=(2 * chunk_nbytes + 65536) // 1024) as disk:
            config = bench.config(None, "", disk=str(disk), write_policy="write_through")
            with Engine(bench.model, bench.tokenizer, config) as engine:
                runs = [serve_one(engine, p) for p in bench.prompts * 2]
                disk_stats = engine.manager.tier("disk").stats()
    except mounts.MountRefused as exc:
        return {"requests": 0, "lost": 0, "wrong": 0, "not_run": str(exc)}
    return {
        **score(bench, runs, bench.prompts * 2),
        "disk_puts": disk_stats.puts,
        "writes_disabled": disk_stats.writes_disabled,
        "io_errors": disk_stats.io_errors,
        "reused_second_pass": sum(r["reused"] for r in runs[len(bench.prompts) :]),
    }


def disk_read_only(bench: Bench, folder: Path) -> dict[str, Any]:
    """A served run leaves its chunks on a tmpfs, which is then remounted read-only; a new
    engine must start on it, serve those chunks, and keep new KV in host."""
    try:
        with mounts.tmpfs(folder / "ro", size_kib=1 << 20) as disk:
            config = bench.config(None, "", disk=str(disk))
            bench.serve(config, bench.prompts)  # closed: the chunks are on disk
            mounts.remount_read_only(disk)
            with Engine(bench.model, bench.tokenizer, config) as engine:
                runs = [serve_one(engine, p) for p in bench.prompts]
                disk_stats = engine.manager.tier("disk").stats()
    except mounts.MountRefused as exc:
        return {"requests": 0, "lost": 0, "wrong": 0, "not_run": str(exc)}
    return {
        **score(bench, runs, bench.prompts),
        "reused_from_disk": sum(r["reused"] for r in runs),
        "disk_hits": disk_stats.hits,
        "disk_puts": disk_stats.puts,
        "writes_disabled": disk_stats.writes_disabled,
    }


def kill9_mid_stream(folder: Path, count: int, words: int) -> dict[str, Any]:
    """``kvtier serve --write-policy write_through`` on the embedded model, killed with
    SIGKILL while a completion streams, restarted on the same disk folder
    (``kvbench.crash.run_policy``): every byte ``/metrics`` reported on disk before the
    kill is there after, and the prompts' answers are unchanged."""
    texts = crash.prompts(count, words, seed=3)
    folder.mkdir(parents=True, exist_ok=True)
    try:
        result = crash.run_policy(None, folder, "write_through", texts, chunk_tokens=64)
    except (OSError, RuntimeError) as exc:  # a server that did not come back
        return {"requests": 2 * count, "lost": count, "wrong": 0, "error": repr(exc)}
    return {
        "requests": 2 * count,
        "lost": 0,
        "wrong": 0 if result["outputs_identical"] else count,
        **result,
    }
