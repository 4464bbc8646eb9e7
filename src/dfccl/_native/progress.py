"""The progress thread: one per process.  It retires the collectives nobody
waits for, once a daemon's watcher (Daemon._watch, which never takes the
GIL) has found them complete at two of its looks, and runs done-callbacks
(Work.add_done_callback): user code that may block or take long, so it runs
here rather than on the thread that retired the Work.  It sleeps until the
watcher or a new callback wakes it; it never polls."""

import os
import threading
import warnings
import weakref

from dfccl._native.cuda_driver import relax_thread_capture_mode
from dfccl.termination import block_async_signals

__all__ = ["progress"]


class _ProgressThread:
    """Retires what the watchers found due and runs done-callbacks."""

    def __init__(self):
        self._lock = threading.Lock()
        self._daemons = []
        self._thread = None
        self._callbacks = []

    def register(self, daemon):
        with self._lock:
            self._daemons.append(weakref.ref(daemon))
            self._start_locked()

    def unregister(self, daemon):
        with self._lock:
            self._daemons = [r for r in self._daemons if r() is not None and r() is not daemon]

    def run_callbacks(self, work, callbacks):
        if threading.current_thread() is self._thread:
            _call_all(work, callbacks)
            return
        with self._lock:
            self._callbacks.append((work, list(callbacks)))
            self._start_locked()
        _native().wake_progress()

    def _start_locked(self):
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="dfccl-progress", daemon=True)
            self._thread.start()

    def _run(self):
        block_async_signals()
        relax_thread_capture_mode()   # its CUDA calls must not break a graph captured meanwhile
        native = _native()
        while True:
            native.wait_progress(0.05)
            with self._lock:
                daemons = [r() for r in self._daemons]
                pending, self._callbacks = self._callbacks, []
            for work, cbs in pending:
                _call_all(work, cbs)
            for daemon in daemons:
                if daemon is None:
                    continue
                try:
                    daemon._retire_due()
                except Exception as exc:  # never let the progress thread die
                    warnings.warn(f"dfccl progress thread: {exc!r}", RuntimeWarning)
            del daemons


def _native():
    # The wake-up is C state (launch.pyx), which C paths without the GIL release.
    from dfccl._native import launch
    return launch


def _call_all(work, callbacks):
    for fn in callbacks:
        try:
            fn(work)
        except Exception as exc:
            warnings.warn(f"dfccl: a done-callback raised {exc!r}", RuntimeWarning)


progress = _ProgressThread()

# A forked child has no progress thread and none of the parent's daemons
# (runtime.py forgets them): it starts with an empty one.
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=progress.__init__)
