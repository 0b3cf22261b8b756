"""The manager: prefix lookup across tiers, store, write policies, promotion."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvtier.config import DiskConfig, HostConfig, ManagerConfig
from kvtier.kv import Chunk, KVLayout
from kvtier.manager import KVManager


def sequence_chunks(manager: KVManager, token_ids: np.ndarray, seed: int = 0) -> list[Chunk]:
    gen = torch.Generator().manual_seed(seed)
    return [
        Chunk(ref, torch.randn(manager.layout.chunk_shape, generator=gen))
        for ref in manager.refs_for(token_ids)
    ]


def make_manager(
    layout: KVLayout,
    tmp_path: Path | None = None,
    host_chunks: int = 8,
    disk_chunks: int = 32,
    write_policy: str = "write_back",
    digest_bytes: int = 16,
) -> KVManager:
    lower = ()
    if tmp_path is not None:
        lower = (
            DiskConfig(
                path=str(tmp_path / "disk"), capacity_bytes=disk_chunks * layout.chunk_nbytes
            ),
        )
    config = ManagerConfig(
        chunk_tokens=layout.chunk_tokens,
        write_policy=write_policy,
        host=HostConfig(capacity_bytes=host_chunks * layout.chunk_nbytes),
        lower_tiers=lower,
    )
    return KVManager(layout, "test-model", config, digest_bytes=digest_bytes)


def test_lookup_finds_longest_prefix_and_tier(layout: KVLayout) -> None:
    with make_manager(layout) as manager:
        ids = np.arange(16 * 4 + 5)
        chunks = sequence_chunks(manager, ids)
        manager.store(chunks[:3])
        result = manager.lookup(ids)
        assert result.hit_tokens == 48
        assert result.tiers == ["host"] * 3 and result.by_tier == {"host": 3}
        # A sequence that diverges inside chunk 2 reuses only chunk 1.
        other = ids.copy()
        other[20] += 1
        assert manager.lookup(other).hit_tokens == 16


def test_lookup_stops_at_first_missing_chunk(layout: KVLayout) -> None:
    with make_manager(layout) as manager:
        ids = np.arange(16 * 3)
        chunks = sequence_chunks(manager, ids)
        manager.store([chunks[0], chunks[2]])
        assert manager.lookup(ids).hit_tokens == 16


def test_forced_key_collision_never_returns_foreign_kv(layout: KVLayout) -> None:
    """With 1-byte keys collisions are certain; token ids must turn them into misses."""
    with make_manager(layout, host_chunks=512, digest_bytes=1) as manager:
        rng = np.random.default_rng(0)
        first_chunks: dict[bytes, np.ndarray] = {}
        collision = None
        for _ in range(2000):
            ids = rng.integers(0, 1000, size=16)
            key = manager.refs_for(ids)[0].key
            if key in first_chunks and not np.array_equal(first_chunks[key], ids):
                collision = (first_chunks[key], ids)
                break
            first_chunks.setdefault(key, ids)
        assert collision is not None
        stored_ids, query_ids = collision
        (stored,) = sequence_chunks(manager, stored_ids)
        manager.store([stored])
        query_ref = manager.refs_for(query_ids)[0]
        assert query_ref.key == stored.key
        assert manager.lookup(query_ids).hit_tokens == 0
        assert manager.locate(query_ref) is None
        assert manager.promote([query_ref]) == ["missing"]
        out = torch.zeros(layout.chunk_shape)
        assert manager.host.get_into([query_ref], [out]) == [False]
        assert torch.all(out == 0)
        assert manager.stats().tiers["host"].collisions >= 1


def read_host(manager: KVManager, ref: object) -> torch.Tensor:
    out = manager.layout.empty_chunk()
    assert manager.host.get_into([ref], [out]) == [True]  # type: ignore[list-item]
    return out


def test_host_eviction_writes_back_to_disk_and_promote_reads_it(
    layout: KVLayout, tmp_path: Path
) -> None:
    with make_manager(layout, tmp_path, host_chunks=2, write_policy="write_back") as manager:
        ids = np.arange(16 * 5)
        chunks = sequence_chunks(manager, ids)
        manager.store(chunks)
        assert manager.disk is not None
        manager.wait_writes()  # evicted chunks go down on the link, off the caller's thread
        assert len(manager.host) == 2 and len(manager.disk) == 3
        assert manager.stats().write_backs_queued == 3
        assert manager.stats().write_backs_dropped == 0
        result = manager.lookup(ids)
        assert result.hit_tokens == 80
        assert result.tiers == ["disk"] * 3 + ["host"] * 2
        assert manager.promote([chunks[0].ref]) == ["host"]
        assert torch.equal(read_host(manager, chunks[0].ref), chunks[0].data)
        stats = manager.stats()
        assert stats.tiers["host"].evictions >= 3 and stats.tiers["disk"].hits == 1


def test_write_through_reaches_disk_and_survives_restart(layout: KVLayout, tmp_path: Path) -> None:
    ids = np.arange(16 * 3)
    with make_manager(layout, tmp_path, write_policy="write_through") as manager:
        chunks = sequence_chunks(manager, ids)
        manager.store(chunks)
        manager.flush()
        assert manager.disk is not None and len(manager.disk) == 3
    with make_manager(layout, tmp_path) as reopened:
        result = reopened.lookup(ids)
        assert result.hit_tokens == 48 and set(result.tiers) == {"disk"}
        assert reopened.promote(result.refs) == ["host"] * 3
        for chunk in chunks:
            assert torch.equal(read_host(reopened, chunk.ref), chunk.data)


def test_close_can_flush_host_to_disk(layout: KVLayout, tmp_path: Path) -> None:
    ids = np.arange(16 * 2)
    with make_manager(layout, tmp_path) as manager:
        chunks = sequence_chunks(manager, ids)
        manager.store(chunks)
        manager.close(flush_host_to_disk=True)
    with make_manager(layout, tmp_path) as reopened:
        assert reopened.lookup(ids).hit_tokens == 32


def test_prefetch_to_host_promotes_in_background(layout: KVLayout, tmp_path: Path) -> None:
    with make_manager(layout, tmp_path, host_chunks=2) as manager:
        ids = np.arange(16 * 4)
        chunks = sequence_chunks(manager, ids)
        manager.store(chunks)  # chunks 0 and 1 end up on disk only
        handles = manager.prefetch_to_host([c.ref for c in chunks[:2]])
        assert len(handles) == 2  # one transfer per chunk
        assert manager.prefetch_to_host([c.ref for c in chunks[:2]]) == []  # in flight or in
        for handle in handles:
            handle.wait()
        assert manager.lookup(ids).tiers[:2] == ["host", "host"]


def test_chunk_size_mismatch_is_a_clear_error(layout: KVLayout) -> None:
    with pytest.raises(ValueError, match="chunk_tokens"):
        KVManager(layout, "m", ManagerConfig(chunk_tokens=32))


def test_stats_name_each_tiers_eviction_policy(layout: KVLayout, tmp_path: Path) -> None:
    config = ManagerConfig(
        chunk_tokens=layout.chunk_tokens,
        host=HostConfig(capacity_bytes=2 * layout.chunk_nbytes, eviction_policy="arc+prefix"),
        lower_tiers=(DiskConfig(path=str(tmp_path), eviction_policy="s3fifo"),),
    )
    with KVManager(layout, "test-model", config) as manager:
        manager.store(sequence_chunks(manager, np.arange(4 * layout.chunk_tokens)))
        stats = manager.stats()
    assert stats.eviction_policies == {"host": "arc+prefix", "disk": "s3fifo"}
    assert stats.tiers["host"].evictions == 2
    table = stats.table()
    assert "arc+prefix" in table and "s3fifo" in table
