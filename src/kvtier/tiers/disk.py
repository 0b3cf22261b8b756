"""The disk tier: chunks in fixed-size slots of segment files, checksummed, restart-safe.

Files. One directory per tier, holding a layout's segment files of fixed-size slots (a
checksummed header block, then the chunk's bytes; see ``disk_format``). A lock file
(``flock``) keeps a second process off the same segments.

Writes. A slot goes down in positioned writes (O_DIRECT where the filesystem takes it): one
write of header and data when the slot is at most ``PIECE_NBYTES`` of data, else the header
with the first piece while I/O threads write the others. Either way a torn or partial write
reads as a bad header checksum or a bad data hash, never as wrong KV. Eviction zeroes the
header (a free slot) so a restart does not bring the chunk back, and should two headers
ever name one key, the higher sequence number wins. Files grow as slots are first written;
a scan at open stops at each file's end.
"""

from __future__ import annotations

import heapq
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kvtier.kv.chunk import Chunk, ChunkRef
from kvtier.kv.layout import KVLayout
from kvtier.tiers import disk_io
from kvtier.tiers.base import Tier
from kvtier.tiers.disk_files import DiskFullError, SegmentFiles
from kvtier.tiers.disk_format import MAX_KEY_NBYTES, SlotFormat, SlotHeader, data_hasher
from kvtier.tiers.disk_io import Staging, copy_bytes

__all__ = ["IO_THREADS", "PIECE_NBYTES", "DiskFullError", "DiskTier"]

log = logging.getLogger(__name__)

# Large slots move in pieces: a thread copies and hashes one piece while the I/O threads
# move others, so the memory work hides behind the disk instead of adding to it.
PIECE_NBYTES = 1 << 20
IO_THREADS = 4


class DiskTier(Tier):
    """Chunks in segment files on a local filesystem; survives restarts and crashes.

    A chunk is durable once ``put`` returns (with ``fsync=True``; without it, once ``put``
    returns it survives the process being killed, not a power cut). Opening a directory that
    holds segments scans their slot headers (not the data) and serves every valid chunk
    again, oldest first in eviction order; bad headers, truncated slots and (on read, or at
    open with ``verify_on_open``) bad data are dropped and counted in
    ``stats.corrupt_dropped``. Thread-safe: I/O is positioned (``pwrite``, ``preadv``)
    through per-thread aligned buffers, so several threads move data at once.

    ``get_into`` copies a chunk into ``out`` piece by piece while the next pieces are read,
    before the data hash is known: hence a chunk found corrupt may leave part of it in ``out``.

    I/O errors degrade, never fail a caller: the first ``OSError`` of a write or a flush
    (a full disk, EIO, EINVAL...) disables the tier's writes (``disable_writes``: counted,
    logged once); ``put`` then skips its chunks while reads go on. A read that fails with
    an ``OSError`` counts in ``stats.io_errors`` and reads as a corrupt chunk (dropped).

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
        codec: the stored bytes' codec (``kvtier.codec``), named in every slot header.
    """

    degrade_on_io_error = True

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
        codec: str = "raw",
    ) -> None:
        super().__init__("disk", layout, capacity_bytes, eviction_policy, codec)
        if self.num_slots < 1:
            minimum_mb = -(-self.stored_chunk_nbytes // (1 << 20))
            raise ValueError(
                f"disk.capacity_bytes (--disk-mb): {capacity_bytes} bytes holds no chunk; "
                f"give at least {self.stored_chunk_nbytes} bytes (--disk-mb {minimum_mb}), "
                "one chunk of this model, or no disk tier"
            )
        if segment_nbytes < 1:
            raise ValueError(f"disk.segment_nbytes: must be >= 1, got {segment_nbytes}")
        self.path = os.path.abspath(os.fspath(path))
        self.fsync = fsync
        self._format = SlotFormat.for_layout(layout, self.codec)
        self.header_nbytes = self._format.header_nbytes
        self.slot_nbytes = self._format.slot_nbytes
        self._data_end = self.header_nbytes + self.stored_chunk_nbytes  # in a slot
        # Slot byte ranges moved as one I/O each: the first holds the header.
        bounds = list(range(self.header_nbytes + PIECE_NBYTES, self.slot_nbytes, PIECE_NBYTES))
        self._pieces = list(zip([0, *bounds], [*bounds, self.slot_nbytes], strict=True))
        self._files = SegmentFiles(
            self.path,
            self._format.fingerprint,
            max(1, segment_nbytes // self.slot_nbytes),
            self.slot_nbytes,
            self.header_nbytes,
            use_o_direct,
            fsync,
        )
        self.o_direct = self._files.o_direct
        if self._files.read_only is not None:
            self._write_fault = self._files.read_only  # reads only, from the start
            self._stats.writes_disabled = 1
            log.warning(
                "disk: %s takes no writes (%s): serving the chunks it holds, read-only; "
                "new KV stays in the other tiers",
                self.path,
                self._files.read_only.strerror,
            )
        self._seq_lock = threading.Lock()  # guards _next_seq
        self._next_seq = 0
        self._pool_lock = threading.Lock()  # guards making _pool
        self._local = threading.local()  # per thread: staging buffer, segments to sync
        self._used: set[int] = set()
        self._free: list[int] = []  # a heap: the lowest free slot is taken first
        self._high_water = 0  # every slot from here on is free
        self._pool: ThreadPoolExecutor | None = None  # I/O threads, made on first need
        try:
            self._scan(verify_on_open)
        except BaseException:
            self.close()
            raise

    # ---- public API beyond Tier ---------------------------------------------------------

    @property
    def segment_slots(self) -> int:
        """Slots per segment file (a reopened directory keeps its own)."""
        return self._files.segment_slots

    def sync(self) -> None:
        """Make every chunk written so far durable (``fdatasync`` of every segment)."""
        for segment in self._files.open_segments():
            self._files.sync(segment)

    def slot_location(self, slot: int) -> tuple[str, int]:
        """The segment file and byte offset of a slot (for tools and tests)."""
        return self._files.location(slot)

    def close(self) -> None:
        """Flush and close every segment file; the tier must not be used afterwards."""
        if self._pool is not None:
            self._pool.shutdown()
        self._files.close()

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
        if not self._format.fits(chunk.key, token_bytes):
            raise ValueError(
                f"disk.put: chunk {chunk.ref.short()} has a {len(chunk.key)}-byte key and "
                f"{chunk.ref.num_tokens} tokens; a slot header takes at most "
                f"{MAX_KEY_NBYTES} bytes and {self._format.max_tokens} tokens"
            )
        staging, head = self._staging(), self.header_nbytes
        src = data.detach().contiguous().view(-1).view(torch.uint8) if self.codec.exact else None
        if src is None:  # encoded straight into the slot's bytes in the staging buffer
            self.codec.encode_into(data.detach(), staging.tensor[head : self._data_end])
        segment, index = divmod(slot, self.segment_slots)
        offset, hasher = index * self.slot_nbytes, data_hasher()
        writes: list[Future[None]] = []
        try:
            fd = self._files.fd(segment)
            # Copy and hash piece i while pieces before it are being written; the first
            # piece goes down with the header (one write for a slot of one piece).
            for i, (start, end) in enumerate(self._pieces):
                lo, hi = max(start, head), min(end, self._data_end)  # chunk bytes of the piece
                if src is not None:
                    copy_bytes(staging.tensor[lo:hi], src[lo - head : hi - head])
                hasher.update(staging.view[lo:hi])
                if i > 0:
                    piece = staging.view[start:end]
                    write = self._io_pool().submit(disk_io.pwrite_all, fd, piece, offset + start)
                    writes.append(write)
            with self._seq_lock:
                seq, self._next_seq = self._next_seq, self._next_seq + 1
            header = staging.view[:head]
            self._format.encode(header, seq, slot, chunk.key, token_bytes, hasher.intdigest())
            disk_io.pwrite_all(fd, staging.view[: self._pieces[0][1]], offset)
            for write in writes:
                write.result()
        except OSError as exc:
            raise self._files.error(exc, segment) from exc
        finally:
            for write in writes:  # the staging buffer is reused only once all have landed
                write.exception()
        if self.fsync:
            self._dirty().add(segment)  # flushed by _end_put

    def _read_slot(self, slot: int, ref: ChunkRef, out: torch.Tensor) -> bool:
        if tuple(out.shape) != self.layout.chunk_shape or out.dtype != self.layout.dtype:
            raise ValueError(
                f"disk.get_into: output buffer is {tuple(out.shape)} {out.dtype}; "
                f"give {self.layout.chunk_shape} {self.layout.dtype}"
            )
        try:
            if out.is_contiguous() and self.codec.exact:  # copied as the pieces land
                return self._read_verified(slot, ref, out.view(-1).view(torch.uint8)) is not None
            if self._read_verified(slot, ref) is None:
                return False
        except OSError as exc:
            self.count_io_error()
            log.warning("disk: reading chunk %s from %s failed: %s", ref.short(), self.path, exc)
            return False
        self.codec.decode_into(self._staging().tensor[self.header_nbytes : self._data_end], out)
        return True

    def _victim_data(self, slot: int) -> torch.Tensor | None:
        if self._read_verified(slot) is None:
            return None
        data = self.layout.empty_chunk()
        self.codec.decode_into(self._staging().tensor[self.header_nbytes : self._data_end], data)
        return data

    def _end_put(self) -> None:
        """With ``fsync``, every chunk stored by the ``put`` call is durable on return.

        One ``fdatasync`` per segment the calling thread touched, not one per chunk: a
        flush costs as much as writing a few MB here. Counted in ``stats.put_seconds``.
        """
        dirty = self._dirty()
        if not dirty:
            return
        start = time.perf_counter()
        try:
            for segment in sorted(dirty):
                self._files.sync(segment)
        except OSError as exc:  # the chunks stay readable, but may not survive a crash
            self.disable_writes(exc)
        dirty.clear()
        with self._lock:
            self._stats.put_seconds += time.perf_counter() - start

    def _forget_slot(self, slot: int) -> None:
        try:
            self._files.zero_header(slot)
        except OSError as exc:
            # The chunk may come back after a restart; harmless, it is valid immutable KV.
            self._stats.io_errors += 1  # under the tier lock (called from _drop)
            log.warning("disk: could not invalidate slot %d in %s: %s", slot, self.path, exc)

    # ---- per-thread state ---------------------------------------------------------------

    def _staging(self) -> Staging:
        """This thread's slot-sized aligned buffer (made on first use, then reused)."""
        staging: Staging | None = getattr(self._local, "staging", None)
        if staging is None:
            staging = self._local.staging = Staging(self.slot_nbytes)
        return staging

    def _io_pool(self) -> ThreadPoolExecutor:
        """The I/O threads that move the pieces of a slot after the first."""
        if self._pool is None:
            with self._pool_lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="kvtier-disk")
        return self._pool

    def _dirty(self) -> set[int]:
        """Segments this thread wrote since its last flush."""
        dirty: set[int] | None = getattr(self._local, "dirty", None)
        if dirty is None:
            dirty = self._local.dirty = set()
        return dirty

    # ---- reading ------------------------------------------------------------------------

    def _read_verified(
        self, slot: int, ref: ChunkRef | None = None, out_bytes: torch.Tensor | None = None
    ) -> SlotHeader | None:
        """Read a slot into this thread's staging buffer; its header if every check passes.

        Checks: the header (checksum, layout, slot index), the chunk named (``ref``'s key
        and token ids, when given) and the data hash. Pieces after the first are read by
        the I/O threads while this thread hashes (and copies into ``out_bytes``, the chunk's
        bytes, if given) the ones before. ``out_bytes`` is written only once the header
        matched, but before the data hash is known: on a bad hash it holds part of it.
        """
        staging, head = self._staging(), self.header_nbytes
        segment, index = divmod(slot, self.segment_slots)
        fd, offset = self._files.fd(segment), index * self.slot_nbytes
        reads = [
            self._io_pool().submit(disk_io.pread_upto, fd, staging.view[start:end], offset + start)
            for start, end in self._pieces[1:]
        ]
        try:
            first_end = self._pieces[0][1]
            if disk_io.pread_upto(fd, staging.view[:first_end], offset) < first_end:
                return None  # truncated
            header = self._format.decode(staging.view[:head])
            if header is None or header.slot != slot:
                return None
            if ref is not None and (
                header.key != ref.key or header.token_bytes != ref.token_bytes()
            ):
                return None
            hasher = data_hasher()
            for i, (start, end) in enumerate(self._pieces):
                if i > 0 and reads[i - 1].result() < end - start:
                    return None  # truncated
                lo, hi = max(start, head), min(end, self._data_end)  # chunk bytes of the piece
                hasher.update(staging.view[lo:hi])
                if out_bytes is not None:
                    copy_bytes(out_bytes[lo - head : hi - head], staging.tensor[lo:hi])
        finally:
            for read in reads:  # the staging buffer is reused only once all have landed
                read.exception()
        return header if hasher.intdigest() == header.data_hash else None

    # ---- reopening ----------------------------------------------------------------------

    def _scan(self, verify: bool) -> None:
        """Rebuild the index, the eviction order and the free slots from the headers."""
        segments = self._files.adopt()
        staging = self._staging()
        head = self.header_nbytes
        valid: list[SlotHeader] = []
        bad: list[int] = []
        for segment in segments:
            fd, size = self._files.open_existing(segment)
            for index in range(self.segment_slots):
                slot, offset = segment * self.segment_slots + index, index * self.slot_nbytes
                if offset >= size:
                    break  # never written, or cut off whole (then undetectable)
                got = disk_io.pread_upto(fd, staging.view[:head], offset)
                if not staging.array[:got].any():
                    continue  # a free slot
                header = self._format.decode(staging.view[:got])
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
        newest: dict[bytes, SlotHeader] = {}
        for header in valid:  # ascending seq: the newest copy of a key wins
            if header.key in newest:
                bad.append(newest[header.key].slot)
            newest[header.key] = header
        kept = sorted(newest.values(), key=lambda h: h.seq)
        excess = max(0, len(kept) - self.num_slots)
        bad.extend(h.slot for h in kept[:excess])  # over capacity: the oldest go
        self._stats.evictions += excess
        for header in kept[excess:]:
            self._restore(header.ref(), header.slot)
            self._used.add(header.slot)
        for slot in bad:
            self._files.zero_header(slot)
        self._high_water = max(self._used) + 1 if self._used else 0
        self._free = [s for s in range(self._high_water) if s not in self._used]  # a heap
        if segments:
            n_kept = len(self)
            log.info("disk: reopened %s: %d chunks, %d slots dropped", self.path, n_kept, len(bad))
