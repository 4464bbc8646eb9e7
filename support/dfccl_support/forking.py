"""Running a test body in a forked child: what a process that forks after
using dfccl (a data-loader worker, a helper started with ``os.fork``) sees.
Used by the fork tests on the simulator and on GPUs."""

from __future__ import annotations

import atexit
import json
import os
import time
import warnings
from typing import Callable

__all__ = ["run_in_forked_child", "outcomes"]


def run_in_forked_child(body: Callable[[], dict], timeout: float = 60.0) -> dict:
    """Runs ``body()`` in a forked child and returns the JSON-able dict it
    returned, or ``{"error": ...}`` with what it raised.  The child then runs
    the exit handlers, timed (``"exit_s"``: a normal exit's), and leaves with
    ``os._exit`` so that it never returns into the caller's code (a test
    runner, say)."""
    r, w = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)   # forking a multithreaded process
        pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            try:
                out = body()
            except BaseException as exc:  # reported to the parent
                out = {"error": f"{type(exc).__name__}: {exc}"}
            t0 = time.monotonic()
            atexit._run_exitfuncs()
            out["exit_s"] = time.monotonic() - t0
            os.write(w, json.dumps(out).encode())
        finally:
            os._exit(0)
    os.close(w)
    data = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            chunk = os.read(r, 65536)
            if not chunk:
                break
            data += chunk
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    if not data:
        raise RuntimeError(f"the forked child {pid} reported nothing")
    return json.loads(data)


def outcomes(calls: dict[str, Callable[[], object]]) -> dict:
    """Runs each call; per name, None if it returned, else ``"Type: message"``
    of what it raised, and ``"<name>_s"``, the seconds it took."""
    out: dict = {}
    for name, call in calls.items():
        t0 = time.monotonic()
        try:
            call()
            out[name] = None
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
        out[f"{name}_s"] = time.monotonic() - t0
    return out
