"""The disk tier's files: its directory, the lock that keeps other processes off it, and
the open segment files.

``SegmentFiles`` owns every file descriptor of one disk tier: it creates and probes the
directory, takes the layout's lock file (``flock``), opens segments as they are first
needed, flushes them and closes them. It knows slot geometry (where slot ``k`` lives) but
nothing of headers or chunks; ``kvtier.tiers.disk.DiskTier`` does the reads and writes.

A directory that exists but takes no writes (a read-only mount, no write permission) is
opened **read-only** (``read_only`` says why): segments already there open ``O_RDONLY``,
no segment is created, free-slot headers are not written, and the lock file is taken only
if it is there.

Thread-safety: every method is thread-safe; one lock guards the table of open files.
"""

from __future__ import annotations

import errno
import os
import threading

from kvtier.tiers import disk_io
from kvtier.tiers.disk_format import find_segments, lock_name, segment_name


class DiskFullError(OSError):
    """A full filesystem under ``disk.path``, naming the file (what ``disable_writes`` logs)."""


class SegmentFiles:
    """The directory and segment files of one disk tier.

    Args:
        path: the directory (created if missing).
        fingerprint: the layout's fingerprint (names its segments and lock file).
        segment_slots: slots per segment file; ``adopt`` replaces it with the geometry of
            segments already there.
        slot_nbytes: bytes of one slot (header block and data).
        header_nbytes: bytes of a slot's header block.
        use_o_direct: bypass the page cache where the filesystem takes it.
        fsync: open segments for durable writes (see ``disk_io.open_file``).

    Raises:
        ValueError: ``path`` is not a directory kvtier can create or read, or another tier
            holds its lock.
    """

    def __init__(
        self,
        path: str,
        fingerprint: bytes,
        segment_slots: int,
        slot_nbytes: int,
        header_nbytes: int,
        use_o_direct: bool,
        fsync: bool,
    ) -> None:
        self.path = path
        self.fingerprint = fingerprint
        self.segment_slots = segment_slots
        self.slot_nbytes = slot_nbytes
        self.fsync = fsync
        self.read_only: OSError | None = None  # set: the directory takes no writes (why)
        self.o_direct = self._prepare_directory(use_o_direct)
        self._lock_fd = self._lock_directory()
        self._fds: dict[int, int] = {}  # segment -> fd
        self._lock = threading.Lock()  # guards _fds and _closed
        self._closed = False
        self._zeros = disk_io.Staging(header_nbytes).view  # an aligned free-slot header

    def adopt(self) -> list[int]:
        """The numbers of this layout's segments on disk; adopts their geometry.

        Raises:
            ValueError: segments of several geometries are mixed in the directory.
        """
        found = find_segments(os.listdir(self.path), self.fingerprint)
        if len(found) > 1:
            raise ValueError(
                f"disk.path: {self.path!r} mixes segments of {sorted(found)} slots; "
                "remove the stale files or give another directory"
            )
        if not found:
            return []
        ((self.segment_slots, segments),) = found.items()
        return sorted(segments)

    def location(self, slot: int) -> tuple[str, int]:
        """The segment file and byte offset of a slot."""
        segment, index = divmod(slot, self.segment_slots)
        return self.segment_path(segment), index * self.slot_nbytes

    def segment_path(self, segment: int) -> str:
        return os.path.join(self.path, segment_name(self.fingerprint, self.segment_slots, segment))

    def fd(self, segment: int) -> int:
        """The open file of a segment, created if missing. Raises once closed."""
        fd = self._fds.get(segment)
        if fd is not None:
            return fd
        with self._lock:
            if self._closed:
                raise RuntimeError("disk: the tier is closed")
            if self.read_only is not None:
                raise self.read_only
            if segment not in self._fds:
                self._fds[segment] = disk_io.open_file(
                    self.segment_path(segment), self.o_direct, self.fsync
                )[0]
            return self._fds[segment]

    def open_existing(self, segment: int) -> tuple[int, int]:
        """Open a segment found by ``adopt`` (at start); returns (fd, its size in bytes)."""
        if self.read_only is not None:
            fd = os.open(self.segment_path(segment), os.O_RDONLY)
            size = os.fstat(fd).st_size
        else:
            fd, size = disk_io.open_file(self.segment_path(segment), self.o_direct, self.fsync)
        with self._lock:
            self._fds[segment] = fd
        return fd, size

    def open_segments(self) -> list[int]:
        """The segments open now."""
        with self._lock:
            return list(self._fds)

    def sync(self, segment: int) -> None:
        """``fdatasync`` one open segment; ``DiskFullError`` for a full disk."""
        try:
            disk_io.datasync(self._fds[segment])
        except OSError as exc:
            raise self.error(exc, segment) from exc

    def zero_header(self, slot: int) -> None:
        """Mark a slot free on disk (an all-zero header). Raises ``OSError``."""
        segment, index = divmod(slot, self.segment_slots)
        fd = self._fds.get(segment)
        if fd is not None and self.read_only is None:  # no file: nothing was written there
            disk_io.pwrite_all(fd, self._zeros, index * self.slot_nbytes)

    def error(self, exc: OSError, segment: int) -> OSError:
        """``DiskFullError`` naming the file for a full disk; other errors as they are."""
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            return exc
        return DiskFullError(
            exc.errno,
            f"disk.path: no space left on the device of {self.segment_path(segment)}; "
            "free space there or lower disk.capacity_bytes",
        )

    def close(self) -> None:
        """Flush and close every segment and release the lock; idempotent.

        Raises the first ``OSError`` of a flush, after closing everything.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            fds, self._fds = list(self._fds.values()), {}
        errors: list[OSError] = []
        for fd in fds:
            try:
                if self.read_only is None:
                    disk_io.datasync(fd)
            except OSError as exc:
                errors.append(exc)
            finally:
                os.close(fd)
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
        if errors:
            raise errors[0]

    def _prepare_directory(self, use_o_direct: bool) -> bool:
        """Create ``path`` if needed and check it takes writes; True if O_DIRECT works.
        A readable directory that takes no writes sets ``read_only`` (buffered reads)."""
        try:
            os.makedirs(self.path, exist_ok=True)
            return disk_io.probe_writes(self.path, use_o_direct)
        except OSError as exc:
            if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM) and os.access(
                self.path, os.R_OK | os.X_OK
            ):
                self.read_only = exc
                return False
            raise ValueError(
                f"disk.path: {self.path!r} is not a writable directory ({exc.strerror}); "
                "give a directory kvtier can create and write"
            ) from None

    def _lock_directory(self) -> int | None:
        """Take this layout's lock file in ``path``, so one process owns the segments
        (read-only: the lock file if it is there, else None)."""
        lock_path = os.path.join(self.path, lock_name(self.fingerprint))
        if self.read_only is not None and not os.path.exists(lock_path):
            return None
        fd = disk_io.lock_exclusive(lock_path, create=self.read_only is None)
        if fd is None:
            raise ValueError(
                f"disk.path: {self.path!r} is in use by another disk tier (lock {lock_path}); "
                "close it first or give each process its own directory"
            )
        return fd
