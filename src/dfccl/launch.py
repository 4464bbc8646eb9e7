"""``python -m dfccl.launch``: run one process per rank on this host.

    python -m dfccl.launch -n 4 [--devices 0,1,2,3] [--backend sim] script.py args...
    python -m dfccl.launch -n 2 -m package.module args...

Each process gets torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), the rendezvous port dfccl's
store uses (DFCCL_ROOT_PORT), a fresh random shared secret (DFCCL_SECRET)
and, with ``--devices``, its device (DFCCL_DEVICE; the list is reused
round robin, so ``-n 4 --devices 0`` puts four ranks on GPU 0).  So
``dfccl.init_from_env()`` -- and torch's ``init_process_group`` -- work
unchanged in the script.

Output lines are prefixed with ``[rank]``.  SIGINT and SIGTERM are passed to
every rank.  When a rank exits with a failure the others are terminated with
SIGTERM, and the launcher exits with that rank's status; it exits 0 when
every rank succeeds.  Either way, a rank still running ``--grace`` seconds
(default 5) after the first signal -- one that ignores it, or one stopped by
SIGSTOP -- is killed with SIGKILL, and stderr says which rank and why.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time

__all__ = ["main", "launch"]


def _free_ports(n: int) -> list[int]:
    """``n`` distinct ports free at this moment on the loopback interface."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _parse_devices(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        devices = [int(d) for d in text.split(",") if d.strip()]
    except ValueError:
        raise SystemExit(f"dfccl.launch: --devices must be a comma-separated list of integers, not {text!r}")
    if not devices or any(d < 0 for d in devices):
        raise SystemExit(f"dfccl.launch: --devices must list device numbers >= 0, not {text!r}")
    return devices


def _pump(stream, rank: int, out, lock: threading.Lock) -> None:
    """Copies one child's output to ``out``, each line prefixed by its rank."""
    prefix = f"[{rank}] ".encode()
    for line in iter(stream.readline, b""):
        if not line.endswith(b"\n"):
            line += b"\n"
        with lock:
            out.buffer.write(prefix + line)
            out.flush()
    stream.close()


def launch(nprocs: int, command: list[str], *, devices: list[int] | None = None, backend: str | None = None,
           master_addr: str = "127.0.0.1", grace: float = 5.0, env: dict | None = None) -> int:
    """Runs ``command`` in ``nprocs`` processes as ranks 0..nprocs-1 and
    returns the launcher's exit status (0: every rank succeeded; else the
    first failing rank's status, 128 + signal for a rank killed by one)."""
    master_port, root_port = _free_ports(2)
    base = dict(os.environ if env is None else env)
    base.update(WORLD_SIZE=str(nprocs), LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR=master_addr,
                MASTER_PORT=str(master_port), DFCCL_ROOT_PORT=str(root_port), DFCCL_SECRET=secrets.token_hex(32),
                PYTHONUNBUFFERED="1")
    base.pop("DFCCL_ROOT_ADDR", None)  # this launcher's rendezvous, not an outer job's
    if backend is not None:
        base["DFCCL_BACKEND"] = backend
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    for rank in range(nprocs):
        child_env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0")
        if devices is not None:
            child_env["DFCCL_DEVICE"] = str(devices[rank % len(devices)])
        p = subprocess.Popen(command, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             start_new_session=True)
        procs.append(p)
        for stream, out in ((p.stdout, sys.stdout), (p.stderr, sys.stderr)):
            t = threading.Thread(target=_pump, args=(stream, rank, out, lock), daemon=True)
            t.start()
            pumps.append(t)

    ranks = _Ranks(procs, grace, lock)

    def on_signal(signum, _frame):
        ranks.stop(f"the launcher got {signal.Signals(signum).name}", signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    status = 0
    try:
        running = set(range(nprocs))
        while running:
            for rank in sorted(running):
                rc = procs[rank].poll()
                if rc is None:
                    continue
                running.discard(rank)
                if rc != 0 and status == 0:
                    status = rc if rc > 0 else 128 - rc
                    if not ranks.stopping:
                        ranks.report(f"rank {rank} exited with status {rc}; stopping the other ranks")
                    ranks.stop(f"rank {rank} exited with status {rc}")
            ranks.escalate()
            time.sleep(0.05)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        ranks.stop("the launcher is exiting")
        ranks.wait()
        for t in pumps:
            t.join(timeout=5)
    return status


class _Ranks:
    """Stops the ranks: a signal to every rank's process group, then, for
    each rank still running ``grace`` seconds later, SIGKILL (a rank may
    ignore the signal, or be stopped, where only SIGKILL ends it)."""

    def __init__(self, procs: list[subprocess.Popen], grace: float, lock: threading.Lock):
        self._procs = procs
        self._grace = max(0.0, grace)
        self._lock = lock
        self._deadline: float | None = None
        self._why = ""
        self._signame = ""
        self._killed: set[int] = set()

    @property
    def stopping(self) -> bool:
        return self._deadline is not None

    def report(self, text: str) -> None:
        with self._lock:
            sys.stderr.write(f"dfccl.launch: {text}\n")
            sys.stderr.flush()

    def stop(self, why: str, signum: int = signal.SIGTERM) -> None:
        """Sends ``signum`` to every running rank; the grace period starts
        at the first call (a repeated signal is passed on, not waited for
        anew)."""
        if self._deadline is None:
            self._deadline = time.monotonic() + self._grace
            self._why, self._signame = why, signal.Signals(signum).name
        for p in self._procs:
            if p.poll() is None:
                _signal_group(p, signum)

    def escalate(self) -> None:
        """SIGKILL to every rank still running once the grace period is over."""
        if self._deadline is None or time.monotonic() < self._deadline:
            return
        for rank, p in enumerate(self._procs):
            if p.poll() is not None or rank in self._killed:
                continue
            self._killed.add(rank)
            stopped = " (it is stopped, e.g. by SIGSTOP)" if _is_stopped(p.pid) else ""
            self.report(f"killing rank {rank} (pid {p.pid}) with SIGKILL: still running {self._grace:g} s "
                        f"(--grace) after {self._signame}{stopped}; the ranks were stopped because {self._why}")
            _signal_group(p, signal.SIGKILL)

    def wait(self) -> None:
        """Waits for every rank, escalating after the grace period."""
        while any(p.poll() is None for p in self._procs):
            self.escalate()
            time.sleep(0.05)


def _signal_group(p: subprocess.Popen, signum: int) -> None:
    # Each rank leads its own session: its children get the signal too.
    try:
        os.killpg(p.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _is_stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:][:1] in (b"T", b"t")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dfccl.launch",
                                     description="Run one process per rank on this host (torchrun-style variables).")
    parser.add_argument("-n", "--nprocs", type=int, required=True, help="number of ranks (processes)")
    parser.add_argument("--devices", help="comma-separated devices, one per rank, reused round robin")
    parser.add_argument("--backend", choices=("cuda", "sim"), help="sets DFCCL_BACKEND in every rank")
    parser.add_argument("--master-addr", default="127.0.0.1", help="MASTER_ADDR (default 127.0.0.1)")
    parser.add_argument("--grace", type=float, default=5.0,
                        help="seconds between SIGTERM and SIGKILL when stopping ranks (default 5)")
    parser.add_argument("-m", "--module", action="store_true", help="run the target as a module (python -m)")
    parser.add_argument("target", help="script (or module with -m)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    ns = parser.parse_args(argv)
    if ns.nprocs < 1:
        parser.error("-n must be >= 1")
    command = [sys.executable, "-u"] + (["-m", ns.target] if ns.module else [ns.target]) + ns.args
    return launch(ns.nprocs, command, devices=_parse_devices(ns.devices), backend=ns.backend,
                  master_addr=ns.master_addr, grace=ns.grace)


if __name__ == "__main__":
    sys.exit(main())
