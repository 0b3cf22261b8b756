"""Link: ordering, data, failures, back-pressure, close and stats (CPU; one GPU test)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from functools import partial

import pytest
import torch

from kvtier.transfer import (
    CopyStep,
    Link,
    LinkStats,
    Throttle,
    TransferError,
    TransferHandle,
)

WAIT_S = 5.0  # generous bound for things that must happen; never reached when correct


@pytest.fixture
def link() -> Iterator[Link]:
    with Link("host->device", max_inflight_bytes=100) as lk:
        yield lk


def _gated(gate: threading.Event) -> Callable[[], None]:
    def run() -> None:
        assert gate.wait(WAIT_S), "test gate never opened"

    return run


def _noop() -> None:
    pass


def layer_steps(src: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> list[CopyStep]:
    """One step per layer, copying ``src[l]`` into ``dst[l]`` (tensors ``[L, ...]``)."""
    nbytes = src[0].numel() * src.element_size()
    return [
        CopyStep(
            nbytes, range(layer, layer + 1), partial(_copy, src[layer], dst[layer], non_blocking)
        )
        for layer in range(len(src))
    ]


def _copy(src: torch.Tensor, dst: torch.Tensor, non_blocking: bool) -> None:
    dst.copy_(src, non_blocking=non_blocking)


def test_copies_data_exactly_layer_by_layer(link: Link) -> None:
    srcs = [torch.randn(4, 2, 3, 8, 5) for _ in range(3)]  # [L, 2, H, T, D]
    dsts = [torch.zeros_like(s) for s in srcs]
    steps = [step for s, d in zip(srcs, dsts, strict=True) for step in layer_steps(s, d)]
    handle = link.submit(sorted(steps, key=lambda step: step.layers.start), num_layers=4)
    handle.wait_layer(0, timeout_s=WAIT_S)
    assert all(torch.equal(d[0], s[0]) for s, d in zip(srcs, dsts, strict=True))
    handle.wait(timeout_s=WAIT_S)
    assert all(torch.equal(d, s) for s, d in zip(srcs, dsts, strict=True))
    assert link.describe() == "host->device: real (cpu thread)"


def test_layer_zero_is_ready_before_layer_three(link: Link) -> None:
    gate = threading.Event()
    steps = [
        CopyStep(1, range(0, 1), _noop),
        CopyStep(1, range(1, 2), _gated(gate)),
        CopyStep(1, range(2, 3), _noop),
        CopyStep(1, range(3, 4), _noop),
    ]
    handle = link.submit(steps, num_layers=4)
    handle.wait_layer(0, timeout_s=WAIT_S)
    assert handle.layer_ready(0)
    assert not handle.layer_ready(3) and not handle.done()
    gate.set()
    handle.wait_layer(3, timeout_s=WAIT_S)
    handle.wait(timeout_s=WAIT_S)
    assert handle.done()
    assert handle.queued_at is not None and handle.started_at is not None
    assert handle.finished_at is not None
    assert handle.queued_at <= handle.started_at <= handle.finished_at


def test_transfers_run_in_submission_order(link: Link) -> None:
    order: list[int] = []
    handles = [
        link.submit([CopyStep(1, range(0), partial(order.append, i))], num_layers=0)
        for i in range(5)
    ]
    for handle in handles:
        handle.wait(timeout_s=WAIT_S)
    assert order == [0, 1, 2, 3, 4]


def test_failed_step_raises_transfer_error_and_the_link_keeps_working(link: Link) -> None:
    ran: list[str] = []

    def boom() -> None:
        raise OSError("read failed")

    steps = [
        CopyStep(10, range(0, 1), lambda: ran.append("a")),
        CopyStep(10, range(1, 2), boom),
        CopyStep(10, range(2, 3), lambda: ran.append("skipped")),
    ]
    bad = link.submit(steps, num_layers=3)
    with pytest.raises(TransferError) as info:
        bad.wait(timeout_s=WAIT_S)
    assert isinstance(info.value.__cause__, OSError)
    with pytest.raises(TransferError):
        bad.wait_layer(2, timeout_s=WAIT_S)
    bad.wait_layer(0, timeout_s=WAIT_S)  # finished before the failure
    assert ran == ["a"]

    good = link.submit([CopyStep(10, range(0, 1), lambda: ran.append("b"))], num_layers=1)
    good.wait(timeout_s=WAIT_S)
    assert ran == ["a", "b"]
    stats = link.stats()
    assert (stats.transfers, stats.failed, stats.steps, stats.bytes) == (2, 1, 2, 20)
    assert link.inflight_bytes == 0


def test_back_pressure_blocks_until_the_first_transfer_finishes(link: Link) -> None:
    gate = threading.Event()
    first = link.submit([CopyStep(80, range(0, 1), _gated(gate))], num_layers=1)
    second_steps = [CopyStep(80, range(0, 1), _noop)]
    assert link.try_submit(second_steps, num_layers=1) is None
    with pytest.raises(TimeoutError):
        link.submit(second_steps, num_layers=1, timeout_s=0.01)

    submitted = threading.Event()
    handles: list[TransferHandle] = []

    def submit_second() -> None:
        handles.append(link.submit(second_steps, num_layers=1))
        submitted.set()

    submitter = threading.Thread(target=submit_second)
    submitter.start()
    # Cannot be admitted while the gated 80 bytes are in flight (the gate is closed).
    assert not submitted.wait(0.05)
    assert not first.done() and link.inflight_bytes == 80
    gate.set()
    submitter.join(WAIT_S)
    assert submitted.is_set()
    first.wait(timeout_s=WAIT_S)
    handles[0].wait(timeout_s=WAIT_S)
    stats = link.stats()
    assert stats.max_inflight_bytes_seen <= 100
    assert stats.submit_blocked_s > 0


def test_oversized_transfer_is_admitted_when_nothing_is_in_flight(link: Link) -> None:
    handle = link.submit([CopyStep(500, range(0, 1), _noop)], num_layers=1, timeout_s=WAIT_S)
    handle.wait(timeout_s=WAIT_S)
    assert link.stats().max_inflight_bytes_seen == 500


def test_close_drains_is_idempotent_and_rejects_submits() -> None:
    ran: list[int] = []
    link = Link("host->disk", max_inflight_bytes=1 << 20)
    handles = [link.submit([CopyStep(1, range(0, 1), partial(ran.append, i))], 1) for i in range(3)]
    link.close()
    link.close()
    assert ran == [0, 1, 2] and all(h.done() for h in handles)
    assert link.closed
    with pytest.raises(RuntimeError, match="closed"):
        link.submit([], num_layers=0)
    with pytest.raises(RuntimeError, match="closed"):
        link.try_submit([], num_layers=0)


def test_close_wakes_a_submitter_blocked_by_back_pressure(link: Link) -> None:
    gate = threading.Event()
    link.submit([CopyStep(100, range(0, 1), _gated(gate))], num_layers=1)
    errors: list[BaseException] = []

    def submit_blocked() -> None:
        try:
            link.submit([CopyStep(100, range(0, 1), _noop)], num_layers=1)
        except RuntimeError as exc:
            errors.append(exc)

    submitter = threading.Thread(target=submit_blocked)
    submitter.start()
    closer = threading.Thread(target=link.close)
    closer.start()
    submitter.join(WAIT_S)
    assert len(errors) == 1
    gate.set()
    closer.join(WAIT_S)
    assert not closer.is_alive()


def test_stats_add_up(link: Link) -> None:
    sizes = [[10, 20], [5], [30, 1, 2]]
    handles = []
    for nbytes_list in sizes:
        steps = [CopyStep(n, range(i, i + 1), _noop) for i, n in enumerate(nbytes_list)]
        handles.append(link.submit(steps, num_layers=3))
    for handle in handles:
        handle.wait(timeout_s=WAIT_S)
    stats = link.stats()
    assert stats.transfers == 3 and stats.failed == 0
    assert stats.steps == 6
    assert stats.bytes == sum(sum(s) for s in sizes) == sum(h.nbytes for h in handles)
    assert stats.wait_s == pytest.approx(sum(h.waited_s for h in handles))
    assert stats.busy_s >= 0
    assert 0 < stats.max_inflight_bytes_seen <= 100
    link.stats().steps = 99  # a copy: mutating it changes nothing
    assert link.stats().steps == 6


def test_link_stats_total_adds_counters_and_keeps_the_largest_in_flight_peak() -> None:
    a = LinkStats(transfers=2, bytes=100, busy_s=1.0, wait_s=0.5, max_inflight_bytes_seen=64)
    b = LinkStats(transfers=1, bytes=50, busy_s=0.5, wait_s=0.25, max_inflight_bytes_seen=32)
    total = LinkStats.total([a, b])
    assert (total.transfers, total.bytes, total.max_inflight_bytes_seen) == (3, 150, 64)
    assert (total.busy_s, total.wait_s) == (1.5, 0.75)
    assert total.achieved_gbps == 150 / 1.5 / 1e9


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_link_copies_host_to_device_layer_by_layer() -> None:
    device = torch.device("cuda")
    src = torch.randn(4, 2, 3, 8, 5).pin_memory()
    dst = torch.zeros(src.shape, device=device)
    with Link("host->device", max_inflight_bytes=1 << 30, device=device) as link:
        handle = link.submit(layer_steps(src, dst, non_blocking=True), num_layers=4)
        handle.wait_layer(0, timeout_s=WAIT_S)
        assert torch.equal(dst[0].cpu(), src[0])  # .cpu() runs on the current stream
        handle.wait(timeout_s=WAIT_S)
        assert torch.equal(dst.cpu(), src)
        back = torch.zeros(src.shape).pin_memory()
        link.submit(layer_steps(dst, back, non_blocking=True), num_layers=4).wait()
        torch.cuda.current_stream().synchronize()
        assert torch.equal(back, src)
        assert "cuda stream" in link.describe()
    stats = link.stats()
    assert stats.transfers == 2 and stats.bytes == 2 * src.numel() * 4


def test_a_step_whose_result_is_there_is_skipped_without_pacing_or_counting() -> None:
    ran: list[int] = []
    throttle = Throttle(gbps=1e-6)  # 1,000 bytes take a second
    with Link("host<->disk", max_inflight_bytes=10_000, throttle=throttle) as lk:
        steps = [
            CopyStep(1000, range(0), partial(ran.append, i), skip=lambda i=i: i != 2)
            for i in range(4)
        ]
        handle = lk.submit(steps, num_layers=0)
        handle.wait(timeout_s=WAIT_S)
        stats = lk.stats()
    assert ran == [2]  # only the step whose result was not there ran
    assert handle.done and not handle.failed
    assert stats.steps == 1 and stats.bytes == 1000
