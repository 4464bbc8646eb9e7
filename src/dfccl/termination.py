"""Removing this process's shared files when SIGTERM ends it.

SIGTERM's default action ends a process without running its exit handlers,
so the files it keeps in a shared directory (status pages, the status file)
would stay.  Where the application has not set a SIGTERM handler of its own,
dfccl sets one that removes them and then ends the process by SIGTERM as
before (the default action, same exit status).  An application that sets
its own handler replaces this one; leaving through ``sys.exit`` then runs the
exit handlers, which remove the files as well.

Python runs the handler in the main thread, between bytecodes: a main thread
blocked in native code that never checks for signals ends only when it
returns (dfccl's own waits check every 20 ms).  SIGKILL ends it regardless;
files left that way are removed by the next dfccl process of the host, and
by ``dfccl status``."""

from __future__ import annotations

import os
import signal
import threading
from typing import Callable

__all__ = ["on_sigterm", "block_async_signals"]

_cleanups: list[Callable[[], None]] = []
_settled = False   # the handler is set, or the application's own was found


def on_sigterm(cleanup: Callable[[], None]) -> None:
    """Runs ``cleanup`` (which must not block) when SIGTERM ends the process;
    sets the handler if the application has none.  Only the main thread can
    set a handler: a call from another thread registers ``cleanup`` and
    leaves the handler to the next call from the main thread."""
    global _settled
    if cleanup not in _cleanups:
        _cleanups.append(cleanup)
    if _settled or threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError):
        return
    _settled = True


#: What a helper thread leaves deliverable: faults it causes itself.
_SYNCHRONOUS = {getattr(signal, n) for n in ("SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGABRT", "SIGTRAP", "SIGSYS")
                if hasattr(signal, n)}


def block_async_signals() -> None:
    """Called first by each of dfccl's helper threads: a signal sent to the
    process (SIGTERM, SIGINT) then reaches a thread that does not block it,
    the main thread in practice.  Python runs handlers only in the main
    thread, and a main thread asleep in a system call (``time.sleep``) is
    woken only by a signal delivered to it: one that landed on a helper
    thread would wait for the sleep to end.  Threads a helper starts
    inherit the mask (the simulator's and the network proxy's native
    threads block the same set themselves: host_signals.h)."""
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals() - _SYNCHRONOUS)


def _on_sigterm(signum: int, _frame) -> None:
    for cleanup in list(_cleanups):
        try:
            cleanup()
        except Exception:
            pass   # the process ends either way
    # The default action, as if no handler had been set.
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
