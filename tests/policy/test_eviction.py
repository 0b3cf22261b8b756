from __future__ import annotations

import random

import pytest

from kvtier.policy import EVICTION_POLICIES, make_policy
from kvtier.policy.arc import ARCPolicy
from kvtier.policy.prefix import PrefixAwarePolicy
from kvtier.policy.s3fifo import S3FIFOPolicy


def evict(policy: object, count: int = 1) -> list[object]:
    """What a tier does: ask for victims, then remove them."""
    assert hasattr(policy, "victims") and hasattr(policy, "remove")
    chosen = policy.victims(count, lambda k: False)
    for key in chosen:
        policy.remove(key)
    return chosen


@pytest.mark.parametrize("name", sorted(EVICTION_POLICIES))
def test_victims_skip_pinned_keys(name: str) -> None:
    policy = make_policy(name)
    for key in "abcd":
        policy.insert(key)
    assert policy.victims(2, lambda k: k in {"a", "c"}) == ["b", "d"]
    assert policy.victims(9, lambda k: True) == []
    policy.remove("b")
    assert len(policy) == 3


@pytest.mark.parametrize("name", sorted(EVICTION_POLICIES))
def test_random_operations_keep_the_contract(name: str) -> None:
    """Against a model of the tracked set: victims are tracked, unpinned and distinct;
    len follows inserts and removes; every key can be evicted once nothing is pinned."""
    rng = random.Random(7)
    policy = make_policy(name)
    tracked: set[int] = set()
    for step in range(3000):
        op = rng.random()
        if op < 0.45 or not tracked:
            key = rng.randrange(400)
            if key not in tracked:
                parent = key - 1 if key % 10 and rng.random() < 0.8 else None
                policy.insert(key, parent)
                tracked.add(key)
        elif op < 0.75:
            policy.touch(rng.choice(sorted(tracked)))
        elif op < 0.9:
            pinned = set(rng.sample(sorted(tracked), min(len(tracked), 3)))
            chosen = policy.victims(rng.randrange(1, 4), pinned.__contains__)
            assert len(set(chosen)) == len(chosen)
            assert set(chosen) <= tracked - pinned
            for key in chosen[: rng.randrange(len(chosen) + 1)]:
                policy.remove(key)
                tracked.discard(key)
        else:
            key = rng.choice(sorted(tracked))
            policy.remove(key)
            tracked.discard(key)
        assert len(policy) == len(tracked), step
    drained = set()
    while tracked:
        (key,) = evict(policy)
        drained.add(key)
        tracked.discard(key)
    assert len(policy) == 0 and drained


@pytest.mark.parametrize("name", sorted(EVICTION_POLICIES))
def test_readmitted_key_is_tracked_again(name: str) -> None:
    policy = make_policy(name)
    for key in "abc":
        policy.insert(key)
    (victim,) = evict(policy)
    policy.readmit(victim)
    assert len(policy) == 3
    assert victim in policy.victims(3, lambda k: False)


def test_lru_orders_by_last_use() -> None:
    policy = make_policy("lru")
    for key in "abc":
        policy.insert(key)
    policy.touch("a")
    assert list(policy.candidates()) == ["b", "c", "a"]  # type: ignore[attr-defined]


def test_fifo_ignores_uses() -> None:
    policy = make_policy("fifo")
    for key in "abc":
        policy.insert(key)
    policy.touch("a")
    assert list(policy.candidates()) == ["a", "b", "c"]  # type: ignore[attr-defined]


def test_s3fifo_evicts_one_hit_keys_before_reused_ones() -> None:
    policy = S3FIFOPolicy()
    for key in range(10):
        policy.insert(key)
    for key in (0, 1, 2):
        policy.touch(key)
        policy.touch(key)
    policy.touch(3)
    # The small queue's keys used twice move to main; the rest go, oldest first: a key
    # used once in small is not promoted (the paper's freq > 1).
    assert evict(policy, 7) == [3, 4, 5, 6, 7, 8, 9]
    assert sorted(policy.victims(3, lambda k: False)) == [0, 1, 2]
    policy.insert(3)  # evicted from small, so remembered: back into main
    assert 3 in policy._main


def test_s3fifo_ghost_hit_goes_to_main() -> None:
    policy = S3FIFOPolicy()
    for key in range(10):
        policy.insert(key)
    assert evict(policy) == [0]  # to the ghost queue
    policy.insert(0)  # back while remembered: main, not small
    assert 0 in policy._main and 0 not in policy._small
    for key in range(10, 20):  # a scan of new keys passes through small only
        policy.insert(key)
        evict(policy)
    assert 0 in policy.victims(len(policy), lambda k: False)[-2:]


def test_s3fifo_frequency_is_capped_at_three() -> None:
    policy = S3FIFOPolicy()
    for key in range(10):
        policy.insert(key)
    for _ in range(10):
        policy.touch(0)
    evict(policy, 9)  # 0 moves to main (freq 0); the others go
    for _ in range(10):
        policy.touch(0)
    for key in range(20, 30):
        policy.insert(key)
        policy.touch(key)
    # In main: 0 with freq 3 survives three passes; the rest have 1 and are promoted after.
    assert policy._freq[0] == 3


def test_arc_keeps_keys_used_twice_through_a_scan() -> None:
    policy = ARCPolicy()
    for key in "ab":
        policy.insert(key)
        policy.touch(key)  # t2
    for key in "cdef":
        policy.insert(key)  # t1
    assert evict(policy, 4) == ["c", "d", "e", "f"]
    assert len(policy) == 2


def test_arc_ghost_hit_in_b1_grows_the_recency_target() -> None:
    policy = ARCPolicy()
    for key in "abcd":
        policy.insert(key)
    assert evict(policy) == ["a"]  # t1 -> b1
    before = policy.p
    policy.insert("a")  # a ghost hit: recency was worth more
    assert policy.p > before
    policy.touch("b")
    assert "a" not in policy.victims(1, lambda k: False)  # a went to t2, b1 keys go first


@pytest.mark.parametrize("base", ["lru", "fifo", "s3fifo", "arc"])
def test_prefix_rule_evicts_a_sequence_from_its_tail(base: str) -> None:
    policy = make_policy(base + "+prefix")
    for i in range(5):  # one sequence a0 <- a1 <- ... <- a4, used in prefix order
        policy.insert(f"a{i}", f"a{i - 1}" if i else None)
    for i in range(3):
        policy.insert(f"b{i}", f"b{i - 1}" if i else None)
    order = [evict(policy)[0] for _ in range(8)]  # one at a time, as a tier evicts
    for seq, size in (("a", 5), ("b", 3)):  # each sequence leaves from its tail up
        assert [k for k in order if k[0] == seq] == [f"{seq}{i}" for i in reversed(range(size))]
    if base in ("lru", "fifo"):  # and a set-aside parent goes right after its last child
        assert order == ["a4", "a3", "a2", "a1", "a0", "b2", "b1", "b0"]


def test_prefix_rule_gives_way_when_every_leaf_is_pinned() -> None:
    policy = PrefixAwarePolicy(make_policy("lru"))
    policy.insert("a0")
    policy.insert("a1", "a0")
    assert policy.victims(1, lambda k: k == "a1") == ["a0"]  # room beats the rule
    assert policy.held_children("a0") == 1


def test_prefix_rule_touch_returns_a_set_aside_parent_to_the_order() -> None:
    policy = PrefixAwarePolicy(make_policy("lru"))
    policy.insert("a0")
    policy.insert("a1", "a0")
    policy.insert("x")
    assert policy.victims(1, lambda k: False) == ["a1"]  # a0 set aside
    policy.touch("a0")
    policy.touch("a1")
    assert [evict(policy)[0] for _ in range(3)] == ["x", "a1", "a0"]


def test_unknown_policy_lists_accepted_values() -> None:
    with pytest.raises(ValueError, match=r"eviction_policy.*'lfu'.*accepted.*arc.*lru"):
        make_policy("lfu")


@pytest.mark.parametrize("name", ["s3fifo", "arc"])
def test_a_set_aside_key_goes_back_where_it_stood(name: str) -> None:
    """Readmitted after ``set_aside``, a key from the recency queue (S3-FIFO's small, ARC's
    t1) leaves through it again, so its eviction is remembered in the ghost list."""
    policy = make_policy(name)
    for key in range(10):
        policy.insert(key)
    policy.set_aside(0)
    assert len(policy) == 9
    policy.readmit(0)
    assert len(policy) == 10
    assert evict(policy) == [0]
    policy.insert(0)  # a ghost hit: it comes back into the frequency queue
    ghost_queue = policy._main if name == "s3fifo" else policy._t2  # type: ignore[attr-defined]
    assert 0 in ghost_queue
