"""NCCL reference runs of dfccl's deadlock scenarios, through torch.distributed
(and, for the stream-ordered case, through CuPy's NCCL binding).

dfccl claims that it never hangs where NCCL hangs.  To back that claim the GPU
test suite runs each deadlock scenario with dfccl *and* with NCCL, and records
what NCCL did: hung, silently produced wrong values, or completed.  This module
is the NCCL side.  It starts one fresh Python process per rank (each in its own
process group), lets each rank run the scenario with ``torch.distributed`` and
report its progress as JSON lines, and watches them against a wall-clock
deadline.  On timeout it SIGKILLs every rank's whole process group, so the
caller never hangs and no child outlives the call.

The module imports only the standard library at import time; torch is imported
in the rank processes (and in a probe subprocess for :func:`available`), never
in the caller, so that the caller's own CUDA state is left alone and a broken
driver cannot hang it.  The rank processes load this file by path, without
importing the ``dfccl`` package (whose ``__init__`` needs the compiled
extensions); the file also works imported as ``dfccl_support.nccl_reference``.

Scenarios (every tensor holds ``count`` float32 elements; element ``i`` of
rank ``r``'s input is ``(r + 1) + i % 16`` for collective A and
``100 * (r + 1) + i % 16`` for collective B, so that each sum is exact and a
mismatched pairing shows up in every element):

``inconsistent_order_two_groups``
    Two process groups over all ranks.  Even ranks all_reduce A on g_a then B
    on g_b, odd ranks B then A; then synchronize.
``inconsistent_order_one_group``
    The same orders on one group: NCCL (and gloo) match collectives by
    position, so A is reduced together with B (``wrong_result``) unless it hangs.
``wait_between``
    Two groups.  Rank 0 issues A, synchronizes (waits for A), then issues B;
    the other ranks issue B then A and synchronize once at the end.
``device_sync``
    As ``inconsistent_order_two_groups`` but every rank synchronizes between
    its two collectives.

"Synchronize" means ``work.wait()`` on each pending collective and, for NCCL,
``torch.cuda.synchronize()`` (a device-wide wait): with NCCL ``wait()`` only
orders streams, with gloo it is the blocking wait.

:func:`stream_order_reference` is the one scenario torch.distributed cannot
express, since torch gives every process group its own stream: two NCCL
communicators whose collectives share one stream per GPU (as a framework's
compute stream or a CUDA graph orders them), rank 0 enqueuing A then B and
rank 1 B then A.  It drives NCCL through CuPy (``cupy.cuda.nccl``), one
thread per GPU, in a subprocess so that the stuck kernels die with it.

Command line::

    python -m dfccl_support.nccl_reference [--backend nccl|gloo] [--timeout S] [SCENARIO ...]
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field

__all__ = ["Verdict", "SCENARIOS", "OUTCOMES", "FORCED_ENV", "run_nccl_scenario", "available",
           "stream_order_reference", "cupy_nccl_available", "main"]

SCENARIOS = ("inconsistent_order_two_groups", "inconsistent_order_one_group", "wait_between", "device_sync")
OUTCOMES = ("completed", "hung", "wrong_result", "error", "unavailable")
BACKENDS = ("nccl", "gloo")

# Set in every rank process, after the caller's overrides, so that they cannot
# be turned back on: NVLink multicast can take a shared host's GPUs out of
# service, and these scenarios need none of it.
FORCED_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

_PATTERN = 16            # inputs carry i % _PATTERN so that results differ element to element
_EXIT_GRACE = 5.0        # seconds finished ranks get to exit on their own before they are killed
_KILL_WAIT = 10.0        # seconds to wait for a SIGKILLed rank to be reaped
_STDERR_TAIL = 16384     # bytes of each rank's stderr kept for the verdict
_PROBE_TIMEOUT = 120.0   # importing torch and counting GPUs; generous, since a cold CUDA start is slow


@dataclass
class Verdict:
    """What NCCL (or another torch.distributed backend) did in one scenario.

    outcome: one of :data:`OUTCOMES`.  ``hung`` means every rank got through
    setup and the scenario did not finish within the timeout; ``error`` covers
    crashes, a rank exiting early and setup not finishing in time.
    seconds: wall time of the scenario phase, from the moment every rank had
    finished setup until all had finished or were killed (0.0 if the scenario
    phase never began).
    setup_seconds: wall time from launch until every rank had finished setup
    (torch import, init_process_group, one warm-up collective per group), or
    until the run was abandoned during setup.
    per_rank: one dict per launched rank: rank, pid, returncode, ready,
    finished, submitted steps, synchronized batches, waiting_for (the steps a
    rank was blocked on when it was killed), results per step, error,
    stderr_tail and all its events."""

    scenario: str
    outcome: str
    seconds: float
    detail: str
    per_rank: list[dict] = field(default_factory=list)
    setup_seconds: float = 0.0

    def summary(self) -> str:
        """One line: scenario, outcome, time and detail (the CLI prints this)."""
        return f"{self.scenario:<32} {self.outcome:<12} {self.seconds:7.2f}s  {self.detail}"


# -- what each rank does ------------------------------------------------------------------------
def _plan(name: str, rank: int) -> list[tuple[str, ...]]:
    """Rank ``rank``'s actions in scenario ``name``: ("submit", step) or ("sync",)."""
    first, second = ("A", "B") if rank % 2 == 0 else ("B", "A")
    if name in ("inconsistent_order_two_groups", "inconsistent_order_one_group"):
        return [("submit", first), ("submit", second), ("sync",)]
    if name == "wait_between":
        if rank == 0:
            return [("submit", "A"), ("sync",), ("submit", "B"), ("sync",)]
        return [("submit", "B"), ("submit", "A"), ("sync",)]
    if name == "device_sync":
        return [("submit", first), ("sync",), ("submit", second), ("sync",)]
    raise ValueError(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}")


def _scale(step: str) -> int:
    return 1 if step == "A" else 100


class _Reporter:
    """Writes progress events as JSON lines to the process's original stdout.

    File descriptor 1 is then pointed at stderr, so that anything else that
    prints to stdout (NCCL_DEBUG output, C libraries, stray prints) cannot
    corrupt the report stream."""

    def __init__(self, rank: int) -> None:
        sys.stdout.flush()
        self._fd = os.dup(1)
        os.dup2(2, 1)
        self._rank = rank
        self._t0 = time.monotonic()

    def emit(self, event: str, **fields: object) -> None:
        # t: seconds since this rank started; wall: the host clock, comparable across ranks.
        record = {"rank": self._rank, "event": event, "t": round(time.monotonic() - self._t0, 4),
                  "wall": time.time(), **fields}
        data = (json.dumps(record, default=str) + "\n").encode()
        while data:  # os.write may write less than asked on a pipe
            data = data[os.write(self._fd, data):]


def _run_rank(args: argparse.Namespace, rank: int, world_size: int, local_rank: int, report: _Reporter) -> None:
    """Runs one rank of the scenario; raises on any failure."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    cuda = args.backend == "nccl"
    if cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    # Our own deadline must fire first: the process-group timeout would
    # otherwise turn a hang into an abort (NCCL watchdog) or an exception.
    dist.init_process_group(args.backend, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=args.pg_timeout))
    everyone = list(range(world_size))
    g_a = dist.new_group(ranks=everyone)
    g_b = g_a if args.scenario == "inconsistent_order_one_group" else dist.new_group(ranks=everyone)
    groups = {"A": g_a, "B": g_b}

    # One warm-up collective per group, in the same order everywhere, so that
    # communicators exist (torch creates NCCL communicators lazily) and a hang
    # in the scenario is about ordering, not about communicator set-up.
    for g in dict.fromkeys((g_a, g_b)):
        t = torch.ones(1, device=device)
        dist.all_reduce(t, group=g)
        if cuda:
            torch.cuda.synchronize()
        if float(t.item()) != float(world_size):
            raise RuntimeError(f"warm-up all_reduce gave {t.item()}, want {world_size}")

    pattern = torch.arange(args.count, dtype=torch.float32, device=device) % _PATTERN
    tensors = {s: pattern + float(_scale(s) * (rank + 1)) for s in ("A", "B")}
    if cuda:
        torch.cuda.synchronize()  # inputs written before any collective is issued
    report.emit("ready")

    works: dict[str, object] = {}
    pending: list[str] = []
    for action in _plan(args.scenario, rank):
        if action[0] == "submit":
            step = action[1]
            works[step] = dist.all_reduce(tensors[step], op=dist.ReduceOp.SUM, group=groups[step], async_op=True)
            pending.append(step)
            report.emit("submitted", step=step)
        else:
            report.emit("waiting", steps=pending)
            for step in pending:
                works[step].wait()
            if cuda:
                torch.cuda.synchronize()
            report.emit("synchronized", steps=pending)
            pending = []

    total = world_size * (world_size + 1) // 2
    pattern_cpu = pattern.cpu()
    for step in ("A", "B"):
        got = tensors[step].cpu()
        want = pattern_cpu * world_size + float(_scale(step) * total)
        bad = torch.nonzero(got != want).flatten()
        first_bad = None
        if bad.numel():
            i = int(bad[0])
            first_bad = {"index": i, "got": float(got[i]), "want": float(want[i])}
        report.emit("done", step=step, ok=not bad.numel(), wrong=int(bad.numel()), first_bad=first_bad)


def _worker_main(argv: list[str]) -> int:
    """Entry point of one rank process; returns its exit status."""
    p = argparse.ArgumentParser(prog="nccl_reference --worker")
    p.add_argument("--worker", action="store_true")
    p.add_argument("--scenario", required=True, choices=SCENARIOS)
    p.add_argument("--backend", required=True, choices=BACKENDS)
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--pg-timeout", type=float, required=True)
    args = p.parse_args(argv)
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    report = _Reporter(rank)
    report.emit("started", pid=os.getpid(), env={k: os.environ.get(k) for k in FORCED_ENV})
    try:
        _run_rank(args, rank, world_size, local_rank, report)
    except BaseException as exc:  # reported, then the process exits non-zero
        report.emit("error", error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
        return 1
    report.emit("finished")
    try:
        import torch.distributed as dist
        dist.destroy_process_group()
    except Exception:  # teardown problems do not change what the scenario did
        pass
    return 0


def _worker_entry(argv: list[str]) -> None:
    """Runs a rank and leaves with os._exit: interpreter teardown with live
    torch/NCCL threads can hang or crash, which would blur the verdict."""
    try:
        rc = _worker_main(argv)
    except BaseException:
        traceback.print_exc()
        rc = 1
    sys.stderr.flush()
    os._exit(rc)


# -- launching and watching ---------------------------------------------------------------------
def _python_prelude() -> str:
    """Code that runs first in every child: drop the current directory from
    sys.path, since a checkout's directories (src/dfccl has a ``types.py``)
    could otherwise shadow standard modules."""
    return "import sys; sys.path[:] = [p for p in sys.path if p not in ('', '.')]\n"


def _bootstrap() -> str:
    """``python -c`` code that loads this file by path and runs a rank, so the
    rank never imports the ``dfccl`` package."""
    path = os.path.abspath(__file__)
    return (_python_prelude()
            + "import importlib.util\n"
            + f"spec = importlib.util.spec_from_file_location('_dfccl_nccl_reference_worker', {path!r})\n"
            + "mod = importlib.util.module_from_spec(spec)\n"
            + "sys.modules[spec.name] = mod\n"
            + "spec.loader.exec_module(mod)\n"
            + "mod._worker_entry(sys.argv[1:])\n")


def _free_port() -> int:
    """A TCP port that was free a moment ago (the OS picks it when binding port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child_env(env: dict | None, backend: str | None = None, ours: dict | None = None) -> dict[str, str]:
    """The environment of a child: ours, then ``ours`` (rendezvous variables),
    then the caller's ``env`` overrides, then :data:`FORCED_ENV`, which nothing undoes."""
    e = dict(os.environ)
    if backend == "gloo":
        # Gloo otherwise resolves the hostname to pick an interface, which
        # fails in many containers; every rank is on this host anyway.
        e.setdefault("GLOO_SOCKET_IFNAME", "lo")
    e.update(ours or {})
    if env:
        e.update({str(k): str(v) for k, v in env.items()})
    e.update(FORCED_ENV)
    return e


def _kill_groups(procs: list[subprocess.Popen]) -> None:
    """SIGKILL each rank's whole process group (each leads its own session),
    all before reaping any, so that no rank outlives a killed peer long enough
    to react to it; then reap them."""
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # already gone
    for proc in procs:
        try:
            proc.wait(timeout=_KILL_WAIT)
        except subprocess.TimeoutExpired:
            pass  # stuck in the kernel (e.g. a GPU driver call); reported via returncode None


class _Rank:
    """The parent's view of one rank process."""

    def __init__(self, rank: int, proc: subprocess.Popen) -> None:
        self.rank = rank
        self.proc = proc
        self.events: list[dict] = []
        self.noise: list[str] = []   # stdout lines that were not our JSON (kept, a few)
        self.stdout_closed = False   # EOF seen: the rank has exited (or closed its report stream)
        self._out = bytearray()
        self._err = bytearray()

    def feed_stdout(self, data: bytes) -> None:
        self._out += data
        while b"\n" in self._out:
            line, _, rest = self._out.partition(b"\n")
            self._out = bytearray(rest)
            self._parse(line)

    def feed_stderr(self, data: bytes) -> None:
        self._err += data
        if len(self._err) > _STDERR_TAIL:
            del self._err[:-_STDERR_TAIL]

    def close_stdout(self) -> None:
        self.stdout_closed = True
        if self._out:
            self._parse(bytes(self._out))
            self._out.clear()

    def _parse(self, line: bytes) -> None:
        text = line.decode(errors="replace").strip()
        if not text:
            return
        try:
            record = json.loads(text)
        except ValueError:
            record = None
        if isinstance(record, dict) and "event" in record:
            self.events.append(record)
        elif len(self.noise) < 50:
            self.noise.append(text[:500])

    def has(self, event: str) -> bool:
        return any(e["event"] == event for e in self.events)

    @property
    def ready(self) -> bool:
        return self.has("ready")

    @property
    def finished(self) -> bool:
        return self.has("finished")

    @property
    def error(self) -> str | None:
        for e in self.events:
            if e["event"] == "error":
                return str(e.get("error"))
        return None

    @property
    def stderr_tail(self) -> str:
        return self._err.decode(errors="replace")

    def waiting_for(self) -> list[str] | None:
        """Steps the rank was blocked on: its last "waiting" with no "synchronized" after it."""
        waiting = None
        for e in self.events:
            if e["event"] == "waiting":
                waiting = list(e.get("steps", []))
            elif e["event"] == "synchronized":
                waiting = None
        return waiting

    def results(self) -> dict[str, dict]:
        return {e["step"]: {k: e.get(k) for k in ("ok", "wrong", "first_bad")}
                for e in self.events if e["event"] == "done"}

    def as_dict(self) -> dict:
        started = next((e for e in self.events if e["event"] == "started"), {})
        return {
            "rank": self.rank,
            "pid": self.proc.pid,
            "returncode": self.proc.returncode,
            "env": started.get("env"),
            "ready": self.ready,
            "finished": self.finished,
            "submitted": [e["step"] for e in self.events if e["event"] == "submitted"],
            "synchronized": [e.get("steps", []) for e in self.events if e["event"] == "synchronized"],
            "waiting_for": self.waiting_for(),
            "results": self.results(),
            "last_event": self.events[-1] if self.events else None,
            "error": self.error,
            "stderr_tail": self.stderr_tail[-4000:],
            "stdout_noise": list(self.noise),
            "events": list(self.events),
        }

    def progress(self) -> str:
        """Short human account for a verdict's detail."""
        if not self.events:
            return f"rank {self.rank}: no report"
        parts = []
        sub = [e["step"] for e in self.events if e["event"] == "submitted"]
        if sub:
            parts.append("submitted " + ",".join(sub))
        if not self.ready:
            parts.append("still in setup")
        waiting = self.waiting_for()
        if self.finished:
            parts.append("finished")
        elif waiting is not None:
            parts.append(f"blocked waiting for {','.join(waiting) or 'nothing'}")
        return f"rank {self.rank}: " + ("; ".join(parts) or self.events[-1]["event"])


def _watch(ranks: list[_Rank], *, timeout: float, setup_timeout: float) -> tuple[str, float, float]:
    """Reads every rank's stdout and stderr until all have finished, one has
    failed, or the deadline passes.  Returns (reason, setup_seconds,
    scenario_seconds); reason is "finished", "failed", "setup_timeout" or
    "timeout".  Does not kill anything (the caller does, always)."""
    sel = selectors.DefaultSelector()
    for r in ranks:
        sel.register(r.proc.stdout, selectors.EVENT_READ, (r, "out"))
        sel.register(r.proc.stderr, selectors.EVENT_READ, (r, "err"))
    t0 = time.monotonic()
    deadline = t0 + setup_timeout
    scenario_t0: float | None = None
    finished_at: float | None = None
    try:
        while True:
            now = time.monotonic()
            if scenario_t0 is None and all(r.ready for r in ranks):
                scenario_t0 = now
                deadline = now + timeout
            if finished_at is None and all(r.finished for r in ranks):
                finished_at = now
                deadline = min(deadline, now + _EXIT_GRACE)  # let them exit cleanly, briefly
            if finished_at is None and any(r.error is not None or (r.stdout_closed and not r.finished)
                                           for r in ranks):
                # One rank failed or is gone (judged by EOF on its reports, not
                # by its exit status, so a "finished" still in the pipe is not
                # missed): its peers would wait for it until their own
                # timeouts, so there is nothing more to learn.
                reason = "failed"
                break
            if not sel.get_map():
                reason = "finished" if finished_at is not None else "failed"
                break
            if now >= deadline:
                if finished_at is not None:
                    reason = "finished"
                else:
                    reason = "timeout" if scenario_t0 is not None else "setup_timeout"
                break
            for key, _ in sel.select(timeout=min(deadline - now, 0.25)):
                _pump(sel, key)
        end = finished_at if finished_at is not None else time.monotonic()
        setup_s = (scenario_t0 if scenario_t0 is not None else end) - t0
        scenario_s = end - scenario_t0 if scenario_t0 is not None else 0.0
        return reason, setup_s, scenario_s
    finally:
        sel.close()


def _pump(sel: selectors.BaseSelector, key: selectors.SelectorKey) -> None:
    """Moves what one rank's pipe holds into its _Rank; unregisters it at EOF."""
    r, kind = key.data
    try:
        data = os.read(key.fd, 65536)
    except OSError:
        data = b""
    if not data:
        sel.unregister(key.fileobj)
        if kind == "out":
            r.close_stdout()
        return
    (r.feed_stdout if kind == "out" else r.feed_stderr)(data)


def _drain(ranks: list[_Rank], *, events: bool, budget: float = 1.0) -> None:
    """After the kill: collect what the dead ranks left in their pipes (a
    traceback on stderr; their last events unless ``events`` is false), for
    at most ``budget`` seconds."""
    sel = selectors.DefaultSelector()
    for r in ranks:
        streams = ((r.proc.stdout, "out"), (r.proc.stderr, "err")) if events else ((r.proc.stderr, "err"),)
        for stream, kind in streams:
            if stream is not None and not stream.closed:
                sel.register(stream, selectors.EVENT_READ, (r, kind))
    end = time.monotonic() + budget
    try:
        while sel.get_map() and time.monotonic() < end:
            for key, _ in sel.select(timeout=max(0.0, min(0.1, end - time.monotonic()))):
                _pump(sel, key)
    finally:
        sel.close()


def _wall(r: _Rank, event: str) -> float | None:
    return next((float(e["wall"]) for e in r.events if e["event"] == event and "wall" in e), None)


def _classify(name: str, ranks: list[_Rank], reason: str, setup_s: float, scenario_s: float, *,
              timeout: float, setup_timeout: float) -> Verdict:
    per_rank = [r.as_dict() for r in ranks]

    def verdict(outcome: str, detail: str) -> Verdict:
        return Verdict(name, outcome, round(scenario_s, 3), detail, per_rank, round(setup_s, 3))

    progress = "; ".join(r.progress() for r in ranks)
    if reason == "setup_timeout":
        late = [r.rank for r in ranks if not r.ready]
        return verdict("error", f"setup (torch import, init_process_group, warm-up) did not finish within "
                                f"{setup_timeout:g}s on ranks {late}; {progress}")
    if reason == "timeout" and all(r.error is None for r in ranks):
        return verdict("hung", f"not finished within {timeout:g}s; {progress}")
    if reason != "finished" or not all(r.finished for r in ranks):
        bad = next((r for r in ranks if r.error is not None), None) \
            or next((r for r in ranks if not r.finished), ranks[0])
        what = bad.error or f"exited with status {bad.proc.returncode} without finishing"
        tail = bad.stderr_tail.strip()[-1500:]
        return verdict("error", f"rank {bad.rank}: {what}; {progress}" + (f"; stderr tail: {tail}" if tail else ""))
    wrong = []
    for r in ranks:
        for step, res in sorted(r.results().items()):
            if not res.get("ok"):
                fb = res.get("first_bad") or {}
                wrong.append(f"rank {r.rank} step {step}: {res.get('wrong')} wrong elements, first at "
                             f"{fb.get('index')}: got {fb.get('got')}, want {fb.get('want')}")
    missing = [r.rank for r in ranks if set(r.results()) != {"A", "B"}]
    if missing:
        return verdict("error", f"ranks {missing} finished without checking both results; {progress}")
    # Every rank finished: time the scenario by the ranks' own clock (the
    # parent sees their reports in batches, often ready and finished together).
    ready = [_wall(r, "ready") for r in ranks]
    finished = [_wall(r, "finished") for r in ranks]
    if None not in ready and None not in finished and max(finished) >= max(ready):
        scenario_s = max(finished) - max(ready)
    if wrong:
        return verdict("wrong_result", "; ".join(wrong))
    return verdict("completed", f"all {len(ranks)} ranks finished with correct sums")


def _launch_once(name: str, *, world_size: int, backend: str, timeout: float, setup_timeout: float,
                 count: int, env: dict | None) -> Verdict:
    port = _free_port()
    pg_timeout = (setup_timeout + timeout) * 4
    ranks: list[_Rank] = []
    try:
        for rank in range(world_size):
            child_env = _child_env(env, backend, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                                  "RANK": str(rank), "WORLD_SIZE": str(world_size),
                                                  "LOCAL_RANK": str(rank)})
            cmd = [sys.executable, "-c", _bootstrap(), "--worker", "--scenario", name, "--backend", backend,
                   "--count", str(count), "--pg-timeout", str(pg_timeout)]
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    env=child_env, start_new_session=True, close_fds=True, bufsize=0)
            ranks.append(_Rank(rank, proc))
        reason, setup_s, scenario_s = _watch(ranks, timeout=timeout, setup_timeout=setup_timeout)
    except BaseException:
        _kill_groups([r.proc for r in ranks])
        raise
    # Always, also for ranks that exited: the whole group, in case one left children.
    _kill_groups([r.proc for r in ranks])
    # After a timeout the survivors' last words are reactions to the kill
    # (e.g. gloo's "connection closed by peer"), not part of what the
    # scenario did: keep their stderr, not their events.
    _drain(ranks, events=reason not in ("timeout", "setup_timeout"))
    for r in ranks:
        for stream in (r.proc.stdout, r.proc.stderr):
            if stream is not None:
                stream.close()
    return _classify(name, ranks, reason, setup_s, scenario_s, timeout=timeout, setup_timeout=setup_timeout)


def run_nccl_scenario(name: str, *, world_size: int = 2, backend: str = "nccl", timeout: float = 30.0,
                      count: int = 1 << 20, env: dict | None = None, setup_timeout: float | None = None) -> Verdict:
    """Runs scenario ``name`` with ``world_size`` rank processes on ``backend``
    and returns what happened.  Never hangs: the scenario phase gets
    ``timeout`` seconds once every rank has finished setup, setup gets
    ``setup_timeout`` seconds (default: max(60, timeout)), finished ranks get
    a few seconds to exit; then every rank's process group is SIGKILLed.

    env: extra environment for the ranks (e.g. NCCL_DEBUG); it cannot undo
    :data:`FORCED_ENV`.  Returns outcome "unavailable" at once when
    :func:`available` says the backend cannot run ``world_size`` ranks here."""
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, not {backend!r}")
    if world_size < 2:
        raise ValueError("the scenarios need at least 2 ranks")
    if count < 1 or timeout <= 0:
        raise ValueError("count must be >= 1 and timeout > 0")
    setup_timeout = max(60.0, timeout) if setup_timeout is None else setup_timeout
    if not available(backend, world_size=world_size, env=env):
        return Verdict(name, "unavailable", 0.0,
                       f"torch.distributed with {backend} for {world_size} ranks is not available here")
    verdict = _launch_once(name, world_size=world_size, backend=backend, timeout=timeout,
                           setup_timeout=setup_timeout, count=count, env=env)
    # The port was free when picked but another process may have taken it
    # before rank 0 bound it: that is not NCCL's doing, so try once more.
    if verdict.outcome == "error" and not any(r["ready"] for r in verdict.per_rank) and any(
            "address already in use" in ((r["error"] or "") + r["stderr_tail"]).lower() for r in verdict.per_rank):
        verdict = _launch_once(name, world_size=world_size, backend=backend, timeout=timeout,
                               setup_timeout=setup_timeout, count=count, env=env)
    return verdict


# -- availability -------------------------------------------------------------------------------
_PROBE = """
import json
try:
    import torch
    import torch.distributed as dist
    ok = dist.is_available()
    info = {"torch": torch.__version__, "dist": ok,
            "gloo": bool(ok and dist.is_gloo_available()), "nccl": bool(ok and dist.is_nccl_available()),
            "cuda": torch.cuda.device_count() if torch.cuda.is_available() else 0}
except Exception as exc:
    info = {"error": repr(exc)}
print(json.dumps(info), flush=True)
"""


@functools.lru_cache(maxsize=32)
def _probe(env_items: tuple[tuple[str, str], ...]) -> dict:
    """torch's view of this machine, from a subprocess with the ranks'
    environment (CUDA_VISIBLE_DEVICES may differ from ours); {} on failure."""
    try:
        proc = subprocess.Popen([sys.executable, "-c", _python_prelude() + _PROBE], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                env=_child_env(dict(env_items)), start_new_session=True)
    except OSError:
        return {}
    try:
        out, _ = proc.communicate(timeout=_PROBE_TIMEOUT)
    except subprocess.TimeoutExpired:
        _kill_groups([proc])
        proc.communicate()  # closes the pipes
        return {}
    finally:
        _kill_groups([proc])  # also whatever the probe may have started
    for line in reversed(out.decode(errors="replace").splitlines()):
        try:
            info = json.loads(line)
        except ValueError:
            continue
        if isinstance(info, dict):
            return info
    return {}


def available(backend: str = "nccl", *, world_size: int = 2, env: dict | None = None) -> bool:
    """True when torch imports, torch.distributed is available with
    ``backend``, and for nccl at least ``world_size`` CUDA GPUs are visible.
    The check runs in a subprocess (cached per environment) so that the caller
    never imports torch or touches CUDA."""
    if backend not in BACKENDS:
        return False
    if not (env and "PYTHONPATH" in env) and importlib.util.find_spec("torch") is None:
        return False  # no torch for this interpreter: answer without starting a process
    info = _probe(tuple(sorted((str(k), str(v)) for k, v in (env or {}).items())))
    if not info.get("dist") or not info.get(backend):
        return False
    return backend != "nccl" or int(info.get("cuda", 0)) >= world_size


# -- stream-ordered reference (CuPy) -----------------------------------------------------------------
_STREAM_ORDER_CHILD = r"""
import os, sys, threading, time, traceback
import numpy as np
import cupy
from cupy.cuda import nccl

timeout = float(sys.argv[1])
devices, count = [0, 1], 1 << 20
uids = {"A": nccl.get_unique_id(), "B": nccl.get_unique_id()}
comms, streams, bufs = {}, {}, {}
ready = threading.Barrier(len(devices), timeout=300)
errors = []


def fill(r):
    for t in "AB":
        bufs[(r, t)].set(np.full(count, (r + 1) * (1 if t == "A" else 100), np.float32))
    cupy.cuda.Device(devices[r]).synchronize()


def all_reduce(r, t):
    buf = bufs[(r, t)].data.ptr
    comms[(r, t)].allReduce(buf, buf, count, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, streams[r].ptr)


def rank_thread(r):
    try:
        cupy.cuda.Device(devices[r]).use()
        streams[r] = cupy.cuda.Stream(non_blocking=True)   # one stream for both communicators
        for t in "AB":
            comms[(r, t)] = nccl.NcclCommunicator(len(devices), uids[t], r)
            bufs[(r, t)] = cupy.empty(count, dtype=cupy.float32)
        # Warm both communicators in the same order on every rank first: NCCL
        # connects a communicator during its first collective, on the CPU, so
        # opposite first calls would hang there; the hang shown here is the
        # GPU-side one.
        fill(r)
        for t in "AB":
            all_reduce(r, t)
            streams[r].synchronize()
        fill(r)
        ready.wait()
        for t in ("AB" if r == 0 else "BA"):
            all_reduce(r, t)
    except BaseException:
        errors.append(traceback.format_exc())
        print(errors[-1], file=sys.stderr, flush=True)   # the peer may now be stuck in NCCL setup
        ready.abort()


threads = [threading.Thread(target=rank_thread, args=(r,)) for r in range(len(devices))]
for th in threads:
    th.start()
for th in threads:
    th.join()
if errors:
    os._exit(1)
t0 = time.monotonic()
while time.monotonic() - t0 < timeout:
    if all(streams[r].done for r in range(len(devices))):
        seconds = round(time.monotonic() - t0, 3)
        ok = all(float(bufs[(r, t)][:1].get()[0]) == (3 if t == "A" else 300) for r in range(len(devices))
                 for t in "AB")
        print("OUTCOME", "completed" if ok else "wrong_result", seconds, flush=True)
        os._exit(0)
    time.sleep(0.01)
print("OUTCOME hung", timeout, flush=True)
os._exit(0)   # the stuck kernels go with the process
"""

_CUPY_PROBE = """
import json
try:
    import cupy
    from cupy.cuda import nccl
    info = {"nccl": nccl.get_version(), "cuda": cupy.cuda.runtime.getDeviceCount()}
except Exception as exc:
    info = {"error": repr(exc)}
print(json.dumps(info), flush=True)
"""


def _run_child(code: str, args: list[str], timeout: float) -> tuple[str, str, bool]:
    """(stdout, stderr, returned) of ``python -c code args`` in its own
    session; ``returned`` is False when it had not exited within ``timeout``
    seconds.  Its whole process group is SIGKILLed either way, so nothing it
    started outlives the call."""
    proc = subprocess.Popen([sys.executable, "-c", _python_prelude() + code, *args], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_child_env(None),
                            start_new_session=True)
    returned = True
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        returned = False
        _kill_groups([proc])
        out, err = proc.communicate()  # what it wrote before it was killed
    finally:
        _kill_groups([proc])
    return out.decode(errors="replace"), err.decode(errors="replace"), returned


@functools.lru_cache(maxsize=1)
def cupy_nccl_available(world_size: int = 2) -> bool:
    """True when CuPy with its NCCL binding imports and at least
    ``world_size`` GPUs are visible; checked in a subprocess, so that the
    caller never imports CuPy or touches CUDA."""
    if importlib.util.find_spec("cupy") is None:
        return False
    out, _, _ = _run_child(_CUPY_PROBE, [], _PROBE_TIMEOUT)
    for line in reversed(out.splitlines()):
        try:
            info = json.loads(line)
        except ValueError:
            continue
        return isinstance(info, dict) and int(info.get("cuda", 0)) >= world_size
    return False


def stream_order_reference(timeout: float = 10.0, setup_timeout: float = 120.0) -> dict:
    """NCCL's canonical deadlock: two communicators whose collectives share one
    stream per GPU, rank 0 (GPU 0) enqueuing A then B and rank 1 (GPU 1) B
    then A, one CuPy thread per GPU.  Runs in a subprocess that is killed with
    everything it started.  Returns {"outcome": "hung" | "completed" |
    "wrong_result" | "error", "seconds", "detail"}; "seconds" is the time from
    the enqueues to completion (or ``timeout`` when hung).  ``setup_timeout``
    bounds importing CuPy, creating the communicators and the warm-up."""
    if timeout <= 0 or setup_timeout <= 0:
        raise ValueError("timeout and setup_timeout must be > 0")
    out, err, returned = _run_child(_STREAM_ORDER_CHILD, [str(timeout)], timeout + setup_timeout)
    for line in out.splitlines():
        # Reported before the child exits: a child stuck in its exit still gave its verdict.
        if line.startswith("OUTCOME "):
            _, outcome, seconds = line.split()
            return {"outcome": outcome, "seconds": float(seconds), "detail": ""}
    why = "" if returned else f"setup did not finish within {setup_timeout:.0f} s\n"
    return {"outcome": "error", "seconds": 0.0, "detail": (why + out + err)[-2000:]}


# -- command line -------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """``python -m dfccl_support.nccl_reference [--backend nccl|gloo] [--timeout S] [SCENARIO ...]``:
    runs each scenario (all by default) and prints one line per verdict."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--worker"]:
        _worker_entry(argv)
    p = argparse.ArgumentParser(prog="python -m dfccl_support.nccl_reference",
                                description="Run dfccl's deadlock scenarios with NCCL (or gloo) through "
                                            "torch.distributed and report whether each completed, hung or "
                                            "gave wrong results.")
    p.add_argument("--backend", choices=BACKENDS, default="nccl")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds for the scenario phase (default 30)")
    p.add_argument("--setup-timeout", type=float, default=None,
                   help="seconds for torch import and process-group setup (default max(60, timeout))")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--count", type=int, default=1 << 20, help="float32 elements per tensor")
    p.add_argument("scenarios", nargs="*", metavar="SCENARIO", help=f"any of {', '.join(SCENARIOS)} (default all)")
    args = p.parse_args(argv)
    unknown = [s for s in args.scenarios if s not in SCENARIOS]
    if unknown:
        p.error(f"unknown scenario(s) {unknown}; known: {', '.join(SCENARIOS)}")
    for name in args.scenarios or SCENARIOS:
        v = run_nccl_scenario(name, world_size=args.world_size, backend=args.backend, timeout=args.timeout,
                              count=args.count, setup_timeout=args.setup_timeout)
        print(v.summary(), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
