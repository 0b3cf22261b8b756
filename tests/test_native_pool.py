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
