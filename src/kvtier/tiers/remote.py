"""The shared tier: chunks in Redis (a Redis Cluster, or one server) that every kvtier
instance pointed at it reads and writes.

Keys and values are ``kvtier.tiers.remote_format``'s: keys carry the layout and the chunk
key (which digests model, layout and tenant salt), values a checksummed header. Unlike the
slot tiers there is no local index: Redis is the index, so a chunk another instance wrote
is found here.

- **Reads** (``contains``, ``get_into``) go to the store on the calling thread (a link's
  worker, or a lookup). ``contains`` reads only a value's header (``GETRANGE``), so it
  checks the token ids; ``get_into`` checks everything. A value that fails its checks is
  deleted, counted (``corrupt_dropped``) and read as a miss.
- **Writes** are write-behind: ``write_behind`` queues refs of chunks host stored (never
  blocking; a full queue drops its oldest and counts it in ``writes_dropped``); one writer
  thread (``remote_writes``) first asks the store which of a batch it holds (their headers,
  in one pipeline; a held key's TTL is renewed), then reads the others from host (pinned
  while they are encoded) and pipelines their ``SET``\\ s with the TTL. ``put`` (a move
  down the stack) writes at once, also skipping what the store holds. Chunks another
  instance wrote are never sent again (``duplicate_puts``).
- **Faults**: every call has ``timeout_s``. A call that fails (slow, refused, cluster down,
  no quorum) counts in ``io_errors`` and marks the tier down for ``retry_after_s``: calls
  in that window return at once (misses; writes dropped and counted), so a request waits at
  most one timeout before its KV is recomputed. One warning when the tier goes down and one
  line when a call succeeds again, not one per request. The client reconnects by itself.

- **Size cap**: ``capacity_bytes`` bounds the bytes of the values *this instance* wrote
  and still holds there (its own LRU, refreshed by its reads): past it, the least recently
  used of them are deleted. Every instance caps its own writes, so the store holds at most
  the sum of their caps (plus what a restarted instance wrote before, which only the TTL
  bounds). Redis's ``maxmemory`` policy still bounds the store as a whole.

Not in Redis: pins (host pins what it serves), ``refs`` and ``used_bytes`` of the whole
store (a shared store is not listed; ``len`` scans it; ``used_bytes`` is this instance's
share).

Thread-safety: every method is thread-safe (redis-py's clients pool their connections;
the counters and the queue have locks).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from kvtier.config import RemoteConfig
from kvtier.kv.chunk import Chunk, ChunkRef
from kvtier.kv.layout import KVLayout
from kvtier.tiers import remote_format
from kvtier.tiers.base import Tier
from kvtier.tiers.pool import PoolTier
from kvtier.tiers.remote_client import Guard, Unavailable, connect, ping_every_node, store_errors
from kvtier.tiers.remote_reads import ValueReader
from kvtier.tiers.remote_writes import BehindSource, OwnedValues, WriteBehindQueue
from kvtier.tiers.types import ChunkReader, PutResult

log = logging.getLogger(__name__)

# SETs per pipeline of the writer: at most 8, and at most 16 MiB of values (at least one
# chunk), so one call's bytes stay within what ``timeout_s`` allows at a modest rate
# (eight 12 MB chunks of the embedded model took over 0.5 s on a loaded machine).
_BATCH_CHUNKS = 8
_BATCH_BYTES = 16 << 20
_READ_AHEAD = 2  # chunk reads running ahead of a promotion (remote_reads)


class RemoteTier(Tier):
    """A Redis-backed tier (see the module docstring).

    Args:
        layout: the chunk layout.
        config: the store's URL, keys, TTL, timeouts and queue.
    """

    takes_write_behind = True

    def __init__(self, layout: KVLayout, config: RemoteConfig) -> None:
        super().__init__("remote", layout, config.capacity_bytes, codec=config.codec)
        if config.capacity_bytes < self.stored_chunk_nbytes:
            minimum_mb = -(-self.stored_chunk_nbytes // (1 << 20))
            raise ValueError(
                f"remote.capacity_bytes (--remote-mb): {config.capacity_bytes} bytes holds no "
                f"chunk; give at least {self.stored_chunk_nbytes} (--remote-mb {minimum_mb})"
            )
        self.config = config
        self._client: Any = None
        self._client_lock = threading.Lock()
        self._ttl_ms = None if config.ttl_s is None else max(1, int(config.ttl_s * 1000))
        self._guard = Guard(config.url, config.timeout_s, config.retry_after_s, self._count_error)
        self._call = self._guard.call
        self._behind = BehindSource(layout)  # where write-behind reads (host, then fallback)
        batch_chunks = max(1, min(_BATCH_CHUNKS, _BATCH_BYTES // self.stored_chunk_nbytes))
        self._queue = WriteBehindQueue(self._write_batch, config.write_behind_chunks, batch_chunks)
        # The values this instance wrote, least recently used first: key -> value bytes
        # (under self._lock; the size cap deletes from the front).
        self._owned = OwnedValues(config.capacity_bytes)
        self._reader = ValueReader(
            layout, self.key, lambda: self.client, self._guard, _READ_AHEAD, self.codec
        )
        with contextlib.suppress(Unavailable):  # connect now: one clear line if it cannot
            self._call(lambda: ping_every_node(self.client))

    @property
    def client(self) -> Any:
        """The redis-py client, connected on first use (a store down at start is a store
        down: calls fail, the tier backs off, and a later call connects)."""
        if self._client is None:
            with self._client_lock:
                if self._client is None:
                    self._client = connect(self.config)
        return self._client

    def _count_error(self) -> None:
        with self._lock:
            self._stats.io_errors += 1

    def key(self, ref: ChunkRef) -> str:
        """The Redis key of ``ref``'s chunk."""
        return remote_format.chunk_key(self.config.key_prefix, self.layout, ref, self.codec)

    @property
    def available(self) -> bool:
        """False while the tier is down (a call failed less than ``retry_after_s`` ago)."""
        return self._guard.available

    # ---- reads -------------------------------------------------------------------------

    def contains(self, ref: ChunkRef) -> bool:
        """True if the store holds ``ref``'s chunk with these token ids (reads its header;
        False while the tier is down). Does not count as use."""
        return self.contains_many([ref])[0]

    def contains_many(self, refs: Sequence[ChunkRef]) -> list[bool]:
        """``contains`` of each ref, in one pipelined call (all False while it is down)."""
        try:
            return self._held(refs, renew=False)
        except Unavailable:
            return [False] * len(refs)

    def _held(self, refs: Sequence[ChunkRef], renew: bool = True) -> list[bool]:
        """Whether the store holds each chunk with these token ids: every header read in
        one pipelined call. With a TTL and ``renew``, the keys held live one TTL more from
        now (they are in use). Raises ``Unavailable`` while the tier is down."""
        renew = renew and self._ttl_ms is not None

        def read() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for ref in refs:
                key = self.key(ref)
                pipe.getrange(key, 0, remote_format.header_nbytes(ref) - 1)
                if renew:
                    pipe.pexpire(key, self._ttl_ms)
            return list(pipe.execute())

        replies = self._call(read) if refs else []
        heads = replies[:: 2 if renew else 1]
        return [
            bool(h) and remote_format.names(self.layout, r, h, self.codec)
            for r, h in zip(refs, heads, strict=True)
        ]

    def get_into(
        self, refs: Sequence[ChunkRef], outs: Sequence[torch.Tensor], *, as_use: bool = True
    ) -> list[bool]:
        """Copy chunks from the store into caller-owned buffers; a miss, a value of another
        chunk (a collision) or a corrupt one (deleted) leaves its buffer untouched. While
        the tier is down every read is a miss. Blocks for the reads."""
        if len(refs) != len(outs):
            raise ValueError(f"get_into: {len(refs)} refs but {len(outs)} output buffers")
        return [self.read(r, o, as_use=as_use) == "ok" for r, o in zip(refs, outs, strict=True)]

    def read_ahead(self, refs: Sequence[ChunkRef]) -> None:
        """Hint: these chunks are read next, in this order; the first few start now
        (``remote_reads``)."""
        self._reader.plan(refs)

    def read(self, ref: ChunkRef, out: torch.Tensor, *, as_use: bool = True) -> str:
        """One chunk into ``out`` (see ``get_into``): ``"ok"``, ``"missing"`` (no such key,
        another chunk's value, or the tier is down) or ``"corrupt"`` (deleted). One read
        of the store: the header is checked with the rest."""
        start = time.perf_counter()
        key = self.key(ref)
        status = self._reader.read(ref, out)
        elapsed = time.perf_counter() - start
        with self._lock:
            ok = status == "ok"
            self._stats.collisions += status == "other"
            self._stats.corrupt_dropped += status == "corrupt"
            self._stats.hits += ok and as_use
            self._stats.misses += (not ok) and as_use
            if ok and as_use:
                self._stats.bytes_out += self.stored_chunk_nbytes
                self._stats.get_seconds += elapsed
            if ok:
                self._owned.touch(key)
        if status == "corrupt":
            self.remove([ref])
        return "missing" if status == "other" else status

    # ---- writes ------------------------------------------------------------------------

    def put(self, chunks: Sequence[Chunk]) -> PutResult:
        """Write chunks to the store now (a move down the stack), pipelined; chunks it
        holds are left as they are. While the tier is down they are skipped and counted
        (``writes_skipped``). The caller keeps ``chunk.data``."""
        result = PutResult()
        # While the tier is down none counts as held: the write below is skipped and counted.
        held = self._duplicates([c.ref for c in chunks]) or [False] * len(chunks)
        todo = [c for c, h in zip(chunks, held, strict=True) if not h]
        result.already_present.extend(c.key for c, h in zip(chunks, held, strict=True) if h)
        encoded = [(c.ref, self._value(c.ref, c.data)) for c in todo]
        if todo and self._write(encoded):
            result.stored.extend(c.key for c in todo)
        return result

    def write_behind(
        self, refs: Iterable[ChunkRef], source: Tier, fallback: ChunkReader | None = None
    ) -> None:
        """Queue chunks that ``source`` (host) holds, to be read from it and written by the
        writer thread; one that left host meanwhile is read through ``fallback`` (the tiers
        and write-back queues between, ``KVManager``), so a burst that overruns host still
        reaches the store. Never blocks: past ``write_behind_chunks`` the oldest waiting
        ref is dropped and counted (``writes_dropped``)."""
        if not isinstance(source, PoolTier):
            raise ValueError(f"write_behind: the source must be a memory pool, not {source.name}")
        self._behind.use(source, fallback)
        dropped = self._queue.offer(refs)
        if dropped:
            with self._lock:
                self._stats.writes_dropped += dropped

    def sync(self) -> None:
        """Wait until the write-behind queue has drained (at most one timeout per waiting
        chunk)."""
        self._queue.sync(self.config.timeout_s)

    def _duplicates(self, refs: Sequence[ChunkRef]) -> list[bool] | None:
        """Which refs the store holds already (another instance wrote them), counted in
        ``duplicate_puts``; None while the tier is down."""
        try:
            held = self._held(refs)
        except Unavailable:
            return None
        with self._lock:
            self._stats.duplicate_puts += sum(held)
        return held

    def _write_batch(self, refs: list[ChunkRef]) -> None:
        """The writer thread's step: encode ``refs`` where they are (``BehindSource``), then
        write them. Chunks the store holds already are not sent again."""
        if self._behind.host is None:
            return
        held = self._duplicates(refs)
        if held is None:
            with self._lock:
                self._stats.writes_skipped += len(refs)
            return
        refs = [r for r, h in zip(refs, held, strict=True) if not h]
        values = self._behind.encode_each(refs, self._value)
        gone = len(refs) - len(values)
        if gone:
            with self._lock:
                self._stats.writes_dropped += gone  # left host before it was written
        if values:
            self._write(values)

    def _value(self, ref: ChunkRef, data: torch.Tensor) -> bytes:
        """``ref``'s value, encoded on the calling thread (the writer, or a link's worker)."""
        stored = data if self.codec.exact else self.codec.encode(data.detach(), self.layout)
        return remote_format.encode(self.layout, ref, _bytes_of(stored), self.codec)

    def _write(self, values: list[tuple[ChunkRef, bytes]]) -> bool:
        """``SET`` each encoded value with the TTL, in one pipeline; False (counted as
        skipped) when the store did not take them."""
        start = time.perf_counter()

        def send() -> None:
            pipe = self.client.pipeline(transaction=False)
            for ref, value in values:
                pipe.set(self.key(ref), value, px=self._ttl_ms)
            pipe.execute()

        try:
            self._call(send)
        except Unavailable:
            with self._lock:
                self._stats.writes_skipped += len(values)
            return False
        with self._lock:
            self._stats.puts += len(values)
            self._stats.bytes_in += len(values) * self.stored_chunk_nbytes
            self._stats.put_seconds += time.perf_counter() - start
            victims = self._owned.record([(self.key(r), len(v)) for r, v in values])
            self._stats.evictions += len(victims)
        if victims:
            self._delete(victims)
        return True

    def _delete(self, keys: list[str]) -> int:
        """``DEL`` keys (one call each: a cluster's keys lie in different slots); how many
        the store held (0 while it is down)."""
        with self._lock:
            for key in keys:
                self._owned.forget(key)
        try:
            return int(sum(self._call(functools.partial(self.client.delete, k)) for k in keys))
        except Unavailable:
            return 0

    # ---- the rest of the interface -------------------------------------------------------

    def pin(self, refs: Iterable[ChunkRef]) -> list[bool]:
        """Nothing is pinned in a shared store: whether each chunk is held."""
        return self.contains_many(list(refs))

    def unpin(self, refs: Iterable[ChunkRef]) -> None:
        return None

    def remove(self, refs: Iterable[ChunkRef]) -> int:
        """Delete chunks from the store; returns how many it held."""
        keys = [self.key(r) for r in refs]
        return self._delete(keys) if keys else 0

    def clear(self) -> None:
        """Delete every chunk of this layout under the prefix (every instance's)."""
        pattern = remote_format.layout_pattern(self.config.key_prefix, self.layout, self.codec)
        try:
            keys = self._call(lambda: list(self.client.scan_iter(match=pattern, count=500)))
        except Unavailable:
            return
        self._delete([k.decode() if isinstance(k, bytes) else k for k in keys])

    @property
    def used_bytes(self) -> int:
        """Bytes of the values this instance wrote and still holds in the store (its share,
        which ``capacity_bytes`` caps; the whole store's is in its ``INFO memory``)."""
        with self._lock:
            return self._owned.nbytes

    def __len__(self) -> int:
        """Chunks of this layout under the prefix, every instance's (a ``SCAN`` of the
        store: slow on a large one; 0 while it is down)."""
        pattern = remote_format.layout_pattern(self.config.key_prefix, self.layout, self.codec)
        try:
            return self._call(lambda: sum(1 for _ in self.client.scan_iter(match=pattern)))
        except Unavailable:
            return 0

    def refs(self) -> list[ChunkRef]:
        return []

    def close(self) -> None:
        """Drain the write-behind queue (bounded by the timeouts), stop the writer, close
        the client."""
        self.sync()
        self._reader.clear()
        self._queue.close(join_timeout_s=self.config.timeout_s * (self._queue.batch_chunks + 1))
        self._guard.close()
        if self._client is not None:
            with contextlib.suppress(*store_errors()):
                self._client.close()

    # ---- Tier's slot storage: unused (Redis is the index) -------------------------------

    def _alloc_slot(self) -> int | None:
        raise NotImplementedError("the remote tier has no slots")

    def _free_slot(self, slot: int) -> None:
        raise NotImplementedError("the remote tier has no slots")

    def _write_slot(self, slot: int, chunk: Chunk) -> None:
        raise NotImplementedError("the remote tier has no slots")

    def _read_slot(self, slot: int, ref: ChunkRef, out: torch.Tensor) -> bool:
        raise NotImplementedError("the remote tier has no slots")

    def _victim_data(self, slot: int) -> torch.Tensor | None:
        raise NotImplementedError("the remote tier has no slots")


def _bytes_of(data: torch.Tensor) -> memoryview:
    """A chunk tensor's bytes, without a copy where it is contiguous."""
    return data.detach().contiguous().view(torch.uint8).reshape(-1).numpy().data
