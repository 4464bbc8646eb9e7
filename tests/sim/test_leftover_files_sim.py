"""The files a process keeps in the status directory (its status file,
dfccl-status-*.json, and its ranks' status pages, dfccl-rank-*) go however
it ends: SIGTERM removes them (the handler dfccl sets where the application
has none), and what SIGKILL leaves is removed by the next process that
starts a monitor, by a peer's monitor that sees the process exit, and by
``dfccl status``.  Real processes, simulator."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import dfccl

DEV = 4400          # device ids of this module: 4400..4499
TIMEOUT = 60

# A process with a status file (a communicator with a pending collective)
# and a status page, as a rank holds it while it waits for peers in other
# processes to map it (a communicator in start-up would leave its simulated
# device memory behind as well when killed).
HOLDER = textwrap.dedent("""
    import sys, time
    import numpy as np
    import dfccl
    from dfccl.status_page import StatusPage
    {prelude}
    comms = dfccl.Communicator.for_devices([{dev}, {dev1}], backend="sim")
    comms[0].all_reduce(np.ones(16, np.float32), tag="pending")
    page = StatusPage.create(0)
    print("ready", flush=True)
    time.sleep(120)
""")


def _files_of(directory, pid: int) -> list[str]:
    uid = os.getuid()
    return sorted(n for n in os.listdir(directory)
                  if n.startswith((f"dfccl-status-{uid}-{pid}.", f"dfccl-rank-{uid}-{pid}-")))


def _env(directory) -> dict:
    package_root = os.path.dirname(os.path.dirname(dfccl.__file__))
    return dict(os.environ, DFCCL_STATUS_DIR=str(directory), PYTHONPATH=package_root)


def _start_holder(directory, dev: int, prelude: str = "") -> subprocess.Popen:
    """The holder, once its status file and its status page exist."""
    script = HOLDER.format(prelude=prelude, dev=dev, dev1=dev + 1)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=_env(directory))
    assert proc.stdout.readline().strip() == "ready"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        names = _files_of(directory, proc.pid)
        if any(n.startswith("dfccl-status-") for n in names) and any(n.startswith("dfccl-rank-") for n in names):
            return proc
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    pytest.fail(f"the holder's files did not appear: {os.listdir(directory)}")


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=TIMEOUT)


def test_sigterm_removes_the_files_and_still_ends_the_process(tmp_path):
    proc = _start_holder(tmp_path, DEV)
    try:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=TIMEOUT) == -signal.SIGTERM   # as without a handler
    finally:
        _kill(proc)
    assert _files_of(tmp_path, proc.pid) == []


def test_the_application_s_sigterm_handler_is_kept(tmp_path):
    prelude = textwrap.dedent("""
        import signal
        def on_term(signum, frame):
            print("the application's handler", flush=True)
            sys.exit(7)
        signal.signal(signal.SIGTERM, on_term)
    """)
    proc = _start_holder(tmp_path, DEV + 10, prelude)
    try:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=TIMEOUT) == 7
        assert "the application's handler" in proc.stdout.read()
    finally:
        _kill(proc)
    assert _files_of(tmp_path, proc.pid) == []   # its exit handlers removed them


def test_what_sigkill_leaves_goes_when_the_next_process_starts(tmp_path):
    killed = _start_holder(tmp_path, DEV + 20)
    _kill(killed)
    assert len(_files_of(tmp_path, killed.pid)) == 2
    script = textwrap.dedent(f"""
        import os, time
        import dfccl
        from dfccl import liveness
        comms = dfccl.Communicator.for_devices([{DEV + 30}, {DEV + 31}], backend="sim")
        deadline = time.monotonic() + 20
        while not os.path.exists(liveness.status_path()) and time.monotonic() < deadline:
            time.sleep(0.05)
        print(sorted(os.listdir({str(tmp_path)!r})))
        for c in comms:
            c.close()
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=_env(tmp_path),
                       timeout=TIMEOUT)
    assert r.returncode == 0, r.stderr
    # Listed once the new process's own status file stood: gone by then.
    assert f"-{killed.pid}." not in r.stdout and f"-{killed.pid}-" not in r.stdout and f"dfccl-status-{os.getuid()}-" in r.stdout, r.stdout
    assert _files_of(tmp_path, killed.pid) == []


def test_dfccl_status_removes_what_sigkill_left(tmp_path):
    killed = _start_holder(tmp_path, DEV + 40)
    _kill(killed)
    assert len(_files_of(tmp_path, killed.pid)) == 2
    r = subprocess.run([sys.executable, "-m", "dfccl", "status", "--dir", str(tmp_path)], capture_output=True,
                       text=True, env=_env(tmp_path), timeout=TIMEOUT)
    assert r.returncode == 0, r.stderr
    assert "no running process" in r.stdout
    assert _files_of(tmp_path, killed.pid) == []
