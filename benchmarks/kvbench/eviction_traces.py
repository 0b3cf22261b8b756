"""The access sequences of ``kvtier bench eviction`` and Belady's optimum over them.

Contract: pure functions of their arguments (and the trace file); the same seed gives the
same sequence. A trace here is a list of ``Request``s: each names every block its prompt
spans, in prompt order, and how many of them (a leading run) are whole 512-token blocks.
A block is one chunk, and equal leading ids mean an equal prefix (as in the Mooncake
traces, where a hash id names a 512-token block after its whole prefix).

Store rule (as kvtier's: only whole chunks are sealed and stored, a partial tail is
recomputed every time): a request asks for all its blocks, but only its whole blocks may
be stored. A partial last block is asked (it counts in the hit rate's denominator, like
the tokens it holds) and never hits unless the same id was stored whole elsewhere.

- ``conversation_trace``: the Mooncake conversation trace as it is (its first
  ``num_requests`` requests, in arrival order); a request's whole blocks are
  ``input_length // 512`` (of its 12031 requests, 22 end on a block boundary; the partial
  last block of the rest is 12009 of its 288500 block accesses, and its id comes back only
  when the same prompt does, 118 times).
- ``long_document_trace``: synthesised, seeded. ``num_documents`` documents of 32 to 128
  blocks each (16K to 64K tokens at 512 a block) behind one shared system-prompt block;
  each request asks one question about one document, drawn Zipf (exponent
  ``zipf_exponent``) over the documents in a seeded shuffled order, so a few documents are
  asked about often and most rarely. The question is one block of its own, never reused,
  and partial: a question is shorter than 512 tokens, so kvtier never stores it (the
  documents are whole blocks by construction).
"""

from __future__ import annotations

import heapq
from pathlib import Path
from typing import NamedTuple

import numpy as np

from kvbench.trace import DEFAULT_TRACE, TRACE_BLOCK_TOKENS, load_trace

DOC_BLOCKS_RANGE = (32, 128)  # blocks per document, inclusive


class Request(NamedTuple):
    """One request: every block of its prompt, and how many lead as whole blocks."""

    blocks: tuple[int, ...]
    whole_blocks: int  # blocks[:whole_blocks] may be stored; the rest (a partial tail) not


Trace = list[Request]


def conversation_trace(num_requests: int, path: Path = DEFAULT_TRACE) -> Trace:
    """The first ``num_requests`` requests of a Mooncake-format trace, as block ids."""
    return [
        Request(r.hash_ids, min(len(r.hash_ids), r.input_length // TRACE_BLOCK_TOKENS))
        for r in load_trace(path)[:num_requests]
    ]


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
        document = documents[popularity[rank]]
        trace.append(Request((system_block, *document, question), 1 + len(document)))
    return trace


def working_set_chunks(trace: Trace) -> int:
    """Distinct blocks (chunks) the trace stores: whole blocks only, as kvtier does."""
    return len({b for request in trace for b in request.blocks[: request.whole_blocks]})


def belady_hits(trace: Trace, capacity_chunks: int) -> int:
    """Hits of Belady's MIN on the trace's block accesses (every block of every request in
    order) with room for ``capacity_chunks``, under the store rule: a miss on a whole block
    always brings it in (demand: kvtier stores every whole chunk it computes, it has no
    bypass), evicting the held block used again furthest ahead (never-again first); a miss
    on a partial block brings nothing in and evicts nothing (kvtier never stores it), and
    an access to a held block hits whether that access is whole or partial. A block evicted
    and asked again is a miss and comes back. With admissions forced, furthest-next-use is
    still optimal (the exchange argument never chooses what enters), so this is the most
    hits any policy can get with the replay's accesses and admissions.

    Under MIN a block's parent is always held while the block is (the parent is asked
    before the block at each of its uses, so it is used again sooner), so every hit is a
    prefix hit: the count compares with kvtier's prefix hits. O(accesses * log(capacity)).
    """
    accesses = [
        (block, i < request.whole_blocks)
        for request in trace
        for i, block in enumerate(request.blocks)
    ]
    never = len(accesses)
    next_use = [never] * len(accesses)
    seen: dict[int, int] = {}
    for i in range(len(accesses) - 1, -1, -1):
        block = accesses[i][0]
        next_use[i] = seen.get(block, never)
        seen[block] = i
    held: dict[int, int] = {}  # block -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, block); stale entries skipped
    hits = 0
    for i, (block, storable) in enumerate(accesses):
        if block in held:
            hits += 1
        elif not storable or capacity_chunks <= 0:
            continue
        elif len(held) >= capacity_chunks:
            while True:
                far, victim = heapq.heappop(heap)
                if held.get(victim) == -far:
                    del held[victim]
                    break
        held[block] = next_use[i]
        heapq.heappush(heap, (-next_use[i], block))
    return hits
