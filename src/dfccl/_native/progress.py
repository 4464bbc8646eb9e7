"""The progress thread: one per process, serving every context.  It retires
completed collectives nobody waits for, runs their done-callbacks and adapts
the preemption policy; everything it does needs Python.  (Relaunching an
exited daemon does not, and is each context's relaunch watcher's:
Context._watch.)"""

import threading
import time
import warnings
import weakref

__all__ = ["progress"]


class _ProgressThread:
    """Retires completions, runs callbacks and adapts the preemption policy.
    (Relaunching exited daemons needs no GIL, so it is each context's
    relaunch watcher's: Context._watch.)"""

    def __init__(self):
        self._contexts = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread = None
        self._callbacks = []
        self.poll_interval = 50e-6

    def register(self, ctx):
        with self._lock:
            self._contexts.append(weakref.ref(ctx))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="dfccl-progress", daemon=True)
                self._thread.start()

    def unregister(self, ctx):
        with self._lock:
            self._contexts = [r for r in self._contexts if r() is not None and r() is not ctx]

    def wake(self):
        if not self._wake.is_set():
            self._wake.set()

    def run_callbacks(self, work, callbacks):
        if threading.current_thread() is self._thread:
            _call_all(work, callbacks)
        else:
            with self._lock:
                self._callbacks.append((work, list(callbacks)))
            self.wake()

    def _run(self):
        while True:
            with self._lock:
                contexts = [r() for r in self._contexts]
                pending_callbacks, self._callbacks = self._callbacks, []
            for work, cbs in pending_callbacks:
                _call_all(work, cbs)
            busy = False
            now = time.monotonic_ns()
            for ctx in contexts:
                if ctx is None:
                    continue
                try:
                    busy |= ctx._progress_step(now)
                except Exception as exc:  # never let the progress thread die
                    warnings.warn(f"dfccl progress thread: {exc!r}", RuntimeWarning)
            del contexts
            if busy:
                time.sleep(self.poll_interval)
            else:
                self._wake.wait(0.05)
                self._wake.clear()


def _call_all(work, callbacks):
    for fn in callbacks:
        try:
            fn(work)
        except Exception as exc:
            warnings.warn(f"dfccl: a done-callback raised {exc!r}", RuntimeWarning)


progress = _ProgressThread()
