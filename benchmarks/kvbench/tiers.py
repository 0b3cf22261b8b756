"""Benchmark ``tiers``: put/get throughput per tier against the machine's physical limits.

Question: how close do the host and disk tiers come to the memory-copy and O_DIRECT disk
bandwidth measured in the same run, for chunks of the embedded model's layout
(30 layers × 3 KV heads × 64 dims, fp32, 256 tokens = 11.8 MB a chunk)?

Baselines (same run, interleaved with the tier under test):
- memcpy: one large ``copy_`` between pre-touched buffers;
- O_DIRECT: ``dd`` sequential write then read of a file beside the disk tier's segments.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

from kvbench.common import (
    EMBEDDED_LAYOUT,
    base_parser,
    finish,
    header,
    interleave,
    median,
    memcpy_gbps,
    timed,
)
from kvtier.kv import Chunk, ChunkRef, KVLayout
from kvtier.tiers import Tier, host_tier
from kvtier.tiers.disk import DiskTier


def make_chunks(layout: KVLayout, count: int, seed: int) -> list[Chunk]:
    """``count`` distinct chunks with random data (keys need not chain for this question)."""
    gen = torch.Generator().manual_seed(seed)
    chunks = []
    for i in range(count):
        ids = torch.randint(0, 49_152, (layout.chunk_tokens,), generator=gen)
        key = i.to_bytes(8, "little") + seed.to_bytes(8, "little")
        chunks.append(Chunk(ChunkRef.of(key, ids), torch.randn(layout.chunk_shape, generator=gen)))
    return chunks


_DD_RATE = re.compile(r"([\d.]+) s,")


def dd_gbps(args: list[str], nbytes: int) -> float:
    """Run ``dd`` and return its throughput from its own timing line."""
    proc = subprocess.run(["dd", *args], capture_output=True, text=True, check=True)
    match = _DD_RATE.search(proc.stderr)
    if match is None:
        raise RuntimeError(f"could not read dd's timing from: {proc.stderr!r}")
    return nbytes / float(match.group(1)) / 1e9


def tier_put_gbps(tier: Tier, chunks: list[Chunk]) -> float:
    tier.clear()
    seconds = timed(lambda: tier.put(chunks))
    return len(chunks) * tier.chunk_nbytes / seconds / 1e9


def tier_get_gbps(tier: Tier, chunks: list[Chunk], out: torch.Tensor) -> float:
    refs = [c.ref for c in chunks]

    def read_all() -> None:
        for ref in refs:
            if not tier.get_into([ref], [out])[0]:
                raise RuntimeError(f"{tier.name} lost chunk {ref.short()} during the benchmark")

    return len(chunks) * tier.chunk_nbytes / timed(read_all) / 1e9


def run(quick: bool, seed: int, folder: Path | None) -> dict[str, Any]:
    layout = EMBEDDED_LAYOUT
    num_chunks = 12 if quick else 40
    repeats = 5 if quick else 9
    nbytes = num_chunks * layout.chunk_nbytes
    chunks = make_chunks(layout, num_chunks, seed)
    out = layout.empty_chunk().zero_()
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-bench-", dir=folder))
    try:
        host = host_tier(layout, nbytes, pin_memory=False)
        disk = DiskTier(layout, str(workdir / "disk"), nbytes)
        dd_file = workdir / "dd.bin"
        block = 16 << 20
        count = max(1, nbytes // block)
        dd_bytes = count * block
        host.put(chunks)  # warm the pool and the code paths once
        cases = {
            "memcpy_gbps": lambda _: memcpy_gbps(256 << 20),
            "host_put_gbps": lambda _: tier_put_gbps(host, chunks),
            "host_get_gbps": lambda _: tier_get_gbps(host, chunks, out),
            "odirect_write_gbps": lambda _: dd_gbps(
                ["if=/dev/zero", f"of={dd_file}", f"bs={block}", f"count={count}", "oflag=direct"],
                dd_bytes,
            ),
            "disk_write_gbps": lambda _: tier_put_gbps(disk, chunks),
            "odirect_read_gbps": lambda _: dd_gbps(
                [f"if={dd_file}", "of=/dev/null", f"bs={block}", "iflag=direct"], dd_bytes
            ),
            "disk_read_gbps": lambda _: tier_get_gbps(disk, chunks, out),
        }
        samples = interleave(cases, repeats)
        disk_desc = (
            f"segments in {workdir}, O_DIRECT {'on' if disk.o_direct else 'off'}, "
            f"fdatasync per put {'on' if disk.fsync else 'off'}"
        )
        host.close()
        disk.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    med = {name: median(values) for name, values in samples.items()}
    summary = {
        "host_put_vs_memcpy": med["host_put_gbps"] / med["memcpy_gbps"],
        "host_get_vs_memcpy": med["host_get_gbps"] / med["memcpy_gbps"],
        "disk_write_vs_odirect": med["disk_write_gbps"] / med["odirect_write_gbps"],
        "disk_read_vs_odirect": med["disk_read_gbps"] / med["odirect_read_gbps"],
        **{name: round(value, 3) for name, value in med.items()},
    }
    return {
        "summary": summary,
        "samples": samples,
        "config": {
            "layout": layout.fingerprint(),
            "chunk_nbytes": layout.chunk_nbytes,
            "num_chunks": num_chunks,
            "repeats": repeats,
            "quick": quick,
            "disk": disk_desc,
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = base_parser("tiers", __doc__)
    parser.add_argument("--dir", type=Path, default=None, help="where the disk tier writes")
    args = parser.parse(argv)
    info = header({"host<->disk": "real (local disk, O_DIRECT)"})
    result = run(args.quick, args.seed, args.dir)
    s = result["summary"]
    print(f"{'case':<22}{'GB/s (median)':>14}")
    for name in ("memcpy", "host_put", "host_get", "odirect_write", "disk_write"):
        print(f"{name:<22}{s[name + '_gbps']:>14.3f}")
    for name in ("odirect_read", "disk_read"):
        print(f"{name:<22}{s[name + '_gbps']:>14.3f}")
    finish(
        args.json,
        result,
        info,
        f"summary: host put/get {s['host_put_vs_memcpy']:.2f}/{s['host_get_vs_memcpy']:.2f} "
        f"of memcpy; disk write/read {s['disk_write_vs_odirect']:.2f}/"
        f"{s['disk_read_vs_odirect']:.2f} of O_DIRECT",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
