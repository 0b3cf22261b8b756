from __future__ import annotations

from kvtier.kv import KVLayout
from kvtier.tiers import device_tier
from kvtier.tiers.base import TierStats
from tests.conftest import make_chunks


def test_an_emptied_pool_fills_from_slot_zero(layout: KVLayout) -> None:
    tier = device_tier(layout, 6 * layout.chunk_nbytes, "cpu")
    first = make_chunks(layout, 5, seed=1)
    tier.put(first)
    tier.remove([first[1].ref, first[3].ref])
    tier.clear()
    second = make_chunks(layout, 3, seed=2)
    tier.put(second)
    # The lowest free slots, so one sequence's chunks lie end to end.
    assert sorted(tier.slot_of(c.ref) for c in second) == [0, 1, 2]
    tier.close()


def test_tier_stats_total_adds_every_field() -> None:
    a = TierStats(hits=2, bytes_in=10, evictions=1, put_seconds=0.5)
    b = TierStats(hits=3, misses=4, bytes_in=5, put_seconds=0.25)
    total = TierStats.total([a, b])
    assert (total.hits, total.misses, total.bytes_in, total.evictions) == (5, 4, 15, 1)
    assert total.put_seconds == 0.75
    assert TierStats.total([]) == TierStats()
