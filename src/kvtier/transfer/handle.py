"""Transfer handles: per-layer readiness of one submitted transfer.

A handle has two sides. Consumers (the scheduler, attention) call ``wait_layer``, ``wait``,
``layer_ready`` and ``done``, from any thread. The producer (the worker of the link that
runs the transfer) calls ``mark_started``, ``step_done``, ``fail``, ``mark_issued`` and
``mark_finished``, in that order, from one thread.

On CUDA a step is *issued* when its copies are enqueued on the link's stream, and
*complete* when the stream has run them. Per-layer readiness then means "issued, with a
CUDA event recorded after it": ``wait_layer`` blocks the host only until the issue, and
makes the caller's current stream wait on the event, so the host never syncs with the
device. On the CPU, issued and complete are the same moment.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import torch

from kvtier.transfer.steps import CopyStep


class TransferError(RuntimeError):
    """A copy step of a transfer raised; the step's exception is the ``__cause__``."""


class TransferHandle:
    """Per-layer readiness of one transfer (a list of copy steps run in order).

    Created by ``Link.submit``; valid for ever (it holds no buffers besides the steps).
    Every method is thread-safe.

    Args:
        steps: the copy steps, run in this order.
        num_layers: layers the readiness is tracked for; every step's ``layers`` must lie
            in ``range(num_layers)``. Layers covered by no step are ready at once.
        link_name: the link's name, for error messages.
        on_wait: called with the seconds each ``wait``/``wait_layer`` call blocked (the
            link sums them into its stats). Called without any handle lock held.

    Attributes:
        steps: the steps (do not mutate).
        num_layers: as given.
        nbytes: sum of the steps' ``nbytes``.
        queued_at: ``time.perf_counter()`` when the link accepted the transfer (None
            before).
        started_at: when the worker began its first step (None before).
        finished_at: when the transfer was finished: every step complete, or failed and
            retired (None before).
        waited_s: total seconds callers spent blocked in ``wait``/``wait_layer`` on this
            handle, the stall time this transfer caused.
    """

    def __init__(
        self,
        steps: Sequence[CopyStep],
        num_layers: int,
        link_name: str = "link",
        on_wait: Callable[[float], None] | None = None,
    ) -> None:
        if num_layers < 0:
            raise ValueError(f"num_layers: must be >= 0, got {num_layers}")
        self.steps: tuple[CopyStep, ...] = tuple(steps)
        self.num_layers = num_layers
        self.link_name = link_name
        self.nbytes = sum(step.nbytes for step in self.steps)
        self._on_wait = on_wait
        # Outstanding steps per layer; a layer is ready when its count reaches 0.
        self._pending = [0] * num_layers
        # finishing[i]: layers whose last covering step is step i (events go there on CUDA).
        self._finishing: list[list[int]] = [[] for _ in self.steps]
        last_step: dict[int, int] = {}
        for i, step in enumerate(self.steps):
            if len(step.layers) and max(step.layers[0], step.layers[-1]) >= num_layers:
                raise ValueError(
                    f"steps[{i}].layers: {step.layers} reaches past num_layers={num_layers}"
                )
            for layer in step.layers:
                self._pending[layer] += 1
                last_step[layer] = i
        for layer, i in last_step.items():
            self._finishing[i].append(layer)
        self._events: list[torch.cuda.Event | None] = [None] * num_layers
        self._done_event: torch.cuda.Event | None = None
        self._error: BaseException | None = None
        self._issued = False
        self._finished = False
        self._cond = threading.Condition()
        self.queued_at: float | None = None
        self.started_at: float | None = None
        self.finished_at: float | None = None
        self.waited_s = 0.0

    def __repr__(self) -> str:
        state = "failed" if self.failed else "done" if self.done() else "pending"
        return (
            f"TransferHandle({self.link_name}, {len(self.steps)} steps, "
            f"{self.nbytes} bytes, {state})"
        )

    # ---- consumer side --------------------------------------------------------------------

    def layer_ready(self, layer_idx: int) -> bool:
        """True if ``layer_idx`` is ready now. Never blocks.

        On CUDA this also asks the layer's event whether the device has run the copy.
        """
        self._check_layer(layer_idx)
        with self._cond:
            if self._pending[layer_idx]:
                return False
            event = self._events[layer_idx]
        return event is None or event.query()

    def wait_layer(self, layer_idx: int, timeout_s: float | None = None) -> None:
        """Block until every step covering ``layer_idx`` has run (been issued, on CUDA).

        On CUDA the caller's current stream is then made to wait on the layer's event, so
        kernels enqueued afterwards see the data; the host does not wait for the device.
        A layer that became ready before a later step failed stays ready.

        Raises:
            TransferError: a step failed before the layer was ready (cause chained).
            TimeoutError: ``timeout_s`` passed first.
        """
        self._check_layer(layer_idx)
        start = time.perf_counter()
        try:
            with self._cond:
                self._cond.wait_for(
                    lambda: self._pending[layer_idx] == 0 or self._finished, timeout_s
                )
                if self._pending[layer_idx]:
                    if self._finished:
                        raise self._transfer_error(f"layer {layer_idx} never became ready")
                    raise TimeoutError(
                        f"{self.link_name}: layer {layer_idx} not ready after {timeout_s} s"
                    )
                event = self._events[layer_idx]
        finally:
            self._add_waited(time.perf_counter() - start)
        if event is not None:
            event.wait(torch.cuda.current_stream())

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until every step has run (been issued, on CUDA); see ``wait_layer``.

        Raises:
            TransferError: a step failed (cause chained). Raised once the link has
                retired the transfer, so no copy of it is still writing.
            TimeoutError: ``timeout_s`` passed first.
        """
        start = time.perf_counter()
        try:
            with self._cond:
                self._cond.wait_for(lambda: self._issued or self._finished, timeout_s)
                if self._error is not None and self._finished:
                    raise self._transfer_error("transfer failed")
                if not (self._issued or self._finished):
                    raise TimeoutError(f"{self.link_name}: transfer not done after {timeout_s} s")
                event = self._done_event
        finally:
            self._add_waited(time.perf_counter() - start)
        if event is not None:
            event.wait(torch.cuda.current_stream())

    def done(self) -> bool:
        """True once the transfer is finished (complete, or failed and retired).

        On CUDA "complete" means the device has run every copy. Never blocks.
        """
        with self._cond:
            return self._finished

    @property
    def failed(self) -> bool:
        """True if a step raised (the transfer may still be retiring)."""
        with self._cond:
            return self._error is not None

    @property
    def error(self) -> BaseException | None:
        """The exception the failing step raised, or None."""
        with self._cond:
            return self._error

    # ---- producer side (the executing link's worker only) ---------------------------------

    def finishing_layers(self, step_idx: int) -> list[int]:
        """Layers whose last covering step is ``step_idx`` (they become ready with it)."""
        return self._finishing[step_idx]

    def mark_queued(self) -> None:
        """Stamp ``queued_at``; called by the link when it accepts the transfer."""
        self.queued_at = time.perf_counter()

    def mark_started(self) -> None:
        """Stamp ``started_at``; called before the first step runs."""
        self.started_at = time.perf_counter()

    def step_done(self, step_idx: int, event: torch.cuda.Event | None = None) -> None:
        """Record that step ``step_idx`` ran; wakes waiters of layers it made ready.

        Args:
            step_idx: index into ``steps``; each step is reported once, in order.
            event: on CUDA, an event recorded on the link's stream right after the step;
                stored for the layers in ``finishing_layers(step_idx)``.
        """
        with self._cond:
            for layer in self._finishing[step_idx]:
                self._events[layer] = event
            for layer in self.steps[step_idx].layers:
                self._pending[layer] -= 1
            self._cond.notify_all()

    def fail(self, exc: BaseException) -> None:
        """Record the exception of a failed step (the first one wins).

        Waiters see it once the link calls ``mark_finished``.
        """
        with self._cond:
            if self._error is None:
                self._error = exc

    def mark_issued(self, done_event: torch.cuda.Event | None = None) -> None:
        """Record that every step ran (was issued, on CUDA); wakes ``wait`` callers.

        Args:
            done_event: on CUDA, an event recorded on the link's stream after the last step.
        """
        with self._cond:
            self._done_event = done_event
            self._issued = True
            self._cond.notify_all()

    def mark_finished(self) -> None:
        """Record that the transfer is finished; stamps ``finished_at``, wakes everyone."""
        with self._cond:
            self.finished_at = time.perf_counter()
            self._finished = True
            self._cond.notify_all()

    # ---- internals --------------------------------------------------------------------------

    def _check_layer(self, layer_idx: int) -> None:
        if not 0 <= layer_idx < self.num_layers:
            raise IndexError(f"layer_idx: must be in 0..{self.num_layers - 1}, got {layer_idx}")

    def _transfer_error(self, what: str) -> TransferError:
        """A new error for one waiter, chained to the step's exception (lock held)."""
        err = TransferError(f"{self.link_name}: {what}: a copy step raised {self._error!r}")
        err.__cause__ = self._error
        return err

    def _add_waited(self, seconds: float) -> None:
        with self._cond:
            self.waited_s += seconds
        if self._on_wait is not None:
            self._on_wait(seconds)
