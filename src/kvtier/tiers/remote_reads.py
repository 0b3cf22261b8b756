"""The shared tier's reads of chunk values (``kvtier.tiers.remote``), with read-ahead:
while one chunk is decoded and copied into host, the next ones are on their way.

``ValueReader.read`` reads one value (off the socket: ``remote_wire``), checks all of it
(``remote_format.decode``) and copies the chunk's bytes into the caller's buffer.

A promotion moves chunks from the store one at a time, in the order its link runs them
(``kvtier.moves.Move``); each read waits on the network, then decodes and copies on the
CPU. ``ReadAhead.plan`` is told that order; it keeps up to ``depth`` of the planned reads
running on the store's call pool, and ``take`` hands the read of a chunk to the tier when
its turn comes. On this 2-core machine, 16 chunks moved into host in 110 ms with two read
ahead against 140 ms one at a time (loopback 3-master cluster, 2026-12-02).

Buffers: each started read holds a buffer from ``ReadBuffers``. ``take`` hands it to the
caller, who gives it back. A read no one takes (its move was skipped, or a new plan
replaced the old) is dropped: its buffer goes back only once the read has finished, so a
late read never writes into a buffer someone else holds.

Thread-safety: every method of both classes is thread-safe (``ReadAhead`` has a lock;
each read has its own buffer and connection).
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch

from kvtier.codec import Codec, RawCodec
from kvtier.kv.chunk import ChunkRef
from kvtier.kv.keys import ChunkKey
from kvtier.kv.layout import KVLayout
from kvtier.tiers import remote_format
from kvtier.tiers.remote_client import Guard, Unavailable
from kvtier.tiers.remote_wire import ReadBuffers, read_value

Started = tuple[np.ndarray, "Future[int]"]
"""A read under way: its buffer and the call filling it (the bytes read)."""


class ReadAhead:
    """Up to ``depth`` reads of a plan running ahead of the reader.

    Args:
        start: starts reading ``ref``'s value into a buffer of ``nbytes`` (raises
            ``Unavailable`` while the store is down).
        nbytes_of: the buffer size a read of ``ref`` needs.
        buffers: where the buffers come from and go back to.
        depth: reads running ahead at most.
    """

    def __init__(
        self,
        start: Callable[[ChunkRef, np.ndarray], Future[int]],
        nbytes_of: Callable[[ChunkRef], int],
        buffers: ReadBuffers,
        depth: int = 2,
    ) -> None:
        self._start, self._nbytes_of, self._buffers, self.depth = start, nbytes_of, buffers, depth
        self._lock = threading.Lock()
        self._planned: deque[ChunkRef] = deque()  # not started yet, in order
        self._running: OrderedDict[ChunkKey, Started] = OrderedDict()  # started, in order

    @property
    def running(self) -> list[ChunkKey]:
        """The chunks whose reads were started and not taken, in plan order."""
        with self._lock:
            return list(self._running)

    def plan(self, refs: Sequence[ChunkRef]) -> None:
        """The chunks about to be read, in order; replaces the plan before (its reads not
        in this one are dropped) and starts the first ``depth``."""
        keys = {r.key for r in refs}
        with self._lock:
            for key in [k for k in self._running if k not in keys]:
                self._drop(key)
            self._planned = deque(r for r in refs if r.key not in self._running)
            self._top_up()

    def take(self, ref: ChunkRef) -> Started | None:
        """The read of ``ref`` if one was started (the caller waits on it and gives the
        buffer back); reads planned before it are dropped (their moves were skipped).
        None: not planned, or planned but not started (read it now)."""
        with self._lock:
            started = self._running.get(ref.key)
            if started is not None:
                for key in list(self._running):  # in plan order: those before were skipped
                    if key == ref.key:
                        break
                    self._drop(key)
                del self._running[ref.key]
            elif any(r.key == ref.key for r in self._planned):
                for key in list(self._running):  # all planned before it: skipped
                    self._drop(key)
                while self._planned.popleft().key != ref.key:
                    pass
            self._top_up()
            return started

    def clear(self) -> None:
        """Drop the plan and every read not taken."""
        with self._lock:
            self._planned.clear()
            for key in list(self._running):
                self._drop(key)

    def _drop(self, key: ChunkKey) -> None:
        """Forget a started read (under the lock); its buffer goes back once it finished."""
        buffer, future = self._running.pop(key)
        if future.done():
            self._buffers.give(buffer)
        else:
            future.add_done_callback(lambda _: self._buffers.give(buffer))

    def _top_up(self) -> None:
        """Start planned reads until ``depth`` run (under the lock)."""
        while self._planned and len(self._running) < self.depth:
            ref = self._planned.popleft()
            buffer = self._buffers.take(self._nbytes_of(ref))
            try:
                self._running[ref.key] = (buffer, self._start(ref, buffer))
            except Unavailable:
                self._buffers.give(buffer)
                self._planned.clear()


class ValueReader:
    """Reads chunk values from the store through ``guard`` (every call bounded by its
    timeout), ``depth`` of a plan ahead.

    Args:
        layout: the chunk layout.
        key_of: the Redis key of a ref's chunk.
        client: the redis-py client (connected on first use).
        guard: runs the calls.
        depth: reads running ahead of the reader at most.
        codec: the codec of the stored values (default ``raw``); decoded into ``out``.
    """

    def __init__(
        self,
        layout: KVLayout,
        key_of: Callable[[ChunkRef], str],
        client: Callable[[], Any],
        guard: Guard,
        depth: int = 2,
        codec: Codec | None = None,
    ) -> None:
        self.layout, self._key_of, self._client, self._guard = layout, key_of, client, guard
        self.codec = codec or RawCodec()
        self._buffers = ReadBuffers(keep=depth + 2)
        # Touched now, so no request pays the first touch of its read buffers.
        self._buffers.reserve(remote_format.max_value_nbytes(layout, self.codec) + 1, depth + 1)
        self._ahead = ReadAhead(self._start, self._nbytes, self._buffers, depth)

    def plan(self, refs: Sequence[ChunkRef]) -> None:
        """These chunks are read next, in this order (``ReadAhead.plan``)."""
        self._ahead.plan(refs)

    def clear(self) -> None:
        """Drop the plan and the reads no one took."""
        self._ahead.clear()

    def read(self, ref: ChunkRef, out: torch.Tensor) -> str:
        """Read ``ref``'s value and, if all of it checks out, copy the chunk into ``out``:
        ``"ok"``; ``"missing"`` (no such key, or the store is down or did not answer in
        time); ``"other"`` (an intact value of another chunk); ``"corrupt"``. Anything but
        ``"ok"`` leaves ``out`` untouched."""
        started = self._ahead.take(ref)
        if started is None:
            buffer = self._buffers.take(self._nbytes(ref))
            try:
                future: Future[int] | None = self._start(ref, buffer)
            except Unavailable:
                future = None
        else:
            buffer, future = started
        filled = 0
        if future is not None:
            try:
                filled = self._guard.wait(future)
            except Unavailable:  # given up on: the buffer goes back once the read ends
                future.add_done_callback(lambda _: self._buffers.give(buffer))
                return "missing"
        try:
            if not filled:
                return "missing"
            status, data = remote_format.decode(self.layout, ref, buffer.data[:filled], self.codec)
            if data is not None and self.codec.exact:
                out.view(torch.uint8).reshape(-1).numpy()[:] = np.frombuffer(data, np.uint8)
            elif data is not None:  # decoded on the reading thread (a link's worker)
                self.codec.decode_into(torch.frombuffer(data, dtype=torch.uint8), out)
            return status
        finally:
            self._buffers.give(buffer)

    def _nbytes(self, ref: ChunkRef) -> int:
        """The buffer a read of ``ref`` needs: its value and one byte past it."""
        return remote_format.value_nbytes(self.layout, ref, self.codec) + 1

    def _start(self, ref: ChunkRef, buffer: np.ndarray) -> Future[int]:
        """Start reading ``ref``'s value into ``buffer`` (``Unavailable`` while down)."""
        read = functools.partial(
            read_value, self._client(), self._key_of(ref), buffer.nbytes - 1, buffer
        )
        return self._guard.start(read)
