"""TransferHandle and CopyStep, driven from the producer side without a link."""

from __future__ import annotations

import threading

import pytest

from kvtier.transfer import CopyStep, TransferError, TransferHandle


def _noop() -> None:
    pass


def _layer_steps(num_layers: int, nbytes: int = 10) -> list[CopyStep]:
    return [CopyStep(nbytes, range(layer, layer + 1), _noop) for layer in range(num_layers)]


def test_uncovered_layers_are_ready_at_once() -> None:
    handle = TransferHandle([CopyStep(8, range(1, 2), _noop)], num_layers=3)
    assert handle.layer_ready(0) and handle.layer_ready(2)
    assert not handle.layer_ready(1)
    handle.wait_layer(2, timeout_s=0)
    assert handle.nbytes == 8


def test_layers_become_ready_in_step_order() -> None:
    handle = TransferHandle(_layer_steps(4), num_layers=4)
    handle.step_done(0)
    assert handle.layer_ready(0)
    assert not any(handle.layer_ready(layer) for layer in (1, 2, 3))
    for i in (1, 2, 3):
        handle.step_done(i)
    assert all(handle.layer_ready(layer) for layer in range(4))
    assert not handle.done()
    handle.mark_issued()
    handle.mark_finished()
    handle.wait(timeout_s=0)
    assert handle.done() and handle.finished_at is not None


def test_layer_waits_for_every_covering_step() -> None:
    steps = [CopyStep(1, range(0, 2), _noop), CopyStep(1, range(1, 3), _noop)]
    handle = TransferHandle(steps, num_layers=3)
    assert handle.finishing_layers(0) == [0]
    assert handle.finishing_layers(1) == [1, 2]
    handle.step_done(0)
    assert handle.layer_ready(0) and not handle.layer_ready(1)
    handle.step_done(1)
    assert handle.layer_ready(1) and handle.layer_ready(2)


def test_wait_layer_times_out() -> None:
    handle = TransferHandle(_layer_steps(2), num_layers=2)
    with pytest.raises(TimeoutError):
        handle.wait_layer(1, timeout_s=0.01)
    with pytest.raises(TimeoutError):
        handle.wait(timeout_s=0.01)


def test_wait_layer_wakes_when_another_thread_finishes_the_step() -> None:
    waited: list[float] = []
    handle = TransferHandle(_layer_steps(2), num_layers=2, on_wait=waited.append)
    result: list[str] = []

    def wait_then_record() -> None:
        handle.wait_layer(1)
        result.append("ok")

    waiter = threading.Thread(target=wait_then_record)
    waiter.start()
    handle.step_done(0)
    handle.step_done(1)
    waiter.join(timeout=5)
    assert result == ["ok"]
    assert handle.waited_s == pytest.approx(sum(waited))
    assert len(waited) == 1


def test_failure_raises_transfer_error_with_cause() -> None:
    handle = TransferHandle(_layer_steps(3), num_layers=3, link_name="test")
    handle.step_done(0)
    handle.fail(ValueError("disk on fire"))
    handle.fail(KeyError("second"))  # the first error wins
    handle.mark_finished()
    handle.wait_layer(0)  # ready before the failure: still fine
    with pytest.raises(TransferError) as info:
        handle.wait_layer(2)
    assert isinstance(info.value.__cause__, ValueError)
    with pytest.raises(TransferError):
        handle.wait()
    assert handle.failed and handle.done()
    assert isinstance(handle.error, ValueError)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="nbytes"):
        CopyStep(-1, range(1), _noop)
    with pytest.raises(ValueError, match="layers"):
        CopyStep(1, range(-1, 1), _noop)
    with pytest.raises(ValueError, match="num_layers"):
        TransferHandle([CopyStep(1, range(2, 3), _noop)], num_layers=2)
    handle = TransferHandle([], num_layers=2)
    with pytest.raises(IndexError):
        handle.wait_layer(2)
