"""Processes of this host: whether one still runs, and whether a file it left
in a shared directory (status page, status file) may be removed.

A pid alone does not name a process: it is reused once the process is
reaped, and a process in another pid namespace that shares the directory
(containers with one /dev/shm) has a pid that means nothing here.  So files
record the writer's start time (field 22 of /proc/<pid>/stat) and its pid
namespace (the inode of /proc/self/ns/pid) beside the pid."""

from __future__ import annotations

import os
import time

__all__ = ["start_time", "pid_namespace", "process_alive", "owner_gone", "UNIDENTIFIED_AGE"]

#: Seconds a file without the writer's start time and namespace (written by
#: an earlier version, or not written yet) must have stood unchanged before
#: the pid alone may say its writer is gone.
UNIDENTIFIED_AGE = 60.0


def _stat_fields(pid: int) -> list[bytes] | None:
    """The fields of /proc/<pid>/stat after the command name (which may
    contain spaces and parentheses); None where /proc does not say."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rfind(b")") + 2:].split()


def start_time(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks since boot, which
    tells a live process from a later one that reuses its pid; None where
    /proc does not say."""
    fields = _stat_fields(pid)
    try:
        return int(fields[19]) if fields else None
    except (IndexError, ValueError):
        return None


def pid_namespace() -> int | None:
    """This process's pid namespace (an inode number); None without /proc."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def process_alive(pid: int, start: int | None = None) -> bool:
    """Whether process ``pid`` runs (not exited, not a zombie), and is the one
    that started at ``start`` (clock ticks since boot) if given."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    except OSError:
        stat = None
    if stat is not None:
        fields = stat[stat.rfind(b")") + 2:].split()
        if fields and fields[0] in (b"Z", b"X"):
            return False
        if start is not None and len(fields) > 19 and int(fields[19]) != start:
            return False
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def owner_gone(pid: int, start: int | None, namespace: int | None, mtime: float) -> bool:
    """Whether the process that wrote a file -- ``pid``, started at
    ``start``, in pid namespace ``namespace`` (None: not recorded), the file
    last changed at ``mtime`` -- has exited, so that the file may go.  Never
    for a writer in another pid namespace: its pid cannot be checked here."""
    mine = pid_namespace()
    if namespace is not None and mine is not None:
        return namespace == mine and not process_alive(pid, start)
    # Unidentified: the pid is all there is; a fresh file may be another
    # namespace's, or one whose identity is still being written.
    return time.time() - mtime > UNIDENTIFIED_AGE and not process_alive(pid)
