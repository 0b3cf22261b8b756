from __future__ import annotations

import pytest

from kvtier.policy import EVICTION_POLICIES, make_policy


@pytest.mark.parametrize("name", sorted(EVICTION_POLICIES))
def test_victims_skip_pinned_keys(name: str) -> None:
    policy = make_policy(name)
    for key in "abcd":
        policy.insert(key)
    assert policy.victims(2, lambda k: k in {"a", "c"}) == ["b", "d"]
    assert policy.victims(9, lambda k: True) == []
    policy.remove("b")
    assert len(policy) == 3


def test_lru_orders_by_last_use() -> None:
    policy = make_policy("lru")
    for key in "abc":
        policy.insert(key)
    policy.touch("a")
    assert list(policy.candidates()) == ["b", "c", "a"]


def test_fifo_ignores_uses() -> None:
    policy = make_policy("fifo")
    for key in "abc":
        policy.insert(key)
    policy.touch("a")
    assert list(policy.candidates()) == ["a", "b", "c"]


def test_unknown_policy_lists_accepted_values() -> None:
    with pytest.raises(ValueError, match=r"eviction_policy.*'arc'.*accepted.*lru"):
        make_policy("arc")
