"""``kvtier bench eviction``: the traces, Belady's MIN and the replay through the manager."""

from __future__ import annotations

from kvbench.eviction import replay, summarise
from kvbench.eviction_traces import (
    Request,
    Trace,
    belady_hits,
    long_document_trace,
    working_set_chunks,
)


def whole(*requests: tuple[int, ...]) -> Trace:
    """A trace whose every block is whole (stored)."""
    return [Request(blocks, len(blocks)) for blocks in requests]


def test_belady_evicts_the_block_used_furthest_ahead() -> None:
    trace = whole((1, 2), (3,), (1,), (2,), (3,))
    # Accesses 1 2 3 1 2 3, room for 2: at 3 evict 2 (used after 1) -> {1, 3}; 1 hits;
    # 2 misses and evicts 1 (never used again) -> {3, 2}; 3 hits.
    assert belady_hits(trace, 2) == 2
    assert belady_hits(trace, 3) == 3
    assert belady_hits(trace, 0) == 0


def test_belady_never_stores_a_partial_block() -> None:
    # Requests (1 2 p), (1 3 q), (1 2 p), (1 3 q): p and q are partial tails (the same
    # prompt asked twice), so they are asked, never stored, never hit and take no room.
    trace = [Request((1, 2, 10), 2), Request((1, 3, 11), 2)] * 2
    # Whole-block accesses 1 2 1 3 1 2 1 3, room for 2: {1,2}; 1 hits; 3 evicts 2 (next
    # use 5, vs 1's 4) -> {1,3}; 1 hits; 2 evicts 3 (next use 7, vs 1's 6) -> {1,2}; 1 hits;
    # 3 misses. Hits: 3, all on block 1.
    assert belady_hits(trace, 2) == 3
    assert belady_hits(trace, 8) == 3 + 1 + 1  # roomy: 1 thrice, 2 and 3 once, never p, q
    # Stored as whole blocks (the replay before the store rule), p and q hit too.
    assert belady_hits(whole(*(r.blocks for r in trace)), 8) == 5 + 2
    # A partial access to a block held as whole hits, and brings in nothing when missed.
    assert belady_hits([Request((5, 6), 2), Request((5, 6), 1)], 2) == 2
    assert belady_hits([Request((5, 6), 1), Request((5, 6), 1)], 2) == 1


def test_long_document_trace_is_seeded_and_prefix_shaped() -> None:
    first = long_document_trace(40, 5, 0.8, seed=3)
    assert first == long_document_trace(40, 5, 0.8, seed=3)
    assert first != long_document_trace(40, 5, 0.8, seed=4)
    questions = [request.blocks[-1] for request in first]
    assert len(set(questions)) == 40  # each question is a block of its own
    assert all(request.whole_blocks == len(request.blocks) - 1 for request in first)
    assert all(request.blocks[0] == 0 for request in first)  # the shared system block
    documents = {request.blocks[1:-1] for request in first}
    assert len(documents) <= 5 and all(32 <= len(d) <= 128 for d in documents)
    assert working_set_chunks(first) == 1 + sum(map(len, documents))  # questions: partial


def test_replay_counts_prefix_hits_through_the_manager() -> None:
    trace = whole((1, 2, 3), (1, 2, 4), (1, 2, 3), (5, 6, 7, 8, 9))
    roomy = replay(trace, 20, "lru")
    assert roomy["hit_chunks"] == 2 + 3 and roomy["evictions"] == 0
    assert roomy["hit_rate"] == 5 / 14
    tight = replay(trace, 3, "lru")  # (1,2,4) evicts 3, so the third request hits 1, 2 only
    assert tight["hit_chunks"] == 2 + 2
    assert belady_hits(trace, 20) == roomy["hit_chunks"]


def test_replay_asks_for_a_partial_tail_but_never_stores_it() -> None:
    trace = [Request((1, 2, 3), 2), Request((1, 2, 3), 2), Request((1, 2, 3, 4), 4)]
    run = replay(trace, 3, "lru")
    # 3 is never stored: 1 2 hit in the second and third requests; 3 of the third misses.
    assert run["hit_chunks"] == 2 + 2 and run["hit_rate"] == 4 / 10
    assert run["evictions"] == 1  # the third stores 3 and 4 into 3 slots holding 1, 2
    assert belady_hits(trace, 3) == run["hit_chunks"]
    for policy in ("fifo", "s3fifo", "arc", "lru+prefix"):
        assert replay(trace, 3, policy)["hit_chunks"] <= belady_hits(trace, 3)


def test_summary_keys_come_from_the_ten_percent_size() -> None:
    sizes = {
        "10": {"s3fifo_hit_vs_lru": 1.2, "best_vs_belady": 0.8, "best_policy": "s3fifo"},
        "20": {"s3fifo_hit_vs_lru": 1.0, "best_vs_belady": 0.9, "best_policy": "lru"},
    }
    summary = summarise({"conversation": {"sizes": sizes}, "long_document": {"sizes": sizes}})
    assert summary["s3fifo_hit_vs_lru"] == 1.2 and summary["best_policy"] == "s3fifo"
    assert summary["long_document_best_vs_belady"] == 0.8
    assert summary["best_vs_belady_by_size_pct"] == {"10": 0.8, "20": 0.9}
