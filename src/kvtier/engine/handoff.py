"""The hand-off between the threads that submit requests and the engine's worker.

``Handoff`` owns the handles submitted and not yet taken by the worker, the worker's
published view of the scheduler's lines (which handles wait, run and wait to resume), and
the engine's life state (closing, dead). Every method is thread-safe: one condition
guards all of it; while held it calls out only to ``EngineMetrics`` (a leaf lock) and
``RequestHandle.cancel`` (sets an event).

Life of a handle here: ``put`` (any thread) → ``take`` (the worker moves it into the
scheduler's waiting line; it still counts as queued) → ``publish`` (the worker says where
the scheduler holds it now, after every change) → gone once the scheduler drops it.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from kvtier.engine.metrics import EngineMetrics
from kvtier.engine.request import EngineClosedError, QueueFullError, RequestHandle
from kvtier.engine.work import WorkModel


@dataclass(frozen=True)
class Occupancy:
    """Where the engine's requests are at one moment.

    Attributes:
        queued: submitted and not admitted yet (handed off or in the scheduler's line).
        running: admitted, being generated.
        resuming: preempted (or retried after a fault), waiting to run again.
    """

    queued: int
    running: int
    resuming: int


class Handoff:
    """A bounded queue of submitted requests, and the occupancy the worker publishes.

    Args:
        max_queued: requests that may wait for admission (handed off or in the
            scheduler's waiting line); a ``put`` beyond it raises ``QueueFullError``.
        max_running: sequences that may run at once (for the retry estimate).
        metrics: counts ``submitted`` and ``rejected``, under this object's lock, so a
            request is counted before the worker can see it.
        work: predicts each request's engine seconds (``kvtier.engine.work``).
        max_queue_s: admission by cost: a ``put`` whose predicted seconds, with those of
            every request queued, running or resuming, exceed this raises
            ``QueueFullError`` (a request with nothing ahead of it is always taken).
            None: no bound.
    """

    def __init__(
        self,
        max_queued: int,
        max_running: int,
        metrics: EngineMetrics,
        work: WorkModel | None = None,
        max_queue_s: float | None = None,
    ) -> None:
        self.max_queued = max_queued
        self.max_running = max_running
        self.metrics = metrics
        self.work = work or WorkModel()
        self.max_queue_s = max_queue_s
        self._cond = threading.Condition()
        self._pending: deque[RequestHandle] = deque()  # put, not yet taken by the worker
        self._waiting: list[RequestHandle] = []  # taken; in the scheduler's waiting line
        self._running: list[RequestHandle] = []
        self._resuming: list[RequestHandle] = []
        self._closing = False
        self._dead: str | None = None

    # ---- any thread ------------------------------------------------------------------------

    def put(self, handle: RequestHandle) -> None:
        """Queue a request for the worker and wake it.

        Raises:
            EngineClosedError: the engine is closing, or its worker died.
            QueueFullError: ``max_queued`` requests already wait, or the work ahead and
                its own would take longer than ``max_queue_s`` (with a retry estimate).
        """
        request = handle.request
        handle.predicted_s = self.work.predict_s(len(request.prompt_ids), request.params.max_tokens)
        with self._cond:
            if self._dead is not None:
                raise EngineClosedError(f"the engine's worker died ({self._dead})")
            if self._closing:
                raise EngineClosedError("the engine is shutting down and accepts no requests")
            queued = len(self._pending) + len(self._waiting)
            if queued >= self.max_queued:
                self.metrics.add("rejected")
                raise QueueFullError(
                    f"the request queue is full ({self.max_queued} waiting); retry later",
                    self._retry_after_s(queued),
                )
            if self.max_queue_s is not None:
                self._check_cost(handle.predicted_s, self.max_queue_s)
            self._pending.append(handle)
            self.metrics.add("submitted")
            self._cond.notify_all()

    def occupancy(self) -> Occupancy:
        """How many requests are queued, running and waiting to resume (one snapshot)."""
        with self._cond:
            queued = len(self._pending) + len(self._waiting)
            return Occupancy(queued, len(self._running), len(self._resuming))

    @property
    def closing(self) -> bool:
        """``close`` has been called: no more requests are accepted."""
        with self._cond:
            return self._closing

    @property
    def dead_reason(self) -> str | None:
        """Why the worker died (None while it lives)."""
        with self._cond:
            return self._dead

    def close(self, cancel: bool) -> bool:
        """Refuse further requests; with ``cancel`` also cancel every known request.
        Wakes the worker. Returns True on the first call, False when already closing."""
        with self._cond:
            first = not self._closing
            self._closing = True
            if cancel:
                self._cancel_all()
            self._cond.notify_all()
            return first

    def cancel_all(self) -> None:
        """Cancel every queued, running and preempted request (they end at the worker's
        next step) and wake the worker."""
        with self._cond:
            self._cancel_all()
            self._cond.notify_all()

    # ---- the worker ------------------------------------------------------------------------

    def wait(self, busy: bool) -> bool:
        """Block until a request is pending, the scheduler is ``busy`` or the engine closes.

        Returns False when the worker should stop: closing, nothing pending, not busy."""
        with self._cond:
            while not self._pending and not busy and not self._closing:
                self._cond.wait()
            return bool(self._pending) or busy

    def take(self) -> list[RequestHandle]:
        """Every pending handle, oldest first; they count as queued until ``publish``."""
        with self._cond:
            taken = list(self._pending)
            self._pending.clear()
            self._waiting.extend(taken)
            return taken

    def publish(
        self,
        waiting: Iterable[RequestHandle],
        running: Iterable[RequestHandle],
        resuming: Iterable[RequestHandle],
    ) -> None:
        """Record the scheduler's lines (for ``occupancy``, the queue bound and cancels)."""
        with self._cond:
            self._waiting, self._running, self._resuming = (
                list(waiting),
                list(running),
                list(resuming),
            )

    def kill(self, reason: str) -> list[RequestHandle]:
        """The worker is dying: refuse requests from now on, naming ``reason``; returns
        every request not yet ended (the caller fails them)."""
        with self._cond:
            self._dead = reason
            left = [*self._pending, *self._waiting, *self._running, *self._resuming]
            self._pending.clear()
            return left

    # ---- under the lock --------------------------------------------------------------------

    def _cancel_all(self) -> None:
        for handle in (*self._pending, *self._waiting, *self._running, *self._resuming):
            handle.cancel()

    def _check_cost(self, predicted_s: float, max_queue_s: float) -> None:
        """Refuse a request whose predicted seconds, after the work ahead, exceed the
        bound; the retry comes when the work ahead has drained enough to take it."""
        lines = (self._pending, self._waiting, self._running, self._resuming)
        ahead_s = sum(h.predicted_s for line in lines for h in line)
        if ahead_s == 0 or ahead_s + predicted_s <= max_queue_s:
            return
        self.metrics.add("rejected")
        raise QueueFullError(
            f"the server is at capacity: the requests ahead are predicted to take "
            f"{ahead_s:.0f} s and this one {predicted_s:.1f} s, more than the "
            f"{max_queue_s:g} s queue bound; retry later",
            max(1, min(600, math.ceil(ahead_s + predicted_s - max_queue_s))),
        )

    def _retry_after_s(self, queued: int) -> int:
        """Seconds until the queue has likely moved on by one admission (for 429s)."""
        service = self.metrics.service_s or 1.0
        waits = (queued + 1) / max(1, self.max_running)
        return max(1, min(600, math.ceil(service * waits)))
