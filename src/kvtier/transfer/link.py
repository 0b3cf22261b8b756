"""Links: copy engines between adjacent tiers, each with its own worker and FIFO queue.

A link runs the copy steps it is given, in submission order, on one daemon worker thread;
it knows nothing of tiers. ``submit`` returns a ``TransferHandle`` with per-layer
readiness, and blocks while the link already has ``max_inflight_bytes`` submitted but not
finished (back-pressure instead of overload; DESIGN §4.2).

On CUDA the worker runs the steps inside a dedicated ``torch.cuda.Stream``; it waits for
what the submitting thread had enqueued on its current stream before ``submit``, records
an event per layer, and counts a transfer as finished (its bytes no longer in flight) when
the device has run it. On the CPU the worker does the copies itself, optionally paced by a
``Throttle`` to model a slower link.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from kvtier.transfer.handle import TransferHandle
from kvtier.transfer.link_stats import LinkStats
from kvtier.transfer.steps import CopyStep
from kvtier.transfer.throttle import Throttle, ThrottleClock, sleep_until


@dataclass
class _Issued:
    """A CUDA transfer whose copies are enqueued but perhaps not yet run."""

    handle: TransferHandle
    start_event: torch.cuda.Event
    done_event: torch.cuda.Event


class Link:
    """A copy engine with one worker thread and a FIFO queue of transfers.

    Every public method is thread-safe. Buffers touched by the steps belong to the
    submitter, who keeps them alive and unchanged until the handle is ``done()``.

    Args:
        name: what the link connects, for reports, e.g. ``"host->device"``.
        max_inflight_bytes: bound on bytes submitted but not finished (>= 1). A single
            transfer larger than the bound is accepted when nothing else is in flight.
        throttle: pace the steps to this link model; None runs them at full speed.
        device: a CUDA device runs the steps on a dedicated CUDA stream; None or a CPU
            device runs them on the worker thread.
    """

    def __init__(
        self,
        name: str,
        max_inflight_bytes: int,
        throttle: Throttle | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        if max_inflight_bytes < 1:
            raise ValueError(f"{name}.max_inflight_bytes: must be >= 1, got {max_inflight_bytes}")
        self.name = name
        self.max_inflight_bytes = int(max_inflight_bytes)
        self.throttle = throttle
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.is_cuda = self.device.type == "cuda"
        self.stream: torch.cuda.Stream | None = (
            torch.cuda.Stream(device=self.device) if self.is_cuda else None
        )
        self._clock = ThrottleClock(throttle) if throttle is not None else None
        self._cond = threading.Condition()
        # Admitted transfers with, on CUDA, the event recorded on the submitter's stream.
        self._queue: deque[tuple[TransferHandle, torch.cuda.Event | None]] = deque()
        self._current: TransferHandle | None = None  # being executed (worker thread only)
        self._submitters: deque[object] = deque()  # blocked submit() calls, FIFO
        self._issued: deque[_Issued] = deque()  # worker thread only
        self._inflight_bytes = 0
        self._closed = False
        self._stats = LinkStats()
        self._thread = threading.Thread(target=self._work, name=f"kvtier-link-{name}", daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        return f"Link({self.describe()})"

    def __enter__(self) -> Link:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- public API -------------------------------------------------------------------------

    def describe(self) -> str:
        """Whether the link is real or throttled, e.g. ``"host->device: real (cpu thread)"``.

        Every report that quotes link numbers must include this line.
        """
        if self.throttle is not None:
            mode = self.throttle.describe()
            if self.is_cuda:
                mode += f" (cuda stream on {self.device})"
        elif self.is_cuda:
            mode = f"real (cuda stream on {self.device})"
        else:
            mode = "real (cpu thread)"
        return f"{self.name}: {mode}"

    @property
    def inflight_bytes(self) -> int:
        """Bytes submitted but not finished now."""
        with self._cond:
            return self._inflight_bytes

    def submit(
        self, steps: Sequence[CopyStep], num_layers: int, timeout_s: float | None = None
    ) -> TransferHandle:
        """Queue a transfer; blocks while the in-flight bound leaves no room for it.

        Blocked submitters are admitted in arrival order. On CUDA the copies will see
        everything the calling thread had enqueued on its current stream before this call.
        Mutates the queue and the in-flight count.

        Args:
            steps: copy steps, run in this order after every earlier transfer's steps.
            num_layers: layers to track readiness for (see ``TransferHandle``).
            timeout_s: give up after this many seconds of back-pressure (None: never).

        Returns:
            The transfer's handle.

        Raises:
            RuntimeError: the link is closed (also when it closes while this call waits).
            TimeoutError: ``timeout_s`` passed before there was room.
            ValueError: a step covers a layer outside ``range(num_layers)``.
        """
        handle, ready_event = self._new_handle(steps, num_layers)
        start = time.perf_counter()
        token = object()
        with self._cond:
            self._check_open()
            self._submitters.append(token)
            try:
                admitted = self._cond.wait_for(
                    lambda: (
                        self._closed or (self._submitters[0] is token and self._fits(handle.nbytes))
                    ),
                    timeout_s,
                )
                self._check_open()
                if not admitted:
                    raise TimeoutError(
                        f"{self.name}: no room for {handle.nbytes} bytes after {timeout_s} s "
                        f"({self._inflight_bytes} of {self.max_inflight_bytes} in flight)"
                    )
            finally:
                self._submitters.remove(token)
                self._stats.submit_blocked_s += time.perf_counter() - start
                self._cond.notify_all()
            self._admit(handle, ready_event)
        return handle

    def try_submit(self, steps: Sequence[CopyStep], num_layers: int) -> TransferHandle | None:
        """Like ``submit`` but never blocks: None when the transfer does not fit now.

        Also None while other ``submit`` calls are waiting (they go first).

        Raises:
            RuntimeError: the link is closed.
        """
        handle, ready_event = self._new_handle(steps, num_layers)
        with self._cond:
            self._check_open()
            if self._submitters or not self._fits(handle.nbytes):
                return None
            self._admit(handle, ready_event)
        return handle

    def stats(self) -> LinkStats:
        """A consistent copy of the counters."""
        with self._cond:
            return dataclasses.replace(self._stats)

    def close(self, timeout_s: float | None = None) -> None:
        """Stop accepting transfers, let the worker finish the queued ones, and join it.

        Idempotent. Blocks until the queue is drained (or ``timeout_s`` passes); a
        ``submit`` blocked by back-pressure raises ``RuntimeError``. Called from inside a
        step, it does not join (that would deadlock).
        """
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    @property
    def closed(self) -> bool:
        with self._cond:
            return self._closed

    # ---- submission internals -----------------------------------------------------------

    def _new_handle(
        self, steps: Sequence[CopyStep], num_layers: int
    ) -> tuple[TransferHandle, torch.cuda.Event | None]:
        handle = TransferHandle(steps, num_layers, self.name, on_wait=self._add_wait_s)
        ready_event = None
        if self.is_cuda:
            # Orders the copies after the submitter's work (e.g. the KV it just wrote).
            ready_event = torch.cuda.Event()
            ready_event.record(torch.cuda.current_stream(self.device))
        return handle, ready_event

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"link {self.name}: closed; create a new Link to submit again")

    def _fits(self, nbytes: int) -> bool:
        return self._inflight_bytes == 0 or self._inflight_bytes + nbytes <= self.max_inflight_bytes

    def _admit(self, handle: TransferHandle, ready_event: torch.cuda.Event | None) -> None:
        """Enqueue an admitted transfer (lock held)."""
        self._inflight_bytes += handle.nbytes
        self._stats.max_inflight_bytes_seen = max(
            self._stats.max_inflight_bytes_seen, self._inflight_bytes
        )
        handle.mark_queued()
        self._queue.append((handle, ready_event))
        self._cond.notify_all()

    def _add_wait_s(self, seconds: float) -> None:
        with self._cond:
            self._stats.wait_s += seconds

    # ---- the worker ---------------------------------------------------------------------

    def _work(self) -> None:
        try:
            with self._cuda_context():
                while True:
                    with self._cond:
                        while not (self._queue or self._issued or self._closed):
                            self._cond.wait()
                        if not (self._queue or self._issued):
                            return  # closed and drained
                        job = self._queue.popleft() if self._queue else None
                    if job is not None:
                        self._current = job[0]
                        self._execute(*job)
                        self._current = None
                    # With nothing new to issue, block on the oldest issued transfer.
                    self._retire_issued(block=job is None)
        except BaseException as exc:  # a bug here must not leave waiters hanging
            self._abort(exc)
            raise

    @contextlib.contextmanager
    def _cuda_context(self) -> Iterator[None]:
        if self.stream is None:
            yield
            return
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            yield

    def _execute(self, handle: TransferHandle, ready_event: torch.cuda.Event | None) -> None:
        """Run one transfer's steps in order; retire it now (CPU) or queue it (CUDA)."""
        start_event = None
        if self.stream is not None:
            if ready_event is not None:
                self.stream.wait_event(ready_event)
            start_event = torch.cuda.Event(enable_timing=True)
            start_event.record(self.stream)
        handle.mark_started()
        ok = True
        for i, step in enumerate(handle.steps):
            if step.skip is not None and step.skip():
                handle.step_done(i, self._layers_event(handle, i))
                continue
            t0 = time.perf_counter()
            deadline_s = self._clock.reserve(step.nbytes, t0) if self._clock is not None else None
            try:
                step.run()
                if deadline_s is not None:
                    if self.stream is not None:
                        self.stream.synchronize()  # pace what the device did, not the issue
                    sleep_until(deadline_s)
            except Exception as exc:
                handle.fail(exc)
                ok = False
            elapsed_s = time.perf_counter() - t0
            with self._cond:
                if self.stream is None:
                    self._stats.busy_s += elapsed_s
                if ok:
                    self._stats.steps += 1
                    self._stats.bytes += step.nbytes
            if not ok:
                break  # the rest of a failed transfer is skipped
            handle.step_done(i, self._layers_event(handle, i))
        if self.stream is None or start_event is None:
            if ok:
                handle.mark_issued()
            self._retire(handle, busy_s=0.0)
            return
        done_event = torch.cuda.Event(enable_timing=True)
        done_event.record(self.stream)
        if ok:
            handle.mark_issued(done_event)
        self._issued.append(_Issued(handle, start_event, done_event))

    def _layers_event(self, handle: TransferHandle, step_idx: int) -> torch.cuda.Event | None:
        """On CUDA, an event after step ``step_idx`` where it completes layers."""
        if self.stream is None or not handle.finishing_layers(step_idx):
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def _retire_issued(self, block: bool) -> None:
        """Retire CUDA transfers the device has run; with ``block``, wait for the oldest."""
        while self._issued:
            issued = self._issued[0]
            if not issued.done_event.query():
                if not block:
                    return
                try:
                    issued.done_event.synchronize()
                except Exception as exc:
                    issued.handle.fail(exc)
            block = False
            self._issued.popleft()
            try:
                busy_s = issued.start_event.elapsed_time(issued.done_event) / 1e3
            except RuntimeError:  # the stream failed; the handle already carries the error
                busy_s = 0.0
            self._retire(issued.handle, busy_s)

    def _retire(self, handle: TransferHandle, busy_s: float) -> None:
        """Finish a transfer: release its bytes, count it, wake its waiters and submitters."""
        with self._cond:
            self._inflight_bytes -= handle.nbytes
            self._stats.transfers += 1
            self._stats.busy_s += busy_s
            if handle.failed:
                self._stats.failed += 1
            handle.mark_finished()
            self._cond.notify_all()

    def _abort(self, exc: BaseException) -> None:
        """Fail every transfer still held after the worker itself crashed."""
        with self._cond:
            self._closed = True
            pending = [i.handle for i in self._issued] + [h for h, _ in self._queue]
            if self._current is not None and not self._current.done():
                pending.insert(0, self._current)
            self._issued.clear()
            self._queue.clear()
        for handle in pending:
            handle.fail(exc)
            self._retire(handle, busy_s=0.0)
