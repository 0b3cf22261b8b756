"""The connector's scheduler side: how many tokens kvtier holds, and each step's plan.

``SchedulerSide`` answers vLLM's scheduler (one lookup across every tier for a new
request's prompt, asked of the worker side, which holds the tiers: ``held_tiers``),
records the blocks vLLM allocates, and turns each scheduler step into a ``StepPlan``: the
chunks to load into a request's new blocks before the forward, and the chunks that the
forward completes, to store after it.

Token ranges of one request (``T`` = chunk tokens, ``bs`` = vLLM's block size)::

    [0, local)          vLLM's own prefix cache hit (block-aligned)
    [local, end)        loaded from kvtier (end <= hit: whole chunks of the prompt, at
                        least one prompt token left to compute)
    [end, computed)     computed by vLLM, stored as each whole chunk completes

Chunks already stored (``saved_chunks``) are not planned again; the worker also skips a
planned chunk that some tier holds. vLLM's ``Request`` objects are read, never written.
Thread-safety: vLLM calls the scheduler side from its one scheduler thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.kv.chunk import ChunkRef, chunk_refs
from kvtier.kv.keys import KeyHasher
from kvtier.vllm.metadata import ChunkLoad, RequestLoad, RequestSave, StepPlan


@dataclass
class _Match:
    """A lookup answered to ``get_num_new_matched_tokens``, kept for the allocation."""

    local_tokens: int
    refs: list[ChunkRef]
    tiers: list[str]


@dataclass
class _Tracked:
    """What the scheduler side keeps of a running request."""

    request: Any  # vLLM's Request: all_token_ids, cache_salt (read only)
    salt: str
    block_ids: list[int] = field(default_factory=list)
    saved_chunks: int = 0
    load: RequestLoad | None = None


def request_salt(request: Any) -> str:
    """The request's ``cache_salt`` as a kvtier tenant salt ("" for none)."""
    return str(getattr(request, "cache_salt", None) or "")


class SchedulerSide:
    """See the module docstring.

    Args:
        hasher: the chunk keys of the worker's tiers (same namespace).
        held_tiers: ``(token_ids, salt)`` → the tier of each leading chunk the worker holds.
        block_size: vLLM's tokens per block (divides the chunk tokens).
        load: whether to load (the connector's role consumes KV).
        save: whether to save (the connector's role produces KV).
    """

    def __init__(
        self,
        hasher: KeyHasher,
        held_tiers: Callable[[Sequence[int], str], list[str]],
        block_size: int,
        load: bool,
        save: bool,
    ) -> None:
        self.hasher = hasher
        self.held_tiers = held_tiers
        self.block_size = block_size
        self.chunk_tokens = hasher.chunk_tokens
        self.blocks_per_chunk = self.chunk_tokens // block_size
        self.load, self.save = load, save
        self._matches: dict[str, _Match] = {}
        self._tracked: dict[str, _Tracked] = {}

    # ---- vLLM's scheduler calls -------------------------------------------------------------

    def matched_tokens(self, request: Any, local_tokens: int) -> int:
        """Tokens past ``local_tokens`` that kvtier holds for ``request``'s prompt (whole
        chunks, one prompt token left to compute); 0 when none. Reads the tiers' indexes
        only (the answer is kept for ``after_alloc``)."""
        prompt = list(request.prompt_token_ids or [])
        limit = self.hasher.namespace.layout.prefix_limit(len(prompt))
        self._matches.pop(request.request_id, None)
        if not self.load or limit <= local_tokens:
            return 0
        salt = request_salt(request)
        tiers = self.held_tiers(prompt[:limit], salt)
        hit_tokens = len(tiers) * self.chunk_tokens
        if hit_tokens <= local_tokens:
            return 0
        refs = chunk_refs(self.hasher, prompt[:hit_tokens], salt)
        self._matches[request.request_id] = _Match(local_tokens, refs, tiers)
        return hit_tokens - local_tokens

    def hit_tiers(self, request: Any, external_tokens: int) -> dict[str, int]:
        """``external_tokens`` split by the tier that held each chunk (a chunk's tokens go
        to its tier; the split sums to ``external_tokens``)."""
        match = self._matches.get(request.request_id)
        if match is None or not external_tokens:
            return {}
        split: dict[str, int] = {}
        start, end = match.local_tokens, match.local_tokens + external_tokens
        for i, tier in enumerate(match.tiers):
            lo, hi = max(start, i * self.chunk_tokens), min(end, (i + 1) * self.chunk_tokens)
            if hi > lo:
                split[tier] = split.get(tier, 0) + hi - lo
        return split

    def after_alloc(self, request: Any, block_ids: Sequence[int], external_tokens: int) -> None:
        """vLLM allocated ``block_ids`` (the request's whole table so far) and will take
        ``external_tokens`` from kvtier: track the request, and plan its load."""
        tracked = self._tracked.get(request.request_id)
        if tracked is None:
            tracked = _Tracked(request, request_salt(request))
            self._tracked[request.request_id] = tracked
        tracked.block_ids = list(block_ids)
        match = self._matches.get(request.request_id)
        if external_tokens <= 0 or match is None:
            return
        end = match.local_tokens + external_tokens
        tracked.load = self._plan_load(request.request_id, match, end, block_ids)
        tracked.saved_chunks = max(tracked.saved_chunks, end // self.chunk_tokens)

    def build(self, scheduler_output: Any) -> StepPlan:
        """This step's plan (resets the loads it hands over)."""
        plan = StepPlan()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:  # block_ids: the whole table
            self._step(
                plan, new.req_id, new.block_ids[0], True, new.num_computed_tokens,
                scheduled.get(new.req_id, 0),
            )  # fmt: skip
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_blocks = cached.new_block_ids[i]
            self._step(
                plan,
                req_id,
                new_blocks[0] if new_blocks is not None else [],
                req_id in cached.resumed_req_ids,
                cached.num_computed_tokens[i],
                scheduled.get(req_id, 0),
            )
        return plan

    def finished(self, request: Any) -> None:
        """The request ended: forget it (its chunks stay in the tiers)."""
        self._tracked.pop(request.request_id, None)
        self._matches.pop(request.request_id, None)

    # ---- internals ------------------------------------------------------------------------

    def _plan_load(
        self, request_id: str, match: _Match, end: int, block_ids: Sequence[int]
    ) -> RequestLoad:
        """Chunks covering tokens ``[local, end)``, each with the blocks it fills."""
        bs, n, size = self.block_size, self.blocks_per_chunk, self.chunk_tokens
        first_block, last_block = match.local_tokens // bs, -(-end // bs)
        chunks = []
        for c in range(match.local_tokens // size, -(-end // size)):
            lo, hi = max(first_block, c * n), min(last_block, (c + 1) * n)
            chunks.append(ChunkLoad(match.refs[c], tuple(block_ids[lo:hi]), lo - c * n))
        return RequestLoad(request_id, tuple(chunks))

    def _step(
        self,
        plan: StepPlan,
        req_id: str,
        new_block_ids: Sequence[int],
        whole_table: bool,
        computed_tokens: int,
        scheduled_tokens: int,
    ) -> None:
        tracked = self._tracked.get(req_id)
        if tracked is None:
            return  # not allocated through after_alloc: nothing known to save
        if whole_table:  # a new request, or one resumed after preemption
            tracked.block_ids = list(new_block_ids)
        else:
            tracked.block_ids += list(new_block_ids)
        if tracked.load is not None:
            plan.loads.append(tracked.load)
            tracked.load = None
        if not self.save:
            return
        tokens = tracked.request.all_token_ids
        done = min(computed_tokens + scheduled_tokens, len(tokens)) // self.chunk_tokens
        done = min(done, len(tracked.block_ids) // self.blocks_per_chunk)
        if done <= tracked.saved_chunks:
            return
        n = self.blocks_per_chunk
        plan.saves.append(
            RequestSave(
                req_id,
                tuple(tokens[: done * self.chunk_tokens]),
                tracked.salt,
                tracked.saved_chunks,
                tuple(tracked.block_ids[tracked.saved_chunks * n : done * n]),
            )
        )
        tracked.saved_chunks = done
