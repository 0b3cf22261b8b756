"""kvtier's own thread pool for its CPU kernels (``src/kvtier/native/pool.h``): the same
results from any thread and from several at once, the split at torch's thread count, and a
forked child that starts its own helpers."""

from __future__ import annotations

import multiprocessing
import threading

import pytest
import torch
import torch.nn.functional as F

from kvtier import native

pytestmark = pytest.mark.skipif(native.ops() is None, reason=native.status().line())


def _ops():  # type: ignore[no-untyped-def]
    ops = native.ops()
    assert ops is not None
    return ops


def _case(seed: int, rows: int = 5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x, w = torch.randn(rows, 96, generator=gen), torch.randn(200, 96, generator=gen)
    return x, w, _ops().pack_panels(w)


def test_a_worker_thread_gets_the_callers_bits() -> None:
    """The engine runs its steps on a worker thread: the kernels give it the same bits as the
    first thread, at every thread count (1: inline; 2: caller and one helper)."""
    x, _, panels = _case(0)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            here = _ops().linear_panels(x, panels, None, 200)
            there: list[torch.Tensor] = []
            worker = threading.Thread(
                target=lambda out: out.append(_ops().linear_panels(x, panels, None, 200)),
                args=(there,),
            )
            worker.start()
            worker.join()
            assert torch.equal(here, there[0])
    finally:
        torch.set_num_threads(before)


def test_concurrent_callers_each_get_their_own_result() -> None:
    """One caller at a time has the helpers; the others run serially on their own thread."""
    cases = [_case(seed, rows) for seed, rows in enumerate((1, 3, 8, 17, 40, 64))]
    want = [F.linear(x, w) for x, w, _ in cases]
    got: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(cases))}

    def work(i: int) -> None:
        x, w, panels = cases[i]
        for _ in range(200):
            got[i].append(_ops().linear_panels(x, panels, None, w.shape[0]))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, outs in got.items():
        assert len(outs) == 200
        for out in outs:
            torch.testing.assert_close(out, want[i])
            assert torch.equal(out, outs[0])


def _child(
    x: torch.Tensor,
    panels: torch.Tensor,
    want: torch.Tensor,
    queue: multiprocessing.Queue,  # type: ignore[type-arg]
) -> None:
    # kvtier's kernels only: libgomp (torch's OpenMP) itself hangs in a fork of a parent
    # that used its pool
    queue.put(bool(torch.equal(_ops().linear_panels(x, panels, None, 200), want)))


def test_a_forked_child_starts_its_own_helpers() -> None:
    """The parent's helpers do not exist in a fork; the child's first call must not wait
    for them."""
    x, _, panels = _case(2)
    want = _ops().linear_panels(x, panels, None, 200)  # the parent's helpers are running
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_child, args=(x, panels, want, queue))
    child.start()
    child.join(timeout=60)
    if child.is_alive():
        child.kill()
        pytest.fail("the forked child's kernel call hung")
    assert child.exitcode == 0 and queue.get(timeout=5) is True


def test_the_split_never_changes_the_bits() -> None:
    """Parts go to whichever thread claims them first, and their number follows the thread
    count: every operator computes each output on one thread, so the bits stay the same."""
    x, _, panels = _case(3, rows=9)
    gen = torch.Generator().manual_seed(3)
    h, weight = torch.randn(40, 576, generator=gen), torch.randn(576, generator=gen)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3, 4, 2):
            torch.set_num_threads(threads)
            for _ in range(20):  # claims race differently call to call
                outs.append(
                    (_ops().linear_panels(x, panels, None, 200), _ops().rms_norm(h, weight, 1e-5))
                )
    finally:
        torch.set_num_threads(before)
    for linear, norm in outs:
        assert torch.equal(linear, outs[0][0]) and torch.equal(norm, outs[0][1])


def test_a_caller_is_not_held_by_a_busy_core() -> None:
    """With another process spinning on a core, the caller takes the parts its helper has
    not claimed: every call completes with the right result (the old static split made the
    caller spin out its time slice for a helper that had no core)."""
    x, w, panels = _case(4, rows=8)
    want = F.linear(x, w)
    context = multiprocessing.get_context("spawn")
    hog = context.Process(target=_spin, args=(5.0,))
    hog.start()
    try:
        for _ in range(2000):
            torch.testing.assert_close(_ops().linear_panels(x, panels, None, 200), want)
    finally:
        hog.kill()
        hog.join()


def _spin(seconds: float) -> None:
    import time

    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass
