"""Real filesystems for the disk faults: a small tmpfs (a disk that fills) and a remount
read-only (a folder that takes no writes). Both need the right to mount (root, or
CAP_SYS_ADMIN); where it is missing they raise ``MountRefused`` with the reason, which
tests turn into a skip and ``bench faults`` into a scenario it reports as not run.
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path


class MountRefused(RuntimeError):
    """``mount`` was not allowed here (the message is its error)."""


@contextlib.contextmanager
def tmpfs(path: Path, size_kib: int) -> Iterator[Path]:
    """A ``size_kib`` tmpfs mounted at ``path`` (created) for the body, then unmounted."""
    path.mkdir(parents=True, exist_ok=True)
    _mount("-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(path))
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)


def remount_read_only(path: Path) -> None:
    """Remount the filesystem at ``path`` (a mount point) read-only: writes there fail
    with EROFS from the kernel, whoever the process is."""
    _mount("-o", "remount,ro", str(path))


def _mount(*args: str) -> None:
    done = subprocess.run(["mount", *args], capture_output=True, check=False)
    if done.returncode != 0:
        raise MountRefused(f"mount {' '.join(args)}: {done.stderr.decode().strip()}")
