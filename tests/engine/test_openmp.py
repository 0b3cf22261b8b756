"""Releasing the calling thread's idle OpenMP helpers (kvtier.engine.openmp)."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import pytest
import torch

from kvtier.engine.openmp import release_idle_helpers

pytestmark = pytest.mark.skipif(
    not os.path.isdir("/proc/self/task"), reason="counts threads in /proc (Linux)"
)


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.fixture
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def parallel_region() -> None:
    torch.ones(1 << 20).add_(1.0)  # past torch's grain size: an OpenMP region on 2 threads


def test_the_calling_threads_helper_exits_and_returns_with_its_next_region(
    two_threads: None,
) -> None:
    def in_fresh_thread() -> None:  # a fresh thread: no pool yet, whatever ran before
        start = os_threads()
        parallel_region()
        counts.append(os_threads() - start)  # its helper
        released.append(release_idle_helpers())
        counts.append(os_threads() - start)  # gone
        parallel_region()
        counts.append(os_threads() - start)  # a new one
        release_idle_helpers()

    counts: list[int] = []
    released: list[bool] = []
    worker = threading.Thread(target=in_fresh_thread)
    worker.start()
    worker.join()
    assert released == [True]
    assert counts == [1, 0, 1]


def test_releasing_without_a_pool_is_harmless(two_threads: None) -> None:
    def in_fresh_thread() -> None:
        released.append(release_idle_helpers())
        parallel_region()
        values.append(float(torch.ones(1 << 20).sum()))

    released: list[bool] = []
    values: list[float] = []
    worker = threading.Thread(target=in_fresh_thread)
    worker.start()
    worker.join()
    assert released == [True] and values == [float(1 << 20)]
