"""Read-ahead: which reads run ahead of the reader and when they are dropped
(``ReadAhead`` over a real thread pool), and reads through it from a real Redis Cluster
bit-exact whatever order the chunks are read in."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pytest
import torch

from kvbench.redis_cluster import RedisCluster, available
from kvtier.config import RemoteConfig
from kvtier.kv import KVLayout
from kvtier.kv.chunk import ChunkRef
from kvtier.tiers.remote import RemoteTier
from kvtier.tiers.remote_reads import ReadAhead
from kvtier.tiers.remote_wire import ReadBuffers
from tests.conftest import make_chunks


def _ahead(pool: ThreadPoolExecutor, gate: threading.Event) -> tuple[ReadAhead, list[bytes]]:
    """A ReadAhead whose reads fill the buffer with the key's first byte once ``gate`` opens."""
    started: list[bytes] = []

    def start(ref: ChunkRef, buffer: np.ndarray) -> Future[int]:
        started.append(ref.key)

        def fill() -> int:
            gate.wait(10)
            buffer[:] = ref.key[0]
            return buffer.nbytes

        return pool.submit(fill)

    return ReadAhead(start, lambda ref: 64, ReadBuffers(), depth=2), started


def _refs(count: int) -> list[ChunkRef]:
    return [ChunkRef.of(bytes([i + 1]) * 16, np.arange(4) + i) for i in range(count)]


def test_reads_run_ahead_in_plan_order_and_skipped_ones_are_dropped() -> None:
    gate = threading.Event()
    with ThreadPoolExecutor(4) as pool:
        ahead, started = _ahead(pool, gate)
        refs = _refs(5)
        ahead.plan(refs)
        assert started == [refs[0].key, refs[1].key]  # depth 2
        gate.set()
        buffer, future = ahead.take(refs[0]) or pytest.fail("not started")
        assert future.result() == 64 and int(buffer[0]) == 1
        assert ahead.running == [refs[1].key, refs[2].key]  # topped up
        assert ahead.take(refs[3]) is None  # planned, not started: read it now
        assert ahead.running == [refs[4].key]  # 1 and 2 were skipped: dropped
        assert ahead.take(_refs(9)[8]) is None  # never planned
        ahead.plan(refs[:2])  # a new plan: the old reads not in it go
        assert ahead.running == [refs[0].key, refs[1].key]
        ahead.clear()
        assert ahead.running == []


needs_redis = pytest.mark.skipif(available() is not None, reason=f"no Redis: {available()}")


@needs_redis
def test_reads_through_read_ahead_are_bit_exact_in_any_order(
    redis_cluster: RedisCluster, layout: KVLayout
) -> None:
    config = RemoteConfig(url=redis_cluster.url, key_prefix=f"ahead{time.time_ns()}", cluster=True)
    tier = RemoteTier(layout, config)
    chunks = make_chunks(layout, 6)
    tier.put(chunks)
    out = layout.empty_chunk()
    for order in ([0, 1, 2, 3, 4, 5], [0, 2, 5], [3, 1, 4, 0]):
        tier.read_ahead([c.ref for c in chunks])
        for i in order:
            assert tier.read(chunks[i].ref, out) == "ok"
            assert torch.equal(out, chunks[i].data)
    tier.read_ahead([c.ref for c in chunks])
    tier.close()  # drops the reads no one took
