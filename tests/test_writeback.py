"""Write-back on eviction runs on the host⇄disk link's worker and never stalls compute.

The checks are structural, not timings: the disk's ``put`` records the thread it runs on
and can be held shut, so a store that waited for a disk write would never return.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kvtier.config import DiskConfig, HostConfig, LinkConfig, ManagerConfig
from kvtier.kv import Chunk, KVLayout
from kvtier.manager import KVManager
from kvtier.tiers.base import PutResult

STORE_TIMEOUT_S = 60.0  # a hang guard, far above any store's cost: not a speed check


class GatedPuts:
    """Wraps the disk's ``put``: records each calling thread, waits for ``gate`` first."""

    def __init__(self, manager: KVManager, hold: bool = True) -> None:
        self.disk = manager.tier("disk")
        self.gate = threading.Event()
        if not hold:
            self.gate.set()
        self.threads: list[str] = []
        self.started = threading.Event()
        self._put = self.disk.put
        self.disk.put = self._gated  # type: ignore[method-assign]

    def _gated(self, chunks: list[Chunk]) -> PutResult:
        self.threads.append(threading.current_thread().name)
        self.started.set()
        self.gate.wait()
        return self._put(chunks)


def make_manager(
    layout: KVLayout,
    tmp_path: Path,
    host_chunks: int = 2,
    write_queue_chunks: int = 4,
    link: LinkConfig | None = None,
    write_policy: str = "write_back",
) -> KVManager:
    nbytes = layout.chunk_nbytes
    disk = DiskConfig(
        path=str(tmp_path / "disk"),
        capacity_bytes=64 * nbytes,
        fsync=False,
        link=link or LinkConfig(),
        write_queue_chunks=write_queue_chunks,
    )
    config = ManagerConfig(
        chunk_tokens=layout.chunk_tokens,
        write_policy=write_policy,
        host=HostConfig(capacity_bytes=host_chunks * nbytes),
        lower_tiers=(disk,),
    )
    return KVManager(layout, "test-model", config)


def chunks_of(manager: KVManager, num_chunks: int) -> list[Chunk]:
    ids = np.arange(num_chunks * manager.layout.chunk_tokens)
    gen = torch.Generator().manual_seed(0)
    return [
        Chunk(ref, torch.randn(manager.layout.chunk_shape, generator=gen))
        for ref in manager.refs_for(ids)
    ]


def store_each(manager: KVManager, chunks: list[Chunk]) -> None:
    """Store one chunk per step on a thread named "compute"; fails if any store hangs."""
    done = threading.Event()

    def compute() -> None:
        for chunk in chunks:
            manager.store([chunk])
        done.set()

    thread = threading.Thread(target=compute, name="compute", daemon=True)
    thread.start()
    thread.join(STORE_TIMEOUT_S)
    assert done.is_set(), "a store waited for the disk write"


def assert_never_wrong(manager: KVManager, chunks: list[Chunk]) -> int:
    """Every chunk the manager says it has promotes to its own bytes; returns how many."""
    found = [c for c in chunks if manager.locate(c.ref) is not None]
    for chunk in found:  # one at a time: each promotion may evict another (written back)
        assert manager.promote([chunk.ref]) == ["host"]
        out = manager.layout.empty_chunk()
        assert manager.host.get_into([chunk.ref], [out]) == [True]
        assert torch.equal(out, chunk.data)
    return len(found)


@pytest.fixture
def gated(layout: KVLayout, tmp_path: Path) -> Iterator[tuple[KVManager, GatedPuts]]:
    manager = make_manager(layout, tmp_path)
    puts = GatedPuts(manager)
    yield manager, puts
    puts.gate.set()
    manager.close()


def test_eviction_never_waits_for_the_disk_write(gated: tuple[KVManager, GatedPuts]) -> None:
    """With every disk write held shut, a host that evicts every step keeps storing."""
    manager, puts = gated
    chunks = chunks_of(manager, 10)  # a host of 2 chunks: 8 evictions
    store_each(manager, chunks[:3])  # chunk 0 is evicted: its write-back goes to the link
    assert puts.started.wait(STORE_TIMEOUT_S)  # ... and is being written, held shut
    store_each(manager, chunks[3:])
    assert manager.links[0].inflight_bytes > 0  # the stores returned while it is busy
    assert manager.links[0].stats().submit_blocked_s == 0.0
    stats = manager.stats()
    # Four buffers: one being written (chunk 0), three waiting (the newest victims, 5-7);
    # the waiting victims 1-4 were dropped oldest first to make room.
    assert stats.write_backs_queued == 8 and stats.write_backs_dropped == 4
    tiers = [getattr(manager.locate(c.ref), "name", None) for c in chunks]
    assert tiers == ["disk"] + [None] * 4 + ["disk"] * 3 + ["host"] * 2
    assert manager.lookup(np.arange(10 * manager.layout.chunk_tokens)).hit_tokens == 16

    puts.gate.set()
    manager.wait_writes()
    disk = manager.tier("disk")
    assert [disk.contains(c.ref) for c in chunks[:8]] == [True] + [False] * 4 + [True] * 3
    assert set(puts.threads) == {"kvtier-link-host<->disk"}  # never the compute thread
    assert manager.promote([c.ref for c in chunks[1:5]]) == ["missing"] * 4  # recomputed
    assert assert_never_wrong(manager, chunks) == 6


def test_promotion_of_a_queued_chunk_waits_for_its_write(
    gated: tuple[KVManager, GatedPuts],
) -> None:
    manager, puts = gated
    chunks = chunks_of(manager, 3)
    store_each(manager, chunks)  # chunk 0 is evicted: its write is held shut
    assert manager.locate(chunks[0].ref) is manager.tier("disk")
    outcome: list[list[str]] = []
    reader = threading.Thread(target=lambda: outcome.append(manager.promote([chunks[0].ref])))
    reader.start()
    puts.gate.set()  # the promotion was queued behind the write on the same FIFO link
    reader.join(STORE_TIMEOUT_S)
    assert outcome == [["host"]]
    out = manager.layout.empty_chunk()
    assert manager.host.get_into([chunks[0].ref], [out]) == [True]
    assert torch.equal(out, chunks[0].data)


def test_throttled_disk_link_never_blocks_stores(layout: KVLayout, tmp_path: Path) -> None:
    """A link slower than the stores: they all return, the link still busy behind them."""
    seconds_per_chunk = 0.05
    link = LinkConfig(gbps=layout.chunk_nbytes / seconds_per_chunk / 1e9)
    with make_manager(layout, tmp_path, link=link) as manager:
        puts = GatedPuts(manager, hold=False)
        chunks = chunks_of(manager, 12)
        store_each(manager, chunks)
        assert manager.links[0].inflight_bytes > 0  # the writes are still going down
        link_stats = manager.links[0].stats()
        assert link_stats.submit_blocked_s == 0.0 and link_stats.wait_s == 0.0
        manager.wait_writes()
        stats = manager.stats()
        disk = manager.tier("disk")
        written = sum(disk.contains(c.ref) for c in chunks)
        # Every victim was written or dropped (counted), none twice, none on "compute".
        assert stats.write_backs_queued == 10
        assert written + stats.write_backs_dropped == 10 and written >= 1
        assert stats.tiers["disk"].puts == written
        assert set(puts.threads) == {"kvtier-link-host<->disk"}
        assert assert_never_wrong(manager, chunks) == written + 2
        assert "write-back on eviction: 10 chunks queued" in stats.table()


def test_victim_already_below_needs_no_write(layout: KVLayout, tmp_path: Path) -> None:
    with make_manager(layout, tmp_path, write_policy="write_through") as manager:
        chunks = chunks_of(manager, 2)
        manager.store(chunks)
        manager.wait_writes()  # both are on disk now
        manager.store(chunks_of(manager, 4)[2:])  # evicts both
        manager.wait_writes()
        stats = manager.stats()
        assert stats.write_backs_queued == 0  # both were on disk already
        assert stats.tiers["disk"].puts == 4  # each chunk written once (through)
        assert [manager.locate(c.ref) for c in chunks] == [manager.tier("disk")] * 2


def test_no_write_queue_drops_every_victim(layout: KVLayout, tmp_path: Path) -> None:
    with make_manager(layout, tmp_path, write_queue_chunks=0) as manager:
        chunks = chunks_of(manager, 5)
        manager.store(chunks)
        manager.wait_writes()
        stats = manager.stats()
        assert stats.write_backs_dropped == 3 and stats.tiers["disk"].puts == 0
        assert [manager.locate(c.ref) is None for c in chunks] == [True] * 3 + [False] * 2
