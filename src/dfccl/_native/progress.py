"""The progress thread: one per process, it runs done-callbacks
(Work.add_done_callback).  Callbacks are user code and may block or take
long, so they run here rather than on the thread that retired their Work
(a context's watcher, or a thread in synchronize).  Retiring collectives
nobody waits for and relaunching exited daemons are each context's
watcher's (Context._watch), which needs the GIL only to retire."""

import threading
import warnings

__all__ = ["progress"]


class _ProgressThread:
    """Runs done-callbacks in the order their Works were retired."""

    def __init__(self):
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread = None
        self._callbacks = []

    def run_callbacks(self, work, callbacks):
        if threading.current_thread() is self._thread:
            _call_all(work, callbacks)
            return
        with self._lock:
            self._callbacks.append((work, list(callbacks)))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="dfccl-progress", daemon=True)
                self._thread.start()
        self._wake.set()

    def _run(self):
        while True:
            self._wake.wait()
            self._wake.clear()
            with self._lock:
                pending, self._callbacks = self._callbacks, []
            for work, cbs in pending:
                _call_all(work, cbs)


def _call_all(work, callbacks):
    for fn in callbacks:
        try:
            fn(work)
        except Exception as exc:
            warnings.warn(f"dfccl: a done-callback raised {exc!r}", RuntimeWarning)


progress = _ProgressThread()
