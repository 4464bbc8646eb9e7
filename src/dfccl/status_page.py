"""A rank's status page: its state, heartbeat and pid in host shared memory.

Peers in other processes of the host map it read-only and read it with plain
loads, so the liveness monitor never waits for a device to watch its peers or
to show it is alive itself.  (The same words once lived in the rank's arena
only, in device memory, and every read and heartbeat was a copy on a CUDA
stream.  Such a copy can be held up behind an application stream that waits
for a collective when the two share a hardware queue: with
CUDA_DEVICE_MAX_CONNECTIONS=1, or under MPS.  Then the monitor stopped
exactly while its process waited for a peer, and could no longer see that
peer die.)  The arena still holds the state for the daemon (a peer that left
on purpose, cuda/daemon/wait.cuh, ``rank_left``), written when it changes.

One file per rank, under $DFCCL_STATUS_DIR, /dev/shm or the temporary
directory, named after the owning process.  It exists only while peers look
it up: the owner removes it once every peer has mapped it (the end of the
bootstrap; the mappings stay), or at close, exit or SIGTERM
(termination.py).  Files left by processes that no longer exist (SIGKILL,
``os._exit``) are removed when a process creates its first page, by the
liveness monitor when it sees a peer's process exit, and by ``dfccl
status``: the page records its owner's start time and pid namespace beside
the pid, so that a reused pid or a live process of another pid namespace
keeps its page (processes.py)."""

from __future__ import annotations

import atexit
import itertools
import mmap
import os
import re
import struct
import threading

from dfccl.processes import owner_gone, pid_namespace, start_time
from dfccl.shared_files import create_mapped, matching_files, shared_directory
from dfccl.termination import on_sigterm

__all__ = ["StatusPage", "sweep"]

_SIZE = 64
_WORDS = struct.Struct("<QQQ")  # state, heartbeat, pid
_IDENTITY = struct.Struct("<QQ")  # at _WORDS.size: the owner's start time and pid namespace (0: unknown)
_counter = itertools.count()
_owned: set[str] = set()
_lock = threading.Lock()
_swept = False


def _directory() -> str:
    d = os.environ.get("DFCCL_STATUS_DIR")
    if d:
        return d
    return shared_directory()


def sweep(directory: str | None = None) -> list[str]:
    """Removes the pages of this user's processes that no longer exist
    (processes.owner_gone); returns their paths."""
    directory = directory or _directory()
    pattern = re.compile(rf"^dfccl-rank-{os.getuid()}-(\d+)-")
    removed = []
    for path, m in matching_files(directory, pattern):
        try:
            with open(path, "rb") as f:
                head = f.read(_WORDS.size + _IDENTITY.size)
            mtime = os.stat(path).st_mtime
        except OSError:
            continue   # gone already, or not readable: not ours to judge
        start = namespace = None
        if len(head) == _WORDS.size + _IDENTITY.size:
            start, namespace = _IDENTITY.unpack_from(head, _WORDS.size)
        if owner_gone(int(m.group(1)), start or None, namespace or None, mtime):
            try:
                os.unlink(path)
                removed.append(path)
            except OSError:
                pass
    return removed


class StatusPage:
    """One rank's (state, heartbeat, pid): created writable by its owner
    (:meth:`create`), opened read-only by peers (:meth:`open`)."""

    def __init__(self, path: str, mm: mmap.mmap, owner: bool):
        self.path = path
        self._mm: mmap.mmap | None = mm
        self.owner = owner

    @classmethod
    def create(cls, state: int) -> "StatusPage":
        global _swept
        directory = _directory()
        with _lock:
            if not _swept:
                _swept = True
                sweep(directory)
        path = os.path.join(directory, f"dfccl-rank-{os.getuid()}-{os.getpid()}-{next(_counter)}")
        # Truncated if it exists: a page of an earlier process with this pid
        # that recorded no start time is not swept (its pid is alive: ours).
        mm = create_mapped(path, _SIZE, exclusive=False, mode=0o644)
        with _lock:
            _owned.add(path)
        on_sigterm(_remove_owned_now)
        _IDENTITY.pack_into(mm, _WORDS.size, start_time(os.getpid()) or 0, pid_namespace() or 0)
        page = cls(path, mm, True)
        page.write(state, 0)
        return page

    @classmethod
    def open(cls, path: str) -> "StatusPage":
        fd = os.open(path, os.O_RDONLY)
        try:
            mm = mmap.mmap(fd, _SIZE, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        return cls(path, mm, False)

    def write(self, state: int, heartbeat: int) -> None:
        """The owner: publishes its state and heartbeat."""
        if self._mm is not None:
            _WORDS.pack_into(self._mm, 0, state, heartbeat, os.getpid())

    def read(self) -> tuple[int, int, int]:
        """(state, heartbeat, pid); a closed page reads as (0, 0, 0)."""
        mm = self._mm
        return (0, 0, 0) if mm is None else _WORDS.unpack_from(mm, 0)

    def unlink(self) -> None:
        """The owner: removes the file (every peer has mapped it); the
        mappings stay.  Idempotent."""
        if self.owner:
            _remove(self.path)

    def close(self) -> None:
        """Unmaps the page; the owner also removes its file.  Idempotent."""
        mm, self._mm = self._mm, None
        if mm is not None:
            mm.close()
        self.unlink()


def _remove(path: str) -> None:
    with _lock:
        _owned.discard(path)
    try:
        os.unlink(path)
    except OSError:
        pass


@atexit.register
def _remove_owned() -> None:
    for path in list(_owned):
        _remove(path)


def _remove_owned_now() -> None:
    # From the SIGTERM handler, which may interrupt a holder of _lock in
    # this thread: no lock (the process ends right after).
    for path in list(_owned):
        try:
            os.unlink(path)
        except OSError:
            pass


def _forget_in_child() -> None:
    # The parent's pages are not a forked child's to remove.
    global _lock
    _lock = threading.Lock()
    _owned.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
