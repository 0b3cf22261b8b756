"""Reading a whole value from the shared tier off the socket (``kvtier.tiers.remote``).

A chunk's value is ~12 MB. Through redis-py with hiredis, a reply that large is parsed
into a growing buffer and copied into a ``bytes`` object (6.9 ms of CPU a chunk, measured
below). ``read_value`` instead sends pipelined ``GETRANGE`` pieces on a connection taken
from redis-py's own pool (so AUTH, TLS, the database and the timeouts are redis-py's) and
reads each reply's bytes with ``recv_into`` straight into a reused buffer: 1.6 ms of CPU
and 3.8 ms wall a chunk against 6.9 ms and 8.6 ms (12 MB values, a 3-master loopback
cluster on this 2-core machine, 2026-12-02, ``/tmp/s3/raw2.py`` in that session's notes).

Anything but the expected replies (an error such as ``MOVED`` after a failover, a refused
connection) closes that connection and reads the value once more through redis-py, which
follows redirections and refreshes the cluster's slot map; a timeout is raised as it is.

Buffers: ``ReadBuffers`` lends the buffers reads land in; the caller owns a buffer from
``take`` until it gives it back. A read given up on (the caller's deadline passed)
may still be writing into its buffer: that buffer is never given back, so a late read
cannot write into one someone else holds. Thread-safe: each read takes its own
connection and buffer.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

READ_PIECE_NBYTES = 1 << 20
"""Bytes per ``GETRANGE``: with 1 MiB pieces pipelined a 12 MB value read in 3.8 ms, with
one ``GET`` in 10.8 ms (Redis writes one large reply in many small event-loop turns)."""

_LINE_NBYTES = 256  # a reply's first line: "$<length>" or an error such as "-MOVED …"


class WireError(Exception):
    """A reply that was not the bulk string expected (an error, a bad length)."""


class ReadBuffers:
    """Buffers lent to reads and given back, so a chunk's read does not touch fresh pages
    (~3.5 ms a chunk). ``take(n)`` lends the smallest idle buffer of at least ``n`` bytes,
    cut to ``n``; at most ``keep`` idle ones are kept. Thread-safe."""

    def __init__(self, keep: int = 4) -> None:
        self._keep = keep
        self._lock = threading.Lock()
        self._idle: list[np.ndarray] = []

    def reserve(self, nbytes: int, count: int) -> None:
        """Allocate and touch ``count`` idle buffers of ``nbytes`` now (at start)."""
        for _ in range(min(count, self._keep)):
            buffer = np.empty(nbytes, np.uint8)
            buffer.fill(0)  # written, so its pages are faulted in
            self.give(buffer)

    def take(self, nbytes: int) -> np.ndarray:
        """A buffer of ``nbytes`` (uninitialised: only what a read wrote is shown)."""
        with self._lock:
            fits = [i for i, b in enumerate(self._idle) if b.nbytes >= nbytes]
            if fits:
                best = min(fits, key=lambda i: self._idle[i].nbytes)
                return self._idle.pop(best)[:nbytes]
        return np.empty(nbytes, np.uint8)

    def give(self, buffer: np.ndarray) -> None:
        """Take back a buffer ``take`` lent; its holder must not use it any more."""
        whole = buffer if buffer.base is None else buffer.base
        assert isinstance(whole, np.ndarray)
        with self._lock:
            if len(self._idle) < self._keep:
                self._idle.append(whole)


def read_value(client: Any, key: str, nbytes: int, buffer: np.ndarray) -> int:
    """Read the value at ``key``, expected to be ``nbytes`` long, into ``buffer`` (at least
    ``nbytes + 1`` bytes: one byte past is asked for, so a longer value reads longer and a
    shorter one shorter); how many bytes the store held (0: no such key).

    Raises:
        what redis-py raises when the store is slow, down or refuses (``store_errors``).
    """
    from redis.exceptions import ConnectionError as StoreConnectionError

    if buffer.nbytes <= nbytes:
        raise ValueError(f"read_value: a {buffer.nbytes}-byte buffer for {nbytes} + 1 bytes")
    pieces = [
        (start, min(nbytes, start + READ_PIECE_NBYTES - 1))
        for start in range(0, nbytes + 1, READ_PIECE_NBYTES)
    ]
    try:
        return _read_off_socket(client, key, pieces, buffer)
    except (WireError, StoreConnectionError, ConnectionError):  # not a timeout: retry
        return _read_through_redis_py(client, key, pieces, buffer)


def _pool_of(client: Any, key: str) -> Any:
    """The redis-py connection pool of the node that serves ``key``."""
    if hasattr(client, "get_node_from_key"):  # RedisCluster
        return client.get_redis_connection(client.get_node_from_key(key)).connection_pool
    return client.connection_pool


def _read_off_socket(
    client: Any, key: str, pieces: list[tuple[int, int]], buffer: np.ndarray
) -> int:
    """Send the ``GETRANGE``\\ s on one pooled connection and read their bytes into
    ``buffer`` with ``recv_into``; how many were read. The connection goes back to the
    pool only when every reply was read whole; otherwise it is closed."""
    pool = _pool_of(client, key)
    conn = pool.get_connection()
    clean = False
    try:
        conn.send_packed_command(conn.pack_commands([("GETRANGE", key, a, b) for a, b in pieces]))
        sock = getattr(conn, "_sock", None)  # redis-py's socket: TLS-wrapped where configured
        if sock is None:
            raise WireError("this redis-py connection shows no socket")
        replies = _Replies(sock)
        view = buffer.data
        pos = 0
        for start, end in pieces:
            line = replies.line()
            if not line.startswith(b"$") or not line[1:].lstrip(b"-").isdigit():
                raise WireError(line[:120].decode(errors="replace"))
            length = int(line[1:])
            if not 0 <= length <= end - start + 1 or length > len(view) - pos:
                raise WireError(f"a GETRANGE reply of {length} bytes for {end - start + 1}")
            replies.into(view[pos : pos + length])
            pos += length
            if replies.line():
                raise WireError("a bulk reply not ended by CRLF")
        clean = replies.drained
        return pos
    finally:
        if not clean:
            conn.disconnect()
        pool.release(conn)


def _read_through_redis_py(
    client: Any, key: str, pieces: list[tuple[int, int]], buffer: np.ndarray
) -> int:
    """The same reads as a redis-py pipeline (which follows ``MOVED`` and refreshes the
    slot map); how many bytes were read into ``buffer``."""
    pipe = client.pipeline(transaction=False)
    for start, end in pieces:
        pipe.getrange(key, start, end)
    pos = 0
    for part in pipe.execute():
        if pos + len(part) > buffer.nbytes:
            raise WireError(f"GETRANGE replies longer than the {buffer.nbytes} bytes asked")
        buffer[pos : pos + len(part)] = np.frombuffer(part, np.uint8)
        pos += len(part)
    return pos


class _Replies:
    """RESP replies read off a socket: short lines through a small buffer, bulk bytes
    straight into the caller's memory. Not thread-safe (one read's)."""

    def __init__(self, sock: Any) -> None:
        self._sock = sock
        self._scratch = bytearray(_LINE_NBYTES)
        self._start = 0  # unread bytes are _scratch[_start:_end]
        self._end = 0

    @property
    def drained(self) -> bool:
        """True if nothing past the last reply was read (the connection can be reused)."""
        return self._start == self._end

    def line(self) -> bytes:
        """The next line, without its CRLF."""
        while True:
            at = self._scratch.find(b"\r\n", self._start, self._end)
            if at >= 0:
                out = bytes(self._scratch[self._start : at])
                self._start = at + 2
                return out
            if self._start:
                self._scratch[: self._end - self._start] = self._scratch[self._start : self._end]
                self._end -= self._start
                self._start = 0
            if self._end == len(self._scratch):
                raise WireError("a reply line longer than expected")
            got = self._sock.recv_into(memoryview(self._scratch)[self._end :])
            if not got:
                raise ConnectionResetError("the store closed the connection")
            self._end += got

    def into(self, out: memoryview) -> None:
        """Fill ``out`` with the next ``len(out)`` bytes."""
        have = min(len(out), self._end - self._start)
        out[:have] = self._scratch[self._start : self._start + have]
        self._start += have
        pos = have
        while pos < len(out):
            got = self._sock.recv_into(out[pos:])
            if not got:
                raise ConnectionResetError("the store closed the connection")
            pos += got
