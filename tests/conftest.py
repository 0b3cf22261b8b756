"""Shared fixtures: tiny layouts, deterministic chunks and a real Redis Cluster."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch

from kvtier.kv import Chunk, ChunkRef, KeyHasher, KVLayout, Namespace

if TYPE_CHECKING:
    from kvbench.redis_cluster import RedisCluster


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisCluster]:
    """A 3-master, 3-replica Redis Cluster on free loopback ports for the whole session
    (tests keep apart by key prefix); skipped, with the reason, where ``redis-server`` is
    not installed (``.ci/run`` installs it)."""
    from kvbench.redis_cluster import RedisCluster, available  # not in child processes' path

    reason = available()
    if reason is not None:
        pytest.skip(f"no Redis here: {reason}")
    with RedisCluster.start(masters=3, replicas=1) as cluster:
        yield cluster


@pytest.fixture
def layout() -> KVLayout:
    """A tiny layout: 2 layers, 2 KV heads, head dim 8, 16-token chunks (2 KiB a chunk)."""
    return KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, chunk_tokens=16)


def make_chunks(layout: KVLayout, count: int, seed: int = 0) -> list[Chunk]:
    """``count`` chunks of one sequence with seeded token ids and data."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 50_000, size=count * layout.chunk_tokens)
    hasher = KeyHasher(Namespace("test-model", layout))
    gen = torch.Generator().manual_seed(seed)
    chunks = []
    for i, key in enumerate(hasher.chain(ids)):
        ref = ChunkRef.of(key, ids[i * layout.chunk_tokens : (i + 1) * layout.chunk_tokens])
        data = torch.randn(layout.chunk_shape, generator=gen, dtype=torch.float32)
        chunks.append(Chunk(ref, data.to(layout.dtype)))
    return chunks


def one_torch_thread() -> Iterator[None]:
    """Run torch on one thread for a test package (used by the engine and server tests).

    The machine's few cores are shared, and two threads contending cost ~20x per tiny forward.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def run_in_threads(worker: Callable[[list[Chunk]], None], jobs: list[list[Chunk]]) -> None:
    """Run ``worker(job)`` for every job on its own thread; re-raise the first failure."""
    errors: list[BaseException] = []

    def guarded(job: list[Chunk]) -> None:
        try:
            worker(job)
        except BaseException as exc:  # surfaced in the calling thread below
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(job,)) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
