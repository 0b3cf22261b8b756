"""Benchmark ``writeback``: does write-back on eviction stall the compute thread?

Question: a decode loop whose host tier is full and evicts one chunk to disk on every step,
with the host⇄disk link throttled far below the rate chunks are evicted, against the same
loop with no disk tier (victims dropped) — how much slower is a step? Goal: at most 1.10×.

Each step is a compute part (matmuls sized to ``--step-ms`` on ``--threads`` torch
threads, standing in for a forward pass) and a ``KVManager.store`` of one sealed chunk of
the embedded model's layout (30 layers × 3 KV heads × 64 dims, fp32, 256 tokens = 11.8 MB),
as a batch whose sequences seal chunks in turn would. The host holds ``--host-chunks``, so
from the first step on every store evicts. With a disk tier the victim is copied into the
write-back queue and written by the link's worker at ``--disk-gbps``; the queue drops its
oldest waiting chunk when full (counted). The disk is real (the local filesystem, fsync
on); the link is throttled. The two cases run interleaved, ``--repeats`` times each, on a
fresh manager each time; the figure is the ratio of median step times (disk / no disk).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvbench.common import EMBEDDED_LAYOUT, base_parser, finish, header, interleave, median
from kvtier.config import DiskConfig, HostConfig, LinkConfig, ManagerConfig
from kvtier.kv import Chunk
from kvtier.manager import KVManager
from kvtier.transfer import Throttle

WIDTH = 1024  # the compute part: [64, WIDTH] @ [WIDTH, WIDTH], repeated


class Compute:
    """A fixed amount of matmul work, calibrated once to take about ``step_ms``."""

    def __init__(self, step_ms: float, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.weight = torch.randn(WIDTH, WIDTH, generator=gen) / WIDTH**0.5
        self.x = torch.randn(64, WIDTH, generator=gen)
        self.reps = 1
        self()  # warm
        start = time.perf_counter()
        self.reps = 20
        self()
        per_rep_ms = (time.perf_counter() - start) * 1e3 / 20
        self.reps = max(1, round(step_ms / per_rep_ms))

    def __call__(self) -> None:
        x = self.x
        for _ in range(self.reps):
            x = torch.tanh(x @ self.weight)


def make_manager(args: Any, disk_dir: Path | None) -> KVManager:
    layout = EMBEDDED_LAYOUT
    lower: tuple[DiskConfig, ...] = ()
    if disk_dir is not None:
        link = LinkConfig(gbps=args.disk_gbps)
        disk = DiskConfig(path=str(disk_dir), capacity_bytes=64 * layout.chunk_nbytes, link=link)
        lower = (disk,)
    config = ManagerConfig(
        chunk_tokens=layout.chunk_tokens,
        host=HostConfig(capacity_bytes=args.host_chunks * layout.chunk_nbytes, pin_memory=False),
        lower_tiers=lower,
    )
    return KVManager(layout, "bench-writeback", config)


def sealed_chunks(manager: KVManager, count: int, seed: int) -> list[Chunk]:
    """``count`` chunks of one sequence, with random data (made before any timing)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 49_152, (count * manager.layout.chunk_tokens,), generator=gen)
    shape = manager.layout.chunk_shape
    return [Chunk(ref, torch.randn(shape, generator=gen)) for ref in manager.refs_for(ids.numpy())]


def decode_run(args: Any, compute: Compute, with_disk: bool, repeat: int) -> dict[str, Any]:
    """One decode loop on a fresh manager; step times and what the manager moved."""
    with tempfile.TemporaryDirectory(prefix="kvbench-wb-", dir=args.dir) as folder:
        manager = make_manager(args, Path(folder) if with_disk else None)
        chunks = sealed_chunks(manager, args.host_chunks + args.steps, args.seed + repeat)
        manager.store(chunks[: args.host_chunks])  # a full host: every step evicts
        manager.wait_writes()
        step_s = []
        for chunk in chunks[args.host_chunks :]:
            start = time.perf_counter()
            compute()
            manager.store([chunk])
            step_s.append(time.perf_counter() - start)
        stats = manager.stats()
        manager.close()
    disk = stats.tiers.get("disk")
    return {
        "step_s": step_s,
        "evictions": stats.tiers["host"].evictions,
        "write_backs_queued": stats.write_backs_queued,
        "write_backs_dropped": stats.write_backs_dropped,
        "disk_puts": disk.puts if disk is not None else 0,
        "link_submit_blocked_s": sum(ls.submit_blocked_s for ls in stats.links.values()),
    }


def run(args: Any) -> dict[str, Any]:
    torch.manual_seed(args.seed)
    compute = Compute(args.step_ms, args.seed)
    cases = interleave(
        {
            "no_disk": lambda repeat: decode_run(args, compute, False, repeat),
            "disk": lambda repeat: decode_run(args, compute, True, repeat),
        },
        args.repeats,
    )
    medians = {name: median([s for r in runs for s in r["step_s"]]) for name, runs in cases.items()}
    per_repeat = [
        statistics.median(d["step_s"]) / statistics.median(n["step_s"])
        for n, d in zip(cases["no_disk"], cases["disk"], strict=True)
    ]
    disk_runs = cases["disk"]
    return {
        "cases": cases,
        "summary": {
            "step_ms_no_disk": medians["no_disk"] * 1e3,
            "step_ms_disk": medians["disk"] * 1e3,
            "ratio": medians["disk"] / medians["no_disk"],
            "ratio_per_repeat": per_repeat,
            "evictions_per_step": disk_runs[0]["evictions"] / args.steps,
            "write_backs_queued": sum(r["write_backs_queued"] for r in disk_runs),
            "write_backs_dropped": sum(r["write_backs_dropped"] for r in disk_runs),
            "disk_puts": sum(r["disk_puts"] for r in disk_runs),
            "link_submit_blocked_s": sum(r["link_submit_blocked_s"] for r in disk_runs),
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = base_parser("writeback", __doc__)
    parser.sized("--steps", 40, 12, "decode steps per run", type=int)
    parser.sized("--repeats", 5, 2, "runs of each case", type=int)
    parser.add_argument("--step-ms", type=float, default=30.0, help="compute per step")
    parser.add_argument(
        "--threads", type=int, default=1, minimum=1, help="torch threads for compute"
    )
    parser.add_argument("--host-chunks", type=int, default=8, help="host capacity in chunks")
    parser.add_argument("--disk-gbps", type=float, default=0.05, help="host<->disk throttle")
    parser.add_argument("--dir", type=Path, default=None, help="where the disk tier writes")
    args = parser.parse(argv)
    torch.set_num_threads(args.threads)
    link = Throttle(args.disk_gbps, 0.0).describe()
    info = header({"host<->disk": f"{link} (the disk behind it is real, fsync on)"})
    result = run(args)
    result["args"] = {k: v for k, v in vars(args).items() if k not in ("json", "dir")}
    s = result["summary"]
    chunk_mb = EMBEDDED_LAYOUT.chunk_nbytes / 1e6
    print(
        f"{args.steps} steps x {args.repeats} repeats; one {chunk_mb:.1f} MB chunk evicted "
        f"per step ({s['evictions_per_step']:.2f}); disk link {args.disk_gbps} GB/s"
    )
    print(f"{'case':<10}{'step ms (median)':>18}")
    print(f"{'no disk':<10}{s['step_ms_no_disk']:>18.2f}")
    print(f"{'disk':<10}{s['step_ms_disk']:>18.2f}")
    print(
        f"write-backs: {s['write_backs_queued']} queued, {s['disk_puts']} landed, "
        f"{s['write_backs_dropped']} dropped (queue full); compute blocked on the link "
        f"{s['link_submit_blocked_s'] * 1e3:.1f} ms"
    )
    verdict = "within" if s["ratio"] <= 1.10 else "ABOVE"
    finish(
        args.json,
        result,
        info,
        f"summary: a step that evicts to a throttled disk takes {s['ratio']:.3f}x the step "
        f"without a disk tier ({verdict} the 1.10 goal)",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
