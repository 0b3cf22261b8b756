"""The disk tier: chunks in fixed-size slots of segment files, checksummed, restart-safe.

On-disk format. One directory per tier; segment ``k`` of a layout is the file
``{layout.fingerprint()}.s{segment_slots}.{k:05d}.kvseg``, which holds the slots
``k * segment_slots ...`` back to back, each ``slot_nbytes`` long::

    slot = [header block: header_nbytes, a multiple of 4096][chunk bytes, padded to 4096]

The header (little-endian, see ``_FIXED``) holds a magic, its own xxh3_64 checksum, the
format version, a sequence number (monotonic per directory), the slot's own index, the
chunk's byte length and xxh3_64, the layout fingerprint, the key and the token ids (int64).
A slot goes down in positioned writes (O_DIRECT where the filesystem takes it): one write
of header and data when the slot is at most ``PIECE_NBYTES`` of data, else the header with
the first piece while I/O threads write the others. Either way a torn or partial write
reads as a bad header checksum or a bad data hash, never as wrong KV. An all-zero header is
a free slot: eviction zeroes the header so a restart does not bring the chunk back, and
should two headers ever name one key, the higher sequence number wins. Files grow as slots
are first written; a scan at open stops at each file's end. A lock file
(``{fingerprint}.lock``, ``flock``) keeps a second process off the same segments.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import heapq
import logging
import mmap
import os
import re
import struct
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import numpy as np
import torch
import xxhash

from kvtier.kv.chunk import Chunk, ChunkRef
from kvtier.kv.layout import KVLayout
from kvtier.tiers.base import EvictHook, PutResult, Tier, _Entry

log = logging.getLogger(__name__)

ALIGN = 4096  # O_DIRECT alignment of buffers, offsets and lengths (512 B and 4 KiB disks)
MAGIC = b"KVTSLOT\x00"
FORMAT_VERSION = 1
MAX_KEY_NBYTES = 64
# magic, header checksum, version, header_nbytes, seq, slot, data_nbytes, data_hash,
# num_tokens, key length, fingerprint length, key, fingerprint; the token ids follow.
_FIXED = struct.Struct("<8sQIIQQQQIHH64s128s")
# Large slots move in pieces: a thread copies and hashes one piece while the I/O threads
# move others, so the memory work hides behind the disk instead of adding to it.
PIECE_NBYTES = 1 << 20
IO_THREADS = 4
_CHECKSUMMED_FROM = 16  # the checksum covers the header block after magic and checksum
_O_DIRECT: int = getattr(os, "O_DIRECT", 0)
_datasync = getattr(os, "fdatasync", os.fsync)


class DiskFullError(OSError):
    """Raised by ``DiskTier.put`` when the filesystem under ``disk.path`` is full."""


class _Header(NamedTuple):
    seq: int
    slot: int
    key: bytes
    token_bytes: bytes  # int64 little-endian
    data_hash: int


class _Staging:
    """A page-aligned, pre-faulted buffer seen as memoryview, numpy and torch (uint8)."""

    def __init__(self, nbytes: int) -> None:
        self._map = mmap.mmap(-1, nbytes)  # anonymous maps are page-aligned: O_DIRECT-ready
        self.view = memoryview(self._map)
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        self.array.fill(0)  # fault every page now: first touch is the slow part of a copy
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)


def _round_up(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        written = os.pwrite(fd, data, offset)
        if written <= 0:
            raise OSError(errno.EIO, "pwrite wrote nothing")
        data, offset = data[written:], offset + written


def _pread_upto(fd: int, buf: memoryview, offset: int) -> int:
    """Read ``len(buf)`` bytes at ``offset``; fewer only at the end of the file."""
    got = 0
    while got < len(buf):
        n = os.preadv(fd, [buf[got:]], offset + got)
        got += n
        if n == 0 or got % ALIGN:  # end of file (an unaligned retry would fail O_DIRECT)
            break
    return got


def _copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy the bytes of ``src`` into contiguous ``dst`` of the same byte size.

    CPU to CPU goes through numpy: one thread, GIL released. torch spreads a large copy over
    its intra-op threads, which stall when other processes hold the cores (5x slower here).
    """
    dst_bytes = dst.view(-1).view(torch.uint8)
    src_bytes = src.detach().contiguous().view(-1).view(torch.uint8)
    if dst.device.type == "cpu" and src.device.type == "cpu":
        np.copyto(dst_bytes.numpy(), src_bytes.numpy())
    else:
        dst_bytes.copy_(src_bytes)


def _probe_writes(path: str, want_direct: bool) -> bool:
    """Write a block into ``path``; True if O_DIRECT writes work there. Raises OSError."""
    probe = os.path.join(path, f".kvtier-probe-{os.getpid()}-{threading.get_ident()}")
    block = _Staging(ALIGN).view
    try:
        for direct in [True, False] if want_direct and _O_DIRECT else [False]:
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (_O_DIRECT if direct else 0)
            try:
                fd = os.open(probe, flags, 0o644)
                try:
                    _pwrite_all(fd, block, 0)
                finally:
                    os.close(fd)
                return direct
            except OSError as exc:
                if not (direct and exc.errno == errno.EINVAL):  # EINVAL: no O_DIRECT here
                    raise
        return False
    finally:
        with contextlib.suppress(OSError):
            os.unlink(probe)


class DiskTier(Tier):
    """Chunks in segment files on a local filesystem; survives restarts and crashes.

    A chunk is durable once ``put`` returns (with ``fsync=True``). Opening a directory that
    holds segments scans their slot headers (not the data) and serves every valid chunk
    again, oldest first in eviction order; bad headers, truncated slots and (on read, or at
    open with ``verify_on_open``) bad data are dropped and counted in
    ``stats.corrupt_dropped``. Thread-safe: I/O is positioned (``pwrite``, ``preadv``)
    through per-thread aligned buffers, so several threads move data at once.

    ``get_into`` copies a chunk into ``out`` piece by piece while the next pieces are read,
    so ``out`` is written before the data hash is known: a chunk found corrupt reads as a
    miss but may leave part of itself in ``out`` (a miss by key or token ids does not).

    Args:
        layout: the KV layout of every chunk stored.
        path: directory of the segment files; created if missing.
        capacity_bytes: byte budget of chunk data (headers and padding not counted).
        segment_nbytes: about the size of one segment file (at least one slot). A directory
            that already holds segments keeps their geometry.
        eviction_policy: registry name of the eviction policy.
        use_o_direct: bypass the page cache where the filesystem allows (buffered I/O
            where it does not, e.g. tmpfs; see ``o_direct``).
        fsync: end every ``put`` with ``fdatasync``; without it call ``sync()``.
        verify_on_open: also check every chunk's data hash at open (reads all data).
    """

    def __init__(
        self,
        layout: KVLayout,
        path: str | os.PathLike[str],
        capacity_bytes: int,
        segment_nbytes: int = 1 << 30,
        eviction_policy: str = "lru",
        use_o_direct: bool = True,
        fsync: bool = True,
        verify_on_open: bool = False,
    ) -> None:
        super().__init__("disk", layout, capacity_bytes, eviction_policy)
        if segment_nbytes < 1:
            raise ValueError(f"disk.segment_nbytes: must be >= 1, got {segment_nbytes}")
        self.path = os.path.abspath(os.fspath(path))
        self.fsync = fsync
        self.header_nbytes = _round_up(_FIXED.size + 8 * layout.chunk_tokens)
        self.slot_nbytes = self.header_nbytes + _round_up(layout.chunk_nbytes)
        self.segment_slots = max(1, segment_nbytes // self.slot_nbytes)
        self._data_end = self.header_nbytes + layout.chunk_nbytes  # in a slot
        # Slot byte ranges moved as one I/O each: the first holds the header.
        bounds = list(range(self.header_nbytes + PIECE_NBYTES, self.slot_nbytes, PIECE_NBYTES))
        self._pieces = list(zip([0, *bounds], [*bounds, self.slot_nbytes], strict=True))
        self._fingerprint = layout.fingerprint().encode()
        self.o_direct = self._prepare_directory(use_o_direct)
        self._lock_fd = self._lock_directory()
        self._fds: dict[int, int] = {}  # segment -> fd
        self._io_lock = threading.Lock()  # guards _fds, _next_seq and _closed
        self._next_seq = 0
        self._closed = False
        self._local = threading.local()  # per thread: staging buffer, segments to sync
        self._zeros = _Staging(self.header_nbytes).view
        self._used: set[int] = set()
        self._free: list[int] = []  # a heap: the lowest free slot is taken first
        self._high_water = 0  # every slot from here on is free
        self._victim_ok = True
        self._pool: ThreadPoolExecutor | None = None  # I/O threads, made on first need
        try:
            self._scan(verify_on_open)
        except BaseException:
            self.close()
            raise

    # ---- public API beyond Tier ---------------------------------------------------------

    def put(self, chunks: Sequence[Chunk]) -> PutResult:
        """As ``Tier.put``; with ``fsync``, every chunk stored is durable when it returns.

        One ``fdatasync`` per segment touched ends the call (also when it raises), not one
        per chunk: a flush costs as much as writing a few MB here.
        """
        try:
            return super().put(chunks)
        finally:
            dirty = self._dirty()
            if dirty:
                start = time.perf_counter()
                for segment in sorted(dirty):
                    self._sync_fd(segment)
                dirty.clear()
                with self._lock:
                    self._stats.put_seconds += time.perf_counter() - start

    def sync(self) -> None:
        """Make every chunk written so far durable (``fdatasync`` of every segment)."""
        with self._io_lock:
            segments = list(self._fds)
        for segment in segments:
            self._sync_fd(segment)

    def slot_location(self, slot: int) -> tuple[str, int]:
        """The segment file and byte offset of a slot (for tools and tests)."""
        segment, index = divmod(slot, self.segment_slots)
        return self._segment_path(segment), index * self.slot_nbytes

    def set_evict_hook(self, hook: EvictHook | None) -> None:
        """As ``Tier.set_evict_hook``; a victim found corrupt is counted, not handed on."""
        if hook is None:
            super().set_evict_hook(None)
            return
        write_back = hook

        def checked(victim: Chunk) -> None:  # called under the lock, right after _victim_data
            if self._victim_ok:
                write_back(victim)
            else:
                self._stats.corrupt_dropped += 1
                log.warning("disk: victim %s is corrupt; not written back", victim.ref.short())

        super().set_evict_hook(checked)

    def close(self) -> None:
        """Flush and close every segment file; the tier must not be used afterwards."""
        with self._io_lock:
            if self._closed:
                return
            self._closed = True
            fds, self._fds = list(self._fds.values()), {}
        if self._pool is not None:
            self._pool.shutdown()
        errors: list[OSError] = []
        for fd in fds:
            try:
                _datasync(fd)
            except OSError as exc:
                errors.append(exc)
            finally:
                os.close(fd)
        os.close(self._lock_fd)  # releases the flock
        if errors:
            raise errors[0]

    # ---- slot storage -------------------------------------------------------------------

    def _alloc_slot(self) -> int | None:
        if len(self._used) >= self.num_slots:
            return None
        if self._free:
            slot = heapq.heappop(self._free)
        else:
            slot, self._high_water = self._high_water, self._high_water + 1
        self._used.add(slot)
        return slot

    def _free_slot(self, slot: int) -> None:
        self._used.discard(slot)
        heapq.heappush(self._free, slot)

    def _write_slot(self, slot: int, chunk: Chunk) -> None:
        data = chunk.data
        if tuple(data.shape) != self.layout.chunk_shape or data.dtype != self.layout.dtype:
            raise ValueError(
                f"disk.put: chunk {chunk.ref.short()} is {tuple(data.shape)} {data.dtype}; "
                f"this tier stores {self.layout.chunk_shape} {self.layout.dtype}"
            )
        token_bytes = chunk.ref.token_bytes()
        if len(chunk.key) > MAX_KEY_NBYTES or _FIXED.size + len(token_bytes) > self.header_nbytes:
            raise ValueError(
                f"disk.put: chunk {chunk.ref.short()} has a {len(chunk.key)}-byte key and "
                f"{chunk.ref.num_tokens} tokens; a slot header takes at most "
                f"{MAX_KEY_NBYTES} bytes and {(self.header_nbytes - _FIXED.size) // 8} tokens"
            )
        staging, head = self._staging(), self.header_nbytes
        src = data.detach().contiguous().view(-1).view(torch.uint8)
        segment, index = divmod(slot, self.segment_slots)
        offset, hasher = index * self.slot_nbytes, xxhash.xxh3_64()
        writes: list[Future[None]] = []
        try:
            fd = self._segment_fd(segment)
            # Copy and hash piece i while pieces before it are being written; the first
            # piece goes down with the header (one write for a slot of one piece).
            for i, (start, end) in enumerate(self._pieces):
                lo, hi = max(start, head), min(end, self._data_end)  # chunk bytes of the piece
                _copy_bytes(staging.tensor[lo:hi], src[lo - head : hi - head])
                hasher.update(staging.view[lo:hi])
                if i > 0:
                    piece = staging.view[start:end]
                    writes.append(self._io_pool().submit(_pwrite_all, fd, piece, offset + start))
            with self._io_lock:
                seq, self._next_seq = self._next_seq, self._next_seq + 1
            header = staging.view[:head]
            self._encode_header(header, seq, slot, chunk.key, token_bytes, hasher.intdigest())
            _pwrite_all(fd, staging.view[: self._pieces[0][1]], offset)
            for write in writes:
                write.result()
        except OSError as exc:
            raise self._disk_error(exc, segment) from exc
        finally:
            for write in writes:  # the staging buffer is reused only once all have landed
                write.exception()
        if self.fsync:
            self._dirty().add(segment)  # flushed at the end of put()

    def _read_slot(self, slot: int, ref: ChunkRef, out: torch.Tensor) -> bool:
        if tuple(out.shape) != self.layout.chunk_shape or out.dtype != self.layout.dtype:
            raise ValueError(
                f"disk.get_into: output buffer is {tuple(out.shape)} {out.dtype}; "
                f"give {self.layout.chunk_shape} {self.layout.dtype}"
            )
        if out.is_contiguous():  # copied piece by piece as the pieces land
            return self._read_verified(slot, ref, out.view(-1).view(torch.uint8)) is not None
        if self._read_verified(slot, ref) is None:
            return False
        src = self._staging().tensor[self.header_nbytes : self.header_nbytes + self.chunk_nbytes]
        out.copy_(src.view(self.layout.dtype).view(self.layout.chunk_shape))
        return True

    def _victim_data(self, slot: int) -> torch.Tensor:
        self._victim_ok = self._read_verified(slot) is not None
        src = self._staging().tensor[self.header_nbytes : self.header_nbytes + self.chunk_nbytes]
        data = self.layout.empty_chunk()
        _copy_bytes(data, src)
        return data

    def _forget_slot(self, slot: int) -> None:
        try:
            self._zero_header(slot)
        except OSError as exc:
            # The chunk may come back after a restart; harmless, it is valid immutable KV.
            log.warning("disk: could not invalidate slot %d in %s: %s", slot, self.path, exc)

    # ---- files --------------------------------------------------------------------------

    def _prepare_directory(self, use_o_direct: bool) -> bool:
        """Create ``path`` if needed and check it takes writes; True if O_DIRECT works."""
        try:
            os.makedirs(self.path, exist_ok=True)
            return _probe_writes(self.path, use_o_direct)
        except OSError as exc:
            raise ValueError(
                f"disk.path: {self.path!r} is not a writable directory ({exc.strerror}); "
                "give a directory kvtier can create and write"
            ) from None

    def _lock_directory(self) -> int:
        """Take this layout's lock file in ``path``, so one process owns the segments."""
        lock_path = os.path.join(self.path, f"{self._fingerprint.decode()}.lock")
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ValueError(
                f"disk.path: {self.path!r} is in use by another disk tier (lock {lock_path}); "
                "close it first or give each process its own directory"
            ) from None
        return fd

    def _segment_path(self, segment: int) -> str:
        name = f"{self._fingerprint.decode()}.s{self.segment_slots}.{segment:05d}.kvseg"
        return os.path.join(self.path, name)

    def _segment_fd(self, segment: int) -> int:
        fd = self._fds.get(segment)
        if fd is not None:
            return fd
        with self._io_lock:
            if self._closed:
                raise RuntimeError("disk: the tier is closed")
            if segment not in self._fds:
                self._fds[segment] = self._open_segment(segment)[0]
            return self._fds[segment]

    def _open_segment(self, segment: int) -> tuple[int, int]:
        """Open a segment file, creating it if missing; returns (fd, its size)."""
        path = self._segment_path(segment)
        created = not os.path.exists(path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | (_O_DIRECT if self.o_direct else 0), 0o644)
        if created and self.fsync:
            dir_fd = os.open(self.path, os.O_RDONLY)
            try:
                os.fsync(dir_fd)  # make the new file's name durable too
            finally:
                os.close(dir_fd)
        return fd, os.fstat(fd).st_size

    def _sync_fd(self, segment: int) -> None:
        try:
            _datasync(self._fds[segment])
        except OSError as exc:
            raise self._disk_error(exc, segment) from exc

    def _disk_error(self, exc: OSError, segment: int) -> OSError:
        """``DiskFullError`` naming the file for a full disk; other errors as they are."""
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            return exc
        return DiskFullError(
            exc.errno,
            f"disk.path: no space left on the device of {self._segment_path(segment)}; "
            "free space there or lower disk.capacity_bytes",
        )

    def _zero_header(self, slot: int) -> None:
        segment, index = divmod(slot, self.segment_slots)
        fd = self._fds.get(segment)
        if fd is not None:  # no file yet: nothing was ever written there
            _pwrite_all(fd, self._zeros, index * self.slot_nbytes)

    # ---- per-thread state ---------------------------------------------------------------

    def _staging(self) -> _Staging:
        """This thread's slot-sized aligned buffer (made on first use, then reused)."""
        staging: _Staging | None = getattr(self._local, "staging", None)
        if staging is None:
            staging = self._local.staging = _Staging(self.slot_nbytes)
        return staging

    def _io_pool(self) -> ThreadPoolExecutor:
        """The I/O threads that move the pieces of a slot after the first."""
        if self._pool is None:
            with self._io_lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="kvtier-disk")
        return self._pool

    def _dirty(self) -> set[int]:
        """Segments this thread wrote since its last flush."""
        dirty: set[int] | None = getattr(self._local, "dirty", None)
        if dirty is None:
            dirty = self._local.dirty = set()
        return dirty

    # ---- headers ------------------------------------------------------------------------

    def _encode_header(
        self, buf: memoryview, seq: int, slot: int, key: bytes, token_bytes: bytes, data_hash: int
    ) -> None:
        head = self.header_nbytes
        buf[:head] = self._zeros
        _FIXED.pack_into(
            buf, 0, MAGIC, 0, FORMAT_VERSION, head, seq, slot, self.chunk_nbytes, data_hash,
            len(token_bytes) // 8, len(key), len(self._fingerprint), key, self._fingerprint,
        )  # fmt: skip
        buf[_FIXED.size : _FIXED.size + len(token_bytes)] = token_bytes
        struct.pack_into("<Q", buf, 8, xxhash.xxh3_64_intdigest(buf[_CHECKSUMMED_FROM:head]))

    def _decode_header(self, block: memoryview) -> _Header | None:
        """The header in ``block`` if whole, intact and of this layout; else None."""
        if len(block) != self.header_nbytes or bytes(block[:8]) != MAGIC:
            return None
        (_, checksum, version, head, seq, slot, data_nbytes, data_hash, num_tokens, key_len,
         fp_len, key, fingerprint) = _FIXED.unpack_from(block)  # fmt: skip
        tokens_end = _FIXED.size + 8 * num_tokens
        if (
            checksum != xxhash.xxh3_64_intdigest(block[_CHECKSUMMED_FROM:])
            or version != FORMAT_VERSION
            or head != self.header_nbytes
            or data_nbytes != self.chunk_nbytes
            or fingerprint[:fp_len] != self._fingerprint
            or key_len > MAX_KEY_NBYTES
            or tokens_end > head
        ):
            return None
        return _Header(seq, slot, key[:key_len], bytes(block[_FIXED.size : tokens_end]), data_hash)

    def _read_verified(
        self, slot: int, ref: ChunkRef | None = None, out_bytes: torch.Tensor | None = None
    ) -> _Header | None:
        """Read a slot into this thread's staging buffer; its header if every check passes.

        Checks: the header (checksum, layout, slot index), the chunk named (``ref``'s key
        and token ids, when given) and the data hash. Pieces after the first are read by
        the I/O threads while this thread hashes (and copies into ``out_bytes``, the chunk's
        bytes, if given) the ones before. ``out_bytes`` is written only once the header
        matched, but before the data hash is known: on a bad hash it holds part of it.
        """
        staging, head = self._staging(), self.header_nbytes
        segment, index = divmod(slot, self.segment_slots)
        fd, offset = self._segment_fd(segment), index * self.slot_nbytes
        reads = [
            self._io_pool().submit(_pread_upto, fd, staging.view[start:end], offset + start)
            for start, end in self._pieces[1:]
        ]
        try:
            first_end = self._pieces[0][1]
            if _pread_upto(fd, staging.view[:first_end], offset) < first_end:
                return None  # truncated
            header = self._decode_header(staging.view[:head])
            if header is None or header.slot != slot:
                return None
            if ref is not None and (
                header.key != ref.key or header.token_bytes != ref.token_bytes()
            ):
                return None
            hasher = xxhash.xxh3_64()
            for i, (start, end) in enumerate(self._pieces):
                if i > 0 and reads[i - 1].result() < end - start:
                    return None  # truncated
                lo, hi = max(start, head), min(end, self._data_end)  # chunk bytes of the piece
                hasher.update(staging.view[lo:hi])
                if out_bytes is not None:
                    _copy_bytes(out_bytes[lo - head : hi - head], staging.tensor[lo:hi])
        finally:
            for read in reads:  # the staging buffer is reused only once all have landed
                read.exception()
        return header if hasher.intdigest() == header.data_hash else None

    # ---- reopening ----------------------------------------------------------------------

    def _adopt_segments(self) -> list[int]:
        """The numbers of this layout's segments on disk; adopts their geometry."""
        pattern = re.compile(re.escape(self._fingerprint.decode()) + r"\.s(\d+)\.(\d+)\.kvseg")
        found: dict[int, list[int]] = {}
        for name in os.listdir(self.path):
            match = pattern.fullmatch(name)
            if match:
                found.setdefault(int(match[1]), []).append(int(match[2]))
        if len(found) > 1:
            raise ValueError(
                f"disk.path: {self.path!r} mixes segments of {sorted(found)} slots; "
                "remove the stale files or give another directory"
            )
        if not found:
            return []
        ((self.segment_slots, segments),) = found.items()
        return sorted(segments)

    def _scan(self, verify: bool) -> None:
        """Rebuild the index, the eviction order and the free slots from the headers."""
        segments = self._adopt_segments()
        staging = self._staging()
        head = self.header_nbytes
        valid: list[_Header] = []
        bad: list[int] = []
        for segment in segments:
            fd, size = self._open_segment(segment)
            self._fds[segment] = fd
            for index in range(self.segment_slots):
                slot, offset = segment * self.segment_slots + index, index * self.slot_nbytes
                if offset >= size:
                    break  # never written, or cut off whole (then undetectable)
                got = _pread_upto(fd, staging.view[:head], offset)
                if not staging.array[:got].any():
                    continue  # a free slot
                header = self._decode_header(staging.view[:got])
                if (
                    header is None
                    or header.slot != slot
                    or offset + self.slot_nbytes > size  # truncated
                    or (verify and self._read_verified(slot) is None)
                ):
                    bad.append(slot)
                else:
                    valid.append(header)
        self._stats.corrupt_dropped += len(bad)
        valid.sort(key=lambda h: h.seq)
        self._next_seq = valid[-1].seq + 1 if valid else 0
        newest: dict[bytes, _Header] = {}
        for header in valid:  # ascending seq: the newest copy of a key wins
            if header.key in newest:
                bad.append(newest[header.key].slot)
            newest[header.key] = header
        kept = sorted(newest.values(), key=lambda h: h.seq)
        excess = max(0, len(kept) - self.num_slots)
        bad.extend(h.slot for h in kept[:excess])  # over capacity: the oldest go
        self._stats.evictions += excess
        for header in kept[excess:]:
            token_ids = tuple(np.frombuffer(header.token_bytes, dtype="<i8").tolist())
            self._entries[header.key] = _Entry(ChunkRef(header.key, token_ids), header.slot)
            self._policy.insert(header.key)
            self._used.add(header.slot)
        for slot in bad:
            self._zero_header(slot)
        self._high_water = max(self._used) + 1 if self._used else 0
        self._free = [s for s in range(self._high_water) if s not in self._used]  # a heap
        if segments:
            n_kept = len(self._entries)
            log.info("disk: reopened %s: %d chunks, %d slots dropped", self.path, n_kept, len(bad))
