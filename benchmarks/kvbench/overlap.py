"""Benchmark ``overlap``: a reused prefix on a slow disk, its front computed as its back loads.

Question: when a prompt's cached KV lies on a lower tier whose read rate makes loading it
about as slow as recomputing it, how much sooner does the first token come when the engine
computes the prefix's front while the back loads (meeting where the two cross) than with
the faster of load-only and recompute-only?

Method (embedded model, the engine with a host pool and a disk tier, one request at a time;
every case a new engine on the same disk folder, so host starts empty):

1. serve the prompt once (its chunks go to disk);
2. the rate: recompute-only (the prompt under a tenant salt nothing is cached under: a
   full prefill, with the same disk writes) and load-only at the disk's own speed (the
   prompt's last chunk is prefilled after the load either way); the disk link is then
   throttled so that loading the cached chunks takes their difference, so load-only and
   recompute-only take about as long;
3. then interleaved, ``--repeats`` rounds: recompute-only, load-only
   (``EngineConfig.reuse_overlap=False``: the chunks load, then the rest is prefilled) and
   overlap (the default), each TTFT of one request with ``max_tokens=1``.

Load-only also reads the partial chunk holding the prompt's last whole pages; overlap
adopts whole chunks only and computes that last piece.

``ttft_vs_best_single`` = overlap ÷ min(load-only, recompute-only) (medians); the goal is
≤ 0.8. Tokens of every case must be identical. Reads come from the page cache under the
throttle (the throttle, not the device, sets the rate).
"""

from __future__ import annotations

import dataclasses
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvbench.common import base_parser, finish, header, interleave, median
from kvtier.config import DiskConfig, HostConfig, LinkConfig, ManagerConfig
from kvtier.engine import Engine, EngineConfig, SamplingParams
from kvtier.kv import KVLayout
from kvtier.models import load_model

ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def engine_config(disk: Path, host_nbytes: int, gbps: float | None) -> EngineConfig:
    """One sequence at a time, a host pool of ``host_nbytes``, the disk link at ``gbps``."""
    manager = ManagerConfig(
        host=HostConfig(capacity_bytes=host_nbytes),
        lower_tiers=(DiskConfig(path=str(disk), fsync=False, link=LinkConfig(gbps=gbps)),),
    )
    return EngineConfig(max_batch_size=1, manager=manager)


def ttft(loaded: Any, config: EngineConfig, prompt: list[int], salt: str) -> dict[str, Any]:
    """One request's time to first token on a new engine, its token and reuse decisions."""
    with Engine(loaded.model, loaded.tokenizer, config, model_id=loaded.model_id) as engine:
        start = time.perf_counter()
        out = engine.submit(prompt, ONE_TOKEN, cache_salt=salt).result()
        seconds = time.perf_counter() - start
        decisions = engine.stats().reuse_decisions
    return {
        "ttft_s": seconds,
        "tokens": out.token_ids,
        "reused_tokens": out.reused_tokens,
        "decisions": {name: dataclasses.asdict(cost) for name, cost in decisions.items()},
    }


def run(context: int, repeats: int, seed: int) -> dict[str, Any]:
    loaded = load_model()
    rng = random.Random(seed)
    prompt = [rng.randrange(10, int(loaded.model.config.vocab_size)) for _ in range(context)]
    folder = Path(tempfile.mkdtemp(prefix="kvtier-overlap-"))
    try:
        chunk_tokens = ManagerConfig().chunk_tokens
        layout = KVLayout.from_model_config(loaded.model.config, torch.float32, chunk_tokens)
        chunk_nbytes = layout.chunk_nbytes
        host_nbytes = 2 * (context // chunk_tokens + 2) * chunk_nbytes  # twice the prompt
        base = engine_config(folder, host_nbytes, None)
        first = ttft(loaded, base, prompt, "")
        print(f"served once: {first['ttft_s']:.2f} s (its chunks are on disk now)")
        recompute = ttft(loaded, base, prompt, "recompute-0")["ttft_s"]
        no_overlap = dataclasses.replace(base, reuse_overlap=False)
        fast = ttft(loaded, no_overlap, prompt, "")
        unthrottled = fast["ttft_s"]
        load_s = max(recompute - unthrottled, 0.1 * recompute)
        # Load-only reads the whole chunks and the partial one holding the last pages.
        loaded_chunks = -(-fast["reused_tokens"] // chunk_tokens)
        gbps = loaded_chunks * chunk_nbytes / load_s / 1e9
        print(
            f"recompute-only {recompute:.2f} s, load-only unthrottled {unthrottled:.2f} s -> "
            f"disk throttled to {gbps:.4f} GB/s (loading the cached chunks takes {load_s:.2f} s)"
        )
        throttled = engine_config(folder, host_nbytes, gbps)
        cases = {
            "recompute": lambda i: ttft(loaded, throttled, prompt, f"recompute-{i + 1}"),
            "load": lambda i: ttft(
                loaded, dataclasses.replace(throttled, reuse_overlap=False), prompt, ""
            ),
            "overlap": lambda i: ttft(loaded, throttled, prompt, ""),
        }

        def progress(i: int, name: str, run: dict[str, Any]) -> None:
            print(f"round {i + 1}/{repeats} {name:<9} {run['ttft_s']:.2f} s")

        runs = interleave(cases, repeats, progress)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    ttfts = {name: median([r["ttft_s"] for r in rs]) for name, rs in runs.items()}
    tokens = [r["tokens"] for rs in runs.values() for r in rs] + [first["tokens"]]
    best_single = min(ttfts["load"], ttfts["recompute"])
    return {
        "context_tokens": context,
        "chunk_tokens": chunk_tokens,
        "load_only_chunks": loaded_chunks,
        "derivation": {
            "recompute_s": recompute,
            "load_unthrottled_s": unthrottled,
            "load_s": load_s,
        },
        "disk_gbps": gbps,
        "repeats": repeats,
        "ttft_s": ttfts,
        "runs": runs,
        "summary": {
            "ttft_vs_best_single": ttfts["overlap"] / best_single,
            "load_vs_recompute": ttfts["load"] / ttfts["recompute"],
            "tokens_identical": all(t == tokens[0] for t in tokens),
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = base_parser("overlap", __doc__)
    parser.sized("--context", 4096, 1024, "prompt tokens", type=int, minimum=512)
    parser.sized("--repeats", 3, 1, "interleaved rounds", type=int, minimum=1)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    args = parser.parse(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    info = header()
    result = run(args.context, args.repeats, args.seed)
    s, t = result["summary"], result["ttft_s"]
    print(
        f"TTFT of a {args.context}-token prompt cached on disk at {result['disk_gbps']:.4f} "
        f"GB/s: recompute {t['recompute']:.2f} s, load {t['load']:.2f} s, overlap "
        f"{t['overlap']:.2f} s"
    )
    finish(
        args.json,
        result,
        info,
        f"summary: ttft_vs_best_single {s['ttft_vs_best_single']:.2f} (goal <= 0.8), "
        f"load/recompute {s['load_vs_recompute']:.2f}, tokens identical {s['tokens_identical']}",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
