"""Files in host shared memory that processes of this host map: the
simulator's device memory (sim_device.pyx) and status pages
(status_page.py)."""

from __future__ import annotations

import mmap
import os
import re
import tempfile

__all__ = ["shared_directory", "create_mapped", "matching_files"]


def shared_directory() -> str:
    """/dev/shm where it is writable, else the temporary directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def matching_files(directory: str, pattern: re.Pattern) -> list[tuple[str, re.Match]]:
    """(path, match) of each entry of ``directory`` whose name ``pattern``
    matches, in name order; none where the directory cannot be listed."""
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    return [(os.path.join(directory, name), m) for name in names if (m := pattern.match(name))]


def create_mapped(path: str, size: int, *, exclusive: bool, mode: int) -> mmap.mmap:
    """Creates ``path`` with ``size`` bytes and maps it read-write.
    ``exclusive``: fail if it exists; else an existing file is truncated."""
    flags = os.O_RDWR | os.O_CREAT | (os.O_EXCL if exclusive else os.O_TRUNC)
    fd = os.open(path, flags, mode)
    try:
        os.ftruncate(fd, size)
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)
