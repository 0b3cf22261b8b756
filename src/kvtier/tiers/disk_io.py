"""Aligned staging buffers and positioned I/O for the disk tier.

O_DIRECT needs buffers, file offsets and lengths aligned to the device's logical block
(512 B or 4 KiB); everything here aligns to ``ALIGN`` so it works for both. The helpers are
stateless and thread-safe; a ``Staging`` buffer belongs to one thread at a time.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import threading

import numpy as np
import torch

ALIGN = 4096  # O_DIRECT alignment of buffers, offsets and lengths (512 B and 4 KiB disks)
O_DIRECT: int = getattr(os, "O_DIRECT", 0)
datasync = getattr(os, "fdatasync", os.fsync)


class Staging:
    """A page-aligned, pre-faulted buffer seen as memoryview, numpy and torch (uint8).

    Not thread-safe: the owner (one thread) reads and writes it; I/O threads may fill
    disjoint ranges of it on the owner's behalf.
    """

    def __init__(self, nbytes: int) -> None:
        self._map = mmap.mmap(-1, nbytes)  # anonymous maps are page-aligned: O_DIRECT-ready
        self.view = memoryview(self._map)
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        self.array.fill(0)  # fault every page now: first touch is the slow part of a copy
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)


def round_up(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of ``ALIGN``."""
    return -(-nbytes // ALIGN) * ALIGN


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """Write all of ``data`` at ``offset`` (retrying short writes). Raises OSError."""
    while data:
        written = os.pwrite(fd, data, offset)
        if written <= 0:
            raise OSError(errno.EIO, "pwrite wrote nothing")
        data, offset = data[written:], offset + written


def pread_upto(fd: int, buf: memoryview, offset: int) -> int:
    """Read ``len(buf)`` bytes at ``offset``; fewer only at the end of the file."""
    got = 0
    while got < len(buf):
        n = os.preadv(fd, [buf[got:]], offset + got)
        got += n
        if n == 0 or got % ALIGN:  # end of file (an unaligned retry would fail O_DIRECT)
            break
    return got


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
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


def probe_writes(path: str, want_direct: bool) -> bool:
    """Write a block into ``path``; True if O_DIRECT writes work there. Raises OSError."""
    probe = os.path.join(path, f".kvtier-probe-{os.getpid()}-{threading.get_ident()}")
    block = Staging(ALIGN).view
    try:
        for direct in [True, False] if want_direct and O_DIRECT else [False]:
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (O_DIRECT if direct else 0)
            try:
                fd = os.open(probe, flags, 0o644)
                try:
                    pwrite_all(fd, block, 0)
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


def lock_exclusive(path: str, create: bool = True) -> int | None:
    """Open ``path`` (created if missing, with ``create``; else read-only) and ``flock``
    it; None if another holds the lock.

    The lock lasts until the returned fd is closed.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644) if create else os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def open_file(path: str, direct: bool, durable_name: bool) -> tuple[int, int]:
    """Open ``path`` read-write, creating it if missing; returns (fd, its size).

    Args:
        path: the file.
        direct: open with O_DIRECT (the caller has checked the filesystem takes it).
        durable_name: when the file is created, fsync its directory so the name survives
            a crash.
    """
    created = not os.path.exists(path)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | (O_DIRECT if direct else 0), 0o644)
    if created and durable_name:
        dir_fd = os.open(os.path.dirname(path), os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # make the new file's name durable too
        finally:
            os.close(dir_fd)
    return fd, os.fstat(fd).st_size
