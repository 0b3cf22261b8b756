"""Reuse of a cached prefix: whole chunks from any tier, then whole pages of a partial one.

A prompt's prefix is adopted in two parts::

    part            unit              key                               where it goes
    whole chunks    chunk_tokens      chain of H(parent, ids)           the device arena
    partial chunk   page_tokens each  H(parent, "partial", ids[:p])     the tail

A partial chunk is the first ``p`` tokens (whole pages) after a sealed chunk, stored in a
whole chunk's buffer, so the lower tiers still move whole chunks. A sequence stores one
with ``seal_pages`` (the engine does when a prompt's prefill completes and when a request
ends); ``adopt_pages`` probes what could hold the pages after the adopted chunks — the next
whole chunk when the prompt holds all its tokens (a prompt of whole chunks re-sent), then
the partial page counts, longest first — and copies the first hit's pages into the tail.
Token ids are compared on every hit, so reuse stays exact; a prefix hit then recomputes
fewer than ``page_tokens`` tokens.

Storage faults cost recompute, never an error: lower-tier chunks are promoted to host
first (blocking), and only the leading run that host then holds is adopted; the chunks
lost are counted in the manager's ``recomputed_chunks_by_cause``.

The functions mutate the sequence they are given (a ``PrefixTarget``, such as
``SequenceKV``: state, arena, tail) and the tiers (promotions, pins released before they
return); same thread as its forwards.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch

from kvtier.config import TieredCacheConfig
from kvtier.kv.chunk import Chunk, ChunkRef
from kvtier.kv.layout import KVLayout
from kvtier.manager import KVManager, LookupResult
from kvtier.runtime.arena import DeviceArena
from kvtier.runtime.plan import ForwardPlan
from kvtier.runtime.state import SequenceState
from kvtier.tiers.pool import PoolTier


class PrefixTarget(Protocol):
    """What reuse reads and mutates of a sequence's KV (``kvtier.runtime.SequenceKV`` is
    one): its state, device arena and tail, the host tier and manager it shares, and the
    pass it has open (``plan``; reuse runs only between passes)."""

    manager: KVManager
    config: TieredCacheConfig
    layout: KVLayout
    host: PoolTier
    arena: DeviceArena
    state: SequenceState
    plan: ForwardPlan | None
    pages_tier: str | None

    def prefix_limit(self, num_tokens: int) -> int:
        """Most tokens of a ``num_tokens`` prompt a prefix may cover (one is computed)."""
        ...

    def start_batch(self, rows: int) -> None:
        """Size the arena for ``rows``; an empty state starts the batch."""
        ...


def adopt_chunks(kv: PrefixTarget, ids: torch.Tensor, salt: str, match: LookupResult | None) -> int:
    """Adopt the whole cached chunks of ``ids [B, S]`` (shared by every row); returns the
    tokens adopted. ``match``: a caller's lookup of the one row's prefix."""
    limit = kv.prefix_limit(ids.shape[1])
    if match is not None and (ids.shape[0] != 1 or match.hit_tokens > limit):
        raise ValueError("match: a lookup of one row's prefix (at most prefix_limit tokens)")
    hits = [match] if match is not None else [kv.manager.lookup(r[:limit], salt) for r in ids]
    hit_chunks = min(len(h.refs) for h in hits)
    if hit_chunks == 0:
        return 0
    refs = [h.refs[:hit_chunks] for h in hits]
    kv.host.count_reads(sum(h.by_tier.get("host", 0) for h in hits), 0)
    # Promote to host, then adopt only the leading run that host now holds (pinned until
    # it is on the device): from a chunk found corrupt or gone on, the prefix is
    # recomputed. Corrupt chunks are counted where they are found (the promotion).
    held: list[ChunkRef] = []
    adopted = hit_chunks
    try:
        for row_refs in refs:
            outcomes = kv.manager.promote(row_refs[:adopted])
            pinned = kv.host.pin(row_refs[:adopted])
            held += [r for r, ok in zip(row_refs, pinned, strict=False) if ok]
            gone = [not ok and o != "corrupt" for o, ok in zip(outcomes, pinned, strict=True)]
            if any(gone):
                kv.manager.count_recompute("missing", sum(gone))
            adopted = next((i for i, ok in enumerate(pinned) if not ok), adopted)
        if adopted == 0:
            return 0
        kv.start_batch(ids.shape[0])
        return _adopt_pinned(kv, ids, [r[:adopted] for r in refs])
    finally:
        kv.host.unpin(held)


def _adopt_pinned(kv: PrefixTarget, ids: torch.Tensor, refs: list[list[ChunkRef]]) -> int:
    """Adopt ``refs`` per row (pinned in host by the caller) after the sealed chunks and
    place them on the device by the arena's rules; returns the tokens adopted."""
    base = kv.state.sealed_chunks
    hit = kv.state.adopt(refs, ids, kv.layout.chunk_tokens)
    placed: list[tuple[int, int, Chunk]] = []
    for row, row_refs in enumerate(refs):
        for j, ref in enumerate(row_refs):
            view = kv.host.view(ref)  # pinned: held until placed
            if view is not None:
                placed.append((row, base + j, Chunk(ref, view)))
    kv.arena.place(placed, kv.state.refs)
    return hit


def adopt_loaded(kv: PrefixTarget, ids: torch.Tensor, refs: list[ChunkRef]) -> int:
    """After the sealed chunks of one row, adopt the leading run of ``refs`` that host
    holds now (no promotion: this never waits on a lower tier); returns its tokens.

    ``refs`` continue the row's chain over ``ids [1, S]`` (the prompt, computed part
    included): the first one's key is checked against the sealed chunks' last, so a wrong
    list adopts nothing. The state must hold whole chunks only (no tail, no pass open).

    Raises:
        ValueError: more chunks than ``prefix_limit`` leaves room for.
    """
    state, size = kv.state, kv.layout.chunk_tokens
    if not refs or state.rows > 1 or state.tail_len or kv.plan is not None:
        return 0
    base = state.sealed_chunks
    if (base + len(refs)) * size > kv.prefix_limit(ids.shape[1]):
        raise ValueError("adopt_loaded: the chunks reach past the prompt's prefix limit")
    parent = state.refs[0][-1].key if base else None
    first = ids[0, base * size : (base + 1) * size].numpy()
    if kv.manager.hasher.key(parent, first, state.salt) != refs[0].key:
        return 0  # not this row's next chunk
    pinned = kv.host.pin(refs)
    try:
        run = next((i for i, ok in enumerate(pinned) if not ok), len(refs))
        if not run:
            return 0
        kv.start_batch(1)
        return _adopt_pinned(kv, ids, [list(refs[:run])])
    finally:
        kv.host.unpin([r for r, ok in zip(refs, pinned, strict=True) if ok])


def _page_limit(num_tokens: int, page: int) -> int:
    """Most tokens of a ``num_tokens`` prompt reusable in whole pages (one is computed)."""
    return ((num_tokens - 1) // page) * page


def _partial_ref(kv: PrefixTarget, ids: torch.Tensor) -> ChunkRef:
    """The ref of a partial chunk holding ``ids [p]`` after the last sealed chunk, under
    the sequence's salt."""
    refs = kv.state.refs[0] if kv.state.refs else []
    parent = refs[-1].key if refs else None
    key = kv.manager.hasher.partial_key(parent, ids.numpy(), kv.state.salt)
    return ChunkRef.of(key, ids, parent)


def _pages_on(kv: PrefixTarget) -> bool:
    page, size = kv.config.page_tokens, kv.layout.chunk_tokens
    return page < size and size % page == 0


def _candidates(
    kv: PrefixTarget, ids: torch.Tensor, base: int, most: int
) -> Iterator[tuple[ChunkRef, int]]:
    """What could hold the pages after ``base``, best first, as ``(ref, tokens)``: the whole
    next chunk when the prompt holds all its tokens (its first pages are exact: attention
    is causal), then partial chunks of ``most``, ``most - page``, … tokens."""
    size, page = kv.layout.chunk_tokens, kv.config.page_tokens
    if base + size <= ids.shape[1]:
        whole = ids[0, base : base + size]
        refs = kv.state.refs[0] if kv.state.refs else []
        parent = refs[-1].key if refs else None
        key = kv.manager.hasher.key(parent, whole.numpy(), kv.state.salt)
        yield ChunkRef.of(key, whole, parent), most
    for tokens in range(most, 0, -page):
        yield _partial_ref(kv, ids[0, base : base + tokens]), tokens


def adopt_pages(kv: PrefixTarget, ids: torch.Tensor) -> int:
    """After the adopted chunks, adopt the longest cached run of whole pages of
    ``ids [1, S]`` into the tail — from the next whole chunk or a partial one; returns its
    tokens (0: none). Probes at most ``T / page`` keys."""
    if not _pages_on(kv):
        return 0
    state, page, size = kv.state, kv.config.page_tokens, kv.layout.chunk_tokens
    base = state.sealed_chunks * size
    if base and state.seq_len != base:
        return 0
    most = min(_page_limit(ids.shape[1], page) - base, size - page)
    if most <= 0 or any(not r.token_ids for r in (state.refs[0] if state.refs else [])):
        return 0  # no whole page to reuse, or a chain of unknown tokens
    for ref, tokens in _candidates(kv, ids, base, most):
        where = kv.manager.locate(ref)
        if where is None:
            continue
        outcome = kv.manager.promote([ref])[0]
        if outcome != "host" or not kv.host.pin([ref])[0]:
            if outcome == "missing":
                kv.manager.count_recompute("missing", 1)
            return 0
        try:
            view = kv.host.view(ref)
            if view is None:
                return 0
            if not state.rows:
                kv.start_batch(1)
            tails = kv.arena.tails
            assert tails is not None
            tails[0, :, :, :, :tokens].copy_(view[:, :, :, :tokens])  # [L, 2, H, p, D]
            state.adopt_tail(ids[:, : base + tokens], tokens)
            kv.pages_tier = where.name
        finally:
            kv.host.unpin([ref])
        return tokens
    return 0


def seal_pages(kv: PrefixTarget, upto: int) -> int:
    """Store the tail's whole pages before position ``upto`` as a partial chunk (one row);
    returns the tokens stored. Nothing is stored when pages are off, the tail holds no
    whole page below ``upto``, a token id is unknown, or host already holds it."""
    state = kv.state
    if not _pages_on(kv) or state.rows != 1 or not state.tail_len:
        return 0
    page, size = kv.config.page_tokens, kv.layout.chunk_tokens
    base = state.sealed_chunks * size
    tokens = (min(upto, state.seq_len) - base) // page * page
    if tokens <= 0 or kv.plan is not None:
        return 0
    ids = state.token_ids[0, base : base + tokens]
    if bool((ids < 0).any()) or any(not r.token_ids for r in state.refs[0]):
        return 0
    ref = _partial_ref(kv, ids)
    if kv.manager.locate(ref) is not None:
        return tokens
    tails = kv.arena.tails
    assert tails is not None
    kv.manager.store([Chunk(ref, tails[0])])  # a whole chunk's buffer; its first pages count
    return tokens
