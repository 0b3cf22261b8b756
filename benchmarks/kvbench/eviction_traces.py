"""The access sequences of ``kvtier bench eviction`` and Belady's optimum over them.

Contract: pure functions of their arguments (and the trace file); the same seed gives the
same sequence. A trace here is a list of requests, each the tuple of its block ids in
prompt order; a block is one chunk, and equal leading ids mean an equal prefix (as in the
Mooncake traces, where a hash id names a 512-token block after its whole prefix).

- ``conversation_trace``: the Mooncake conversation trace as it is (its first
  ``num_requests`` requests, in arrival order).
- ``long_document_trace``: synthesised, seeded. ``num_documents`` documents of 32 to 128
  blocks each (16K to 64K tokens at 512 a block) behind one shared system-prompt block;
  each request asks one question about one document, drawn Zipf (exponent
  ``zipf_exponent``) over the documents in a seeded shuffled order, so a few documents are
  asked about often and most rarely; the question is one block of its own (never reused).
"""

from __future__ import annotations

import heapq
from pathlib import Path

import numpy as np

from kvbench.trace import DEFAULT_TRACE, load_trace

Trace = list[tuple[int, ...]]

DOC_BLOCKS_RANGE = (32, 128)  # blocks per document, inclusive


def conversation_trace(num_requests: int, path: Path = DEFAULT_TRACE) -> Trace:
    """The first ``num_requests`` requests of a Mooncake-format trace, as block ids."""
    return [r.hash_ids for r in load_trace(path)[:num_requests]]


def long_document_trace(
    num_requests: int, num_documents: int, zipf_exponent: float, seed: int
) -> Trace:
    """Questions over long documents (see the module docstring)."""
    rng = np.random.default_rng(seed)
    system_block = 0
    next_block = 1
    documents: list[tuple[int, ...]] = []
    for _ in range(num_documents):
        length = int(rng.integers(DOC_BLOCKS_RANGE[0], DOC_BLOCKS_RANGE[1] + 1))
        documents.append(tuple(range(next_block, next_block + length)))
        next_block += length
    weights = 1.0 / np.arange(1, num_documents + 1) ** zipf_exponent
    popularity = rng.permutation(num_documents)  # which document has which rank
    picks = rng.choice(num_documents, size=num_requests, p=weights / weights.sum())
    trace: Trace = []
    for rank in picks:
        question = next_block
        next_block += 1
        trace.append((system_block, *documents[popularity[rank]], question))
    return trace


def working_set_chunks(trace: Trace) -> int:
    """Distinct blocks (chunks) the trace asks for."""
    return len({block for request in trace for block in request})


def belady_hits(trace: Trace, capacity_chunks: int) -> int:
    """Hits of Belady's MIN on the trace's block accesses (every block of every request in
    order) with room for ``capacity_chunks``: a miss always brings its block in (as kvtier
    stores every chunk it computes), evicting the held block used again furthest ahead
    (never-again first). A block evicted and asked again is a miss and comes back.

    Under MIN a block's parent is always held while the block is (the parent is used again
    no later), so every hit is a prefix hit: the count compares with kvtier's prefix hits.
    O(accesses * log(capacity)).
    """
    accesses = [block for request in trace for block in request]
    never = len(accesses)
    next_use = [never] * len(accesses)
    seen: dict[int, int] = {}
    for i in range(len(accesses) - 1, -1, -1):
        next_use[i] = seen.get(accesses[i], never)
        seen[accesses[i]] = i
    held: dict[int, int] = {}  # block -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, block); stale entries skipped
    hits = 0
    for i, block in enumerate(accesses):
        if block in held:
            hits += 1
        elif capacity_chunks and len(held) >= capacity_chunks:
            while True:
                far, victim = heapq.heappop(heap)
                if held.get(victim) == -far:
                    del held[victim]
                    break
        if capacity_chunks > 0:
            held[block] = next_use[i]
            heapq.heappush(heap, (-next_use[i], block))
    return hits
