"""Benchmark ``eviction``: which eviction policy keeps what will be asked again?

Question: replaying a trace through kvtier's own ``KVManager`` (host tier only, no model),
what fraction of the chunks requests ask for is found as a cached prefix, per eviction
policy, at host sizes of 5, 10, 20 and 40 % of the trace's working set (its distinct
storable chunks), against Belady's optimum on the same accesses and admissions? Goals:
S3-FIFO's hit rate at least 1.1x LRU's at 10 % (``s3fifo_hit_vs_lru``), and the best
policy within 0.9 of Belady's (``best_vs_belady``), both on the conversation trace.

Traces (``kvbench.eviction_traces``): the Mooncake conversation trace (``--requests``
first requests) and a synthesised, seeded long-document trace (``--doc-requests``
questions over ``--documents`` documents of 16K to 64K tokens, Zipf popularity). Each
512-token trace block is one chunk of a tiny layout (one token of one layer, one head,
one dim), so the replay measures the policies and the manager's bookkeeping, not copies.

Per request, as the engine does at admission: ``lookup`` the longest cached prefix over
every block the prompt spans (a hit counts ``hit_chunks``), read those chunks from host (a
use, for the policy), then ``store`` the whole blocks after the prefix (held ones are left
as they are; new ones may evict). kvtier seals and stores whole chunks only, so a
request's partial last block (the trace's ``input_length`` is not a multiple of 512; in
the long-document trace, the question) is asked but never stored: it stays in the
denominator and hits only where the same id was stored whole (never, in these traces).
The working set counts storable blocks only. Hit rate = prefix hit chunks / chunks asked.
Belady (MIN, demand: every miss on a whole block is brought in, a partial one brings
nothing in, the block used again furthest ahead leaves) runs offline on the same accesses
with the same admissions and capacity in chunks; its hits are prefix hits (see
``belady_hits``). Output blocks a conversation's next turn reuses appear there as new
blocks (the trace lists them in the next request), so the replay stores inputs only.

Results from before this store rule (``docs/results/eviction.json`` of 94011bd) stored
every block, partial ones included, and sized the host on every distinct block: one
never-reused block per request that kvtier would not store, crowding the policies that
admit everything into their recency order.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from kvbench.common import base_parser, finish, fmt, header, ratio
from kvbench.eviction_traces import (
    Trace,
    belady_hits,
    conversation_trace,
    long_document_trace,
    working_set_chunks,
)
from kvtier.config import HostConfig, ManagerConfig
from kvtier.kv import Chunk, KVLayout
from kvtier.manager import KVManager
from kvtier.policy import EVICTION_POLICIES

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, chunk_tokens=1)
GOAL_S3FIFO_VS_LRU = 1.1
GOAL_BEST_VS_BELADY = 0.9
GOAL_SIZE_PCT = 10


def replay(trace: Trace, capacity_chunks: int, policy: str) -> dict[str, Any]:
    """Hit rate of ``policy`` on ``trace`` through a fresh host-only ``KVManager``."""
    config = ManagerConfig(
        chunk_tokens=LAYOUT.chunk_tokens,
        host=HostConfig(
            capacity_bytes=capacity_chunks * LAYOUT.chunk_nbytes,
            pin_memory=False,
            eviction_policy=policy,
        ),
    )
    data = torch.zeros(LAYOUT.chunk_shape)
    outs = [LAYOUT.empty_chunk() for _ in range(max(len(r.blocks) for r in trace))]
    hit_chunks = asked_chunks = 0
    start = time.perf_counter()
    with KVManager(LAYOUT, "bench-eviction", config) as manager:
        for blocks, whole_blocks in trace:
            ids = np.asarray(blocks, dtype=np.int64)
            hit = manager.lookup(ids)
            num_hit = len(hit.refs)
            if num_hit:
                manager.host.get_into(hit.refs, outs[:num_hit])
            refs = manager.refs_for(ids[:whole_blocks])  # a partial tail is never stored
            manager.store([Chunk(ref, data) for ref in refs[num_hit:]])
            hit_chunks += num_hit
            asked_chunks += len(blocks)
        evictions = manager.host.stats().evictions
    return {
        "hit_rate": hit_chunks / asked_chunks,
        "hit_chunks": hit_chunks,
        "evictions": evictions,
        "seconds": time.perf_counter() - start,
    }


def run_trace(name: str, trace: Trace, sizes_pct: list[int], policies: list[str]) -> dict:
    """Every policy and Belady at every host size on one trace, with a table printed."""
    working_set = working_set_chunks(trace)
    asked = sum(len(r.blocks) for r in trace)
    print(f"\n{name}: {len(trace)} requests, {asked} chunks asked, working set {working_set}")
    print(f"{'host %':>7}{'chunks':>8}" + "".join(f"{p:>14}" for p in policies) + f"{'belady':>9}")
    sizes: dict[str, Any] = {}
    for pct in sizes_pct:
        capacity = max(1, working_set * pct // 100)
        runs = {p: replay(trace, capacity, p) for p in policies}
        belady = belady_hits(trace, capacity) / asked
        rates = {p: r["hit_rate"] for p, r in runs.items()}
        best = max(rates, key=lambda p: rates[p])
        sizes[str(pct)] = {
            "capacity_chunks": capacity,
            "belady_hit_rate": belady,
            "policies": runs,
            "best_policy": best,
            "best_vs_belady": ratio(rates[best], belady),
            "s3fifo_hit_vs_lru": ratio(rates.get("s3fifo"), rates.get("lru")),
        }
        cells = "".join(f"{rates[p]:>14.4f}" for p in policies)
        print(f"{pct:>7}{capacity:>8}{cells}{belady:>9.4f}")
    return {
        "requests": len(trace),
        "asked_chunks": asked,
        "working_set_chunks": working_set,
        "sizes": sizes,
    }


def summarise(traces: dict[str, Any]) -> dict[str, Any]:
    """The goal keys (conversation trace at 10 %) and the same figures per trace and size."""
    summary: dict[str, Any] = {}
    for name, trace in traces.items():
        sizes = trace["sizes"]
        prefix = "" if name == "conversation" else f"{name}_"
        at_goal = sizes.get(str(GOAL_SIZE_PCT), {})
        summary[f"{prefix}s3fifo_hit_vs_lru"] = at_goal.get("s3fifo_hit_vs_lru")
        summary[f"{prefix}best_vs_belady"] = at_goal.get("best_vs_belady")
        summary[f"{prefix}best_policy"] = at_goal.get("best_policy")
        for key in ("s3fifo_hit_vs_lru", "best_vs_belady", "best_policy"):
            summary[f"{prefix}{key}_by_size_pct"] = {pct: s[key] for pct, s in sizes.items()}
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = base_parser("eviction", __doc__)
    parser.sized("--requests", 12031, 500, "conversation-trace requests replayed", type=int)
    parser.sized("--doc-requests", 2000, 120, "long-document questions", type=int)
    parser.add_argument("--documents", type=int, default=50, minimum=1, help="documents")
    parser.add_argument("--zipf", type=float, default=0.8, help="document popularity exponent")
    parser.add_argument(
        "--sizes-pct",
        type=int,
        nargs="+",
        default=[5, 10, 20, 40],
        minimum=1,
        help="host sizes, percent of each trace's working set",
    )
    parser.add_argument(
        "--policies",
        nargs="+",
        default=sorted(EVICTION_POLICIES),
        choices=sorted(EVICTION_POLICIES),
        help="eviction policies to replay",
    )
    args = parser.parse(argv)
    torch.set_num_threads(1)
    info = header()
    traces = {
        "conversation": run_trace(
            "conversation", conversation_trace(args.requests), args.sizes_pct, args.policies
        ),
        "long_document": run_trace(
            "long_document",
            long_document_trace(args.doc_requests, args.documents, args.zipf, args.seed),
            args.sizes_pct,
            args.policies,
        ),
    }
    summary = summarise(traces)
    result = {
        "traces": traces,
        "summary": summary,
        "args": {k: v for k, v in vars(args).items() if k != "json"},
    }
    s3, best = summary["s3fifo_hit_vs_lru"], summary["best_vs_belady"]
    doc_s3 = summary["long_document_s3fifo_hit_vs_lru"]
    doc_best = summary["long_document_best_vs_belady"]
    finish(
        args.json,
        result,
        info,
        f"summary: at host = {GOAL_SIZE_PCT}% of the conversation working set, S3-FIFO hits "
        f"{fmt(s3, '.3f')}x LRU (goal >= {GOAL_S3FIFO_VS_LRU}) and the best policy "
        f"({summary['best_policy']}) reaches {fmt(best, '.3f')} of Belady's hit rate "
        f"(goal >= {GOAL_BEST_VS_BELADY}); long documents: {fmt(doc_s3, '.3f')}x LRU, "
        f"{fmt(doc_best, '.3f')} of Belady ({summary['long_document_best_policy']})",
    )
    return 0
