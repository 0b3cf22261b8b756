"""Contract tests: every tier (device, host, disk, the shared Redis one) × every eviction
policy (where the tier has slots of its own)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.kv import Chunk, ChunkRef, KVLayout
from kvtier.kv.chunk import chunk_refs
from kvtier.kv.keys import KeyHasher, Namespace
from kvtier.policy import EVICTION_POLICIES
from kvtier.tiers import TierFullError
from tests.conftest import make_chunks, run_in_threads
from tests.tiers.conftest import TierFactory, needs_slots


def test_round_trip_is_bit_exact(tier_factory: TierFactory, layout: KVLayout) -> None:
    tier = tier_factory(4)
    chunks = make_chunks(layout, 3)
    assert len(tier.put(chunks).stored) == 3
    outs = [layout.empty_chunk() for _ in chunks]
    assert tier.get_into([c.ref for c in chunks], outs) == [True] * 3
    for chunk, out in zip(chunks, outs, strict=True):
        assert torch.equal(out.view(torch.uint8), chunk.data.view(torch.uint8))
    stats = tier.stats()
    assert (stats.puts, stats.hits, stats.bytes_out) == (3, 3, 3 * layout.chunk_nbytes)


def test_miss_and_token_mismatch_leave_buffer_untouched(
    tier_factory: TierFactory, layout: KVLayout
) -> None:
    tier = tier_factory(2)
    (chunk,) = make_chunks(layout, 1)
    tier.put([chunk])
    wrong = ChunkRef(chunk.key, (7,) * layout.chunk_tokens)
    out = torch.full(layout.chunk_shape, 3.0)
    assert tier.get_into([wrong], [out]) == [False]
    assert not tier.contains(wrong)
    assert torch.all(out == 3.0)
    assert tier.stats().collisions >= 1


def test_read_says_why_a_chunk_missed(tier_factory: TierFactory, layout: KVLayout) -> None:
    tier = tier_factory(2)
    held, never = make_chunks(layout, 2)
    tier.put([held])
    out = layout.empty_chunk()
    assert tier.read(held.ref, out) == "ok" and torch.equal(out, held.data)
    assert tier.read(never.ref, out) == "missing"
    assert tier.read(ChunkRef(held.key, (7,) * layout.chunk_tokens), out) == "missing"
    assert torch.equal(out, held.data)  # misses leave the buffer as it was


def test_duplicate_put_is_a_no_op(tier_factory: TierFactory, layout: KVLayout) -> None:
    tier = tier_factory(2)
    (chunk,) = make_chunks(layout, 1)
    tier.put([chunk])
    result = tier.put([chunk])
    assert result.already_present == [chunk.key] and not result.stored
    assert len(tier) == 1


@pytest.mark.parametrize("policy", sorted(EVICTION_POLICIES))
def test_pinned_chunks_are_never_evicted(
    tier_factory: TierFactory, layout: KVLayout, policy: str
) -> None:
    tier = tier_factory(2, policy)
    needs_slots(tier)
    chunks = make_chunks(layout, 5)
    tier.put(chunks[:2])
    assert tier.pin([chunks[0].ref]) == [True]
    tier.put(chunks[2:4])  # each put evicts the one unpinned slot
    assert tier.contains(chunks[0].ref)
    assert tier.used_bytes <= tier.capacity_bytes
    tier.pin([chunks[3].ref])
    with pytest.raises(TierFullError, match="pinned"):
        tier.put([chunks[4]])
    assert tier.contains(chunks[0].ref) and tier.contains(chunks[3].ref)
    tier.unpin([chunks[0].ref, chunks[3].ref])
    tier.put([chunks[4]])
    assert tier.contains(chunks[4].ref)


def test_lru_evicts_least_recently_used(tier_factory: TierFactory, layout: KVLayout) -> None:
    tier = tier_factory(2)
    needs_slots(tier)
    a, b, c = make_chunks(layout, 3)
    tier.put([a, b])
    tier.get_into([a.ref], [layout.empty_chunk()])
    result = tier.put([c])
    assert result.evicted == [b.ref]
    assert tier.contains(a.ref) and not tier.contains(b.ref)


def test_evict_hook_sees_victim_data(tier_factory: TierFactory, layout: KVLayout) -> None:
    tier = tier_factory(1)
    needs_slots(tier)
    a, b = make_chunks(layout, 2)
    seen: list[tuple[ChunkRef, torch.Tensor]] = []
    tier.set_evict_hook(lambda victim: seen.append((victim.ref, victim.data.clone())))
    tier.put([a, b])
    assert [ref for ref, _ in seen] == [a.ref]
    assert torch.equal(seen[0][1], a.data)


def test_zero_capacity_tier_refuses_puts(tier_factory: TierFactory, layout: KVLayout) -> None:
    try:
        tier = tier_factory(0)
        needs_slots(tier)
    except ValueError as exc:  # a durable tier refuses to start without room for a chunk
        assert "disk.capacity_bytes (--disk-mb)" in str(exc)
        assert f"at least {layout.chunk_nbytes} bytes" in str(exc)
        return
    with pytest.raises(TierFullError):
        tier.put(make_chunks(layout, 1))


def test_concurrent_puts_and_gets_lose_nothing(tier_factory: TierFactory, layout: KVLayout) -> None:
    tier = tier_factory(64)
    per_thread = 8
    chunk_sets = [make_chunks(layout, per_thread, seed=100 + t) for t in range(4)]

    def worker(chunks: list[Chunk]) -> None:
        out = layout.empty_chunk()
        for chunk in chunks:
            tier.put([chunk])
            assert tier.get_into([chunk.ref], [out]) == [True]
            assert torch.equal(out, chunk.data)

    run_in_threads(worker, chunk_sets)
    assert len(tier) == 4 * per_thread
    out = layout.empty_chunk()
    for chunks in chunk_sets:
        for chunk in chunks:
            assert tier.get_into([chunk.ref], [out]) == [True]
            assert torch.equal(out, chunk.data)


OPS = st.lists(
    st.tuples(st.sampled_from(["put", "get", "pin", "unpin", "remove"]), st.integers(0, 7)),
    min_size=1,
    max_size=40,
)


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ops=OPS, num_slots=st.integers(1, 4))
def test_random_operations_keep_every_invariant(
    tier_factory: TierFactory, layout: KVLayout, ops: list[tuple[str, int]], num_slots: int
) -> None:
    """Budgets are never exceeded, pinned chunks stay, hits are bit-exact."""
    tier = tier_factory(num_slots)
    needs_slots(tier)
    chunks = make_chunks(layout, 8, seed=7)
    pins = [0] * 8
    out = layout.empty_chunk()
    for op, i in ops:
        chunk = chunks[i]
        if op == "put":
            held_before = [j for j in range(8) if pins[j]]
            try:
                tier.put([chunk])
            except TierFullError:
                # Only legal when every slot is held by a pinned chunk.
                assert len(held_before) >= num_slots
        elif op == "get":
            if tier.get_into([chunk.ref], [out])[0]:
                assert torch.equal(out, chunk.data)
        elif op == "pin":
            if tier.pin([chunk.ref])[0]:
                pins[i] += 1
        elif op == "unpin" and pins[i]:
            tier.unpin([chunk.ref])
            pins[i] -= 1
        elif op == "remove":
            tier.remove([chunk.ref])
        assert tier.used_bytes <= tier.capacity_bytes
        for j in range(8):
            if pins[j]:
                assert tier.contains(chunks[j].ref)


def sequences_with_parents(layout: KVLayout, count: int, length: int) -> list[list[Chunk]]:
    """``count`` sequences of ``length`` chunks each, refs carrying their parent key."""
    hasher = KeyHasher(Namespace("test-model", layout))
    out = []
    for seq in range(count):
        ids = np.full(length * layout.chunk_tokens, seq, dtype=np.int64)
        ids += np.arange(ids.size) // layout.chunk_tokens * 1000
        refs = chunk_refs(hasher, ids)
        out.append([Chunk(r, torch.full(layout.chunk_shape, float(seq))) for r in refs])
    return out


@pytest.mark.parametrize("policy", sorted(EVICTION_POLICIES))
def test_every_policy_keeps_budget_pins_and_data(
    tier_factory: TierFactory, layout: KVLayout, policy: str
) -> None:
    """Seeded puts, reads, pins and removes of whole sequences: the budget holds, pinned
    chunks stay, hits are bit-exact, and the tier keeps making room while leaves are
    pinned (the prefix rule gives way rather than refuse a put)."""
    tier = tier_factory(5, policy)
    needs_slots(tier)
    rng = random.Random(3)
    seqs = sequences_with_parents(layout, 6, 3)
    out = layout.empty_chunk()
    pinned: list[Chunk] = []
    for _ in range(120):
        seq = rng.choice(seqs)
        op = rng.random()
        if op < 0.5:
            tier.put(seq)
        elif op < 0.8:
            for chunk in seq:
                if tier.get_into([chunk.ref], [out])[0]:
                    assert torch.equal(out, chunk.data)
        elif op < 0.9 and len(pinned) < 3:
            chunk = seq[-1]  # pin a leaf: its parents must still be able to leave
            if tier.pin([chunk.ref])[0]:
                pinned.append(chunk)
        elif pinned:
            tier.unpin([pinned.pop().ref])
        else:
            tier.remove([c.ref for c in seq])
        assert tier.used_bytes <= tier.capacity_bytes
        assert all(tier.contains(c.ref) for c in pinned)
    tier.unpin([c.ref for c in pinned])


@pytest.mark.parametrize("policy", [p for p in sorted(EVICTION_POLICIES) if "+prefix" in p])
def test_prefix_policies_evict_a_sequence_from_its_tail(
    tier_factory: TierFactory, layout: KVLayout, policy: str
) -> None:
    tier = tier_factory(4, policy)
    needs_slots(tier)
    first, second = sequences_with_parents(layout, 2, 4)
    tier.put(first)
    evicted = [r for c in second for r in tier.put([c]).evicted]
    assert evicted == [c.ref for c in reversed(first)]
    assert all(tier.contains(c.ref) for c in second)
