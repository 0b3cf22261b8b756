"""``kvtier bench eviction``: the traces, Belady's MIN and the replay through the manager."""

from __future__ import annotations

from kvbench.eviction import replay, summarise
from kvbench.eviction_traces import belady_hits, long_document_trace, working_set_chunks


def test_belady_evicts_the_block_used_furthest_ahead() -> None:
    trace = [(1, 2), (3,), (1,), (2,), (3,)]
    # Accesses 1 2 3 1 2 3, room for 2: at 3 evict 2 (used after 1) -> {1, 3}; 1 hits;
    # 2 misses and evicts 1 (never used again) -> {3, 2}; 3 hits.
    assert belady_hits(trace, 2) == 2
    assert belady_hits(trace, 3) == 3
    assert belady_hits(trace, 0) == 0


def test_long_document_trace_is_seeded_and_prefix_shaped() -> None:
    first = long_document_trace(40, 5, 0.8, seed=3)
    assert first == long_document_trace(40, 5, 0.8, seed=3)
    assert first != long_document_trace(40, 5, 0.8, seed=4)
    questions = [request[-1] for request in first]
    assert len(set(questions)) == 40  # each question is a block of its own
    assert all(request[0] == 0 for request in first)  # the shared system block
    documents = {request[1:-1] for request in first}
    assert len(documents) <= 5 and all(32 <= len(d) <= 128 for d in documents)
    assert working_set_chunks(first) == 1 + sum(map(len, documents)) + 40


def test_replay_counts_prefix_hits_through_the_manager() -> None:
    trace = [(1, 2, 3), (1, 2, 4), (1, 2, 3), (5, 6, 7, 8, 9)]
    roomy = replay(trace, 20, "lru")
    assert roomy["hit_chunks"] == 2 + 3 and roomy["evictions"] == 0
    assert roomy["hit_rate"] == 5 / 14
    tight = replay(trace, 3, "lru")  # (1,2,4) evicts 3, so the third request hits 1, 2 only
    assert tight["hit_chunks"] == 2 + 2
    assert belady_hits(trace, 20) == roomy["hit_chunks"]


def test_summary_keys_come_from_the_ten_percent_size() -> None:
    sizes = {
        "10": {"s3fifo_hit_vs_lru": 1.2, "best_vs_belady": 0.8, "best_policy": "s3fifo"},
        "20": {"s3fifo_hit_vs_lru": 1.0, "best_vs_belady": 0.9, "best_policy": "lru"},
    }
    summary = summarise({"conversation": {"sizes": sizes}, "long_document": {"sizes": sizes}})
    assert summary["s3fifo_hit_vs_lru"] == 1.2 and summary["best_policy"] == "s3fifo"
    assert summary["long_document_best_vs_belady"] == 0.8
    assert summary["best_vs_belady_by_size_pct"] == {"10": 0.8, "20": 0.9}
