"""Peer liveness and the process status file: two threads per process.

Every `INTERVAL` seconds, for every open communicator of this process:
- bumps this rank's heartbeat in its status page (status_page.py: host
  shared memory, so that neither this nor reading the peers' pages ever
  waits for a device);
- checks each peer in another process: its process must exist (a pid check
  through /proc, guarded against pid reuse by the process start time, so an
  exit, a kill or a crash is seen within one interval), and, where
  `CommOptions.peer_timeout` is set, its heartbeat must have moved within
  that many seconds (a stopped or hung process).  A peer that fails either
  is *lost*: the communicator fails every pending and later collective with
  PeerLostError naming it (RankState.peer_lost);
- reports a rank whose device has failed under its daemon
  (Daemon.device_fault): it is lost to its peers like a process that died,
  at once for those in this process, through `RANK_FAILED` in its status
  page for those in others;
- every `STATUS_INTERVAL` seconds, on a thread of its own (a file system
  that stalls a write, which happens, must not delay finding a lost peer),
  writes what each communicator is doing to the process status file
  (`python -m dfccl status` reads them).

The status file goes at exit and on SIGTERM (termination.py).  Files and
status pages that processes killed otherwise left are removed when the
status file is first written and when the monitor sees a peer's process
exit (and by `dfccl status`); each records its writer's start time and pid
namespace, so that a reused pid or a live process of another namespace
keeps its file.

Ranks in this process are never checked (they cannot die alone).  Both
threads hold communicators weakly and stop when none is left; they touch
a rank only through its RankState (rank_state.py) and its public status()."""

from __future__ import annotations

import atexit
import json
import os
import re
import tempfile
import threading
import time
import weakref

from dfccl import status_page
from dfccl._native.cuda_driver import relax_thread_capture_mode
from dfccl._native.layout import RANK_FAILED as _RANK_FAILED
from dfccl.processes import owner_gone, pid_namespace, process_alive, start_time
from dfccl.rank_state import RankState
from dfccl.shared_files import matching_files
from dfccl.termination import block_async_signals, on_sigterm

__all__ = ["INTERVAL", "STATUS_INTERVAL", "register", "status_dir", "status_path", "process_alive",
           "collect_status", "sweep"]

#: Seconds between liveness checks (a dead process is seen within about this).
INTERVAL = 0.1
#: Seconds between rewrites of the process status file.
STATUS_INTERVAL = 1.0


def status_dir() -> str | None:
    """Where status files live: $DFCCL_STATUS_DIR, else /dev/shm (or the
    temporary directory); None when DFCCL_STATUS=0 switches them off."""
    if os.environ.get("DFCCL_STATUS", "1") == "0":
        return None
    d = os.environ.get("DFCCL_STATUS_DIR")
    if d:
        return d
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def status_path(pid: int | None = None) -> str | None:
    d = status_dir()
    if d is None:
        return None
    return os.path.join(d, f"dfccl-status-{os.getuid()}-{pid or os.getpid()}.json")


def collect_status(directory: str | None = None) -> list[dict]:
    """The status files of this user's running processes in ``directory``
    (default: status_dir()), by pid; files of processes that no longer exist
    (processes.owner_gone), and their unfinished rewrites, are removed."""
    directory = directory or status_dir()
    if directory is None:
        return []
    pattern = re.compile(rf"^dfccl-status-{os.getuid()}-(\d+)\.json(?:\.(\d+)-(\d+)-\d+\.tmp|(\..+\.tmp))?$")
    docs = []
    for path, m in matching_files(directory, pattern):
        try:
            mtime = os.stat(path).st_mtime
            with open(path) as f:
                doc = json.load(f)
        except OSError:
            continue   # gone already, or not ours to read
        except ValueError:
            doc = {}   # cut short by a kill during a rewrite
        if not isinstance(doc, dict):
            continue
        if m.group(2) is not None and not doc:
            # A rewrite cut short: its name says whose (_rewrite_name).
            doc = {"start_time": int(m.group(2)), "pid_ns": int(m.group(3))}
        pid, start, namespace = int(m.group(1)), doc.get("start_time"), doc.get("pid_ns")
        start = start if isinstance(start, int) else None
        if owner_gone(pid, start, namespace if isinstance(namespace, int) else None, mtime):
            _remove(path)
        elif m.group(2) is None and m.group(4) is None and doc.get("pid") == pid and process_alive(pid, start):
            docs.append(doc)
    return sorted(docs, key=lambda d: d["pid"])


def _rewrite_name(path: str, identity: dict) -> str:
    """Where a status file is rewritten before it replaces ``path``.  The
    name carries the writer's identity (start time, pid namespace): a
    process killed before its first rewrite was written out leaves an
    empty file, which collect_status can then still tell from one of a
    live process."""
    start, namespace = identity.get("start_time"), identity.get("pid_ns")
    if isinstance(start, int) and isinstance(namespace, int):
        return f"{path}.{start}-{namespace}-{threading.get_ident()}.tmp"
    return f"{path}.{threading.get_ident()}.tmp"


def sweep() -> None:
    """Removes status files and status pages that processes which no longer
    exist left behind."""
    collect_status()
    status_page.sweep()


class _PeerWatch:
    """Liveness state of one communicator's peers in other processes."""

    def __init__(self, comm, state: RankState):
        ep = state.endpoint
        me = ep.peers[ep.rank]
        self.comm = weakref.ref(comm)   # watched while the communicator lives
        self.state = state
        self.timeout = state.peer_timeout
        self.remote = [p for p, info in enumerate(ep.peers)
                       if p != ep.rank and (info["pid"] != me["pid"] or info["host"] != me["host"])]
        now = time.monotonic()
        self.last_beat = {p: (-1, now) for p in self.remote}
        self.saw_exit = False   # a peer's process exited: its files may be left

    def step(self, now: float) -> bool:
        """One check; False once the communicator is gone or closed."""
        if self.comm() is None:
            return False
        state = self.state
        # The arena and the peers' mappings are only touched under the
        # rank's lock: close() frees them once it has marked the rank closed,
        # and a write into unmapped memory is a crash, not an exception.
        with state.lock:
            if state.closed:
                return False
            lost = self._check(state, now)
            if lost is not None:
                state.peer_lost(*lost)
        return True

    def _check(self, state: RankState, now: float) -> tuple[int, str] | None:
        """Bumps this rank's heartbeat and checks the peers; the lost peer and
        why, or None."""
        ep = state.endpoint
        try:
            ep.write_status()
        except Exception:
            return None
        if state.lost_rank is not None or state.aborted:
            return None
        for p in self.remote:
            info = ep.peers[p]
            try:
                peer_state, beat, _pid = ep.peer_status(p)
            except OSError as exc:
                return p, str(exc)
            except Exception:
                return p, "its status page can no longer be read"
            if peer_state == _RANK_FAILED:
                return p, "its device failed under its daemon (that rank raised BackendError)"
            if peer_state != 0:
                continue   # it left on purpose: the daemon fails what waits for it
            if info.get("host_id") == ep.peers[ep.rank].get("host_id") and not process_alive(info["pid"],
                                                                                         info.get("start_time")):
                self.saw_exit = True
                return p, f"its process {info['pid']} has exited"
            last, since = self.last_beat[p]
            if beat != last:
                self.last_beat[p] = (beat, now)
            elif self.timeout is not None and now - since > self.timeout - 2 * INTERVAL:
                return p, (f"its heartbeat stopped {now - since:.1f} s ago (process {info['pid']} "
                           "hung or stopped)")
        return None


class _Monitor:
    def __init__(self):
        self._lock = threading.Lock()
        self._watches: list[_PeerWatch] = []
        self._ranks: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # communicator -> RankState
        self._thread: threading.Thread | None = None          # liveness (_run)
        self._status_thread: threading.Thread | None = None   # the status file (_run_status)
        self._wrote_status = False
        self._stopping = False   # set at interpreter exit or SIGTERM: write nothing more
        self._identity: dict | None = None   # this process's, in its status file

    def register(self, comm, state: RankState) -> None:
        with self._lock:
            self._ranks[comm] = state
            if state.endpoint.peers:
                w = _PeerWatch(comm, state)
                if w.remote:
                    self._watches.append(w)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="dfccl-monitor", daemon=True)
                self._thread.start()
            if self._status_thread is None or not self._status_thread.is_alive():
                self._status_thread = threading.Thread(target=self._run_status, name="dfccl-status", daemon=True)
                self._status_thread.start()

    def _open_ranks(self) -> list:
        with self._lock:
            return [(c, s) for c, s in list(self._ranks.items()) if not s.closed]

    def _run(self) -> None:
        """Liveness: touches memory (status pages, arenas, the net link's
        mirrors), not the status file, so that a slow file system cannot
        hold up finding a lost peer (the status file has its own thread)."""
        block_async_signals()
        relax_thread_capture_mode()   # its CUDA calls (aborts) must not break a graph captured meanwhile
        while True:
            now = time.monotonic()
            with self._lock:
                watches = list(self._watches)
            ranks = self._open_ranks()
            alive = []
            for w in watches:
                try:
                    if w.step(now):
                        alive.append(w)
                except Exception:
                    alive.append(w)   # never let the monitor die; try again next time
            with self._lock:
                self._watches = [w for w in self._watches if w not in watches or w in alive]
            if any(w.saw_exit for w in watches):
                # What the exited peer left goes at once, after its loss was
                # reported (its survivors may close and exit right after):
                # the one time this thread touches files.
                for w in watches:
                    w.saw_exit = False
                _sweep_quietly()
            try:
                _report_faults([s for _, s in ranks])
            except Exception:
                pass   # never let the monitor die; try again next time
            del ranks
            with self._lock:
                if not self._watches and not any(not s.closed for s in self._ranks.values()):
                    self._thread = None
                    return
            time.sleep(INTERVAL)

    def _run_status(self) -> None:
        """The process status file, rewritten every STATUS_INTERVAL while a
        rank of this process is open, removed once none is."""
        block_async_signals()
        relax_thread_capture_mode()
        next_status = 0.0
        while True:
            now = time.monotonic()
            if now >= next_status:
                next_status = now + STATUS_INTERVAL
                ranks = self._open_ranks()
                self._write_status(ranks)
                del ranks
            with self._lock:
                if not any(not s.closed for s in self._ranks.values()):
                    self._status_thread = None
                    self._write_status([])
                    return
            time.sleep(INTERVAL)

    def _write_status(self, ranks) -> None:
        path = status_path()
        if path is None or self._stopping:
            return
        if not ranks:
            if self._wrote_status:
                _remove(path)
                self._wrote_status = False
            return
        entries = []
        for c, state in ranks:
            try:
                with state.lock:   # status() reads the arenas (see _PeerWatch.step)
                    if state.closed:
                        continue
                    entries.append(c.status().to_dict())
            except Exception:
                continue
        if not self._wrote_status:
            # Start-up (or after an idle spell): what killed processes left
            # goes before this file comes.
            _sweep_quietly()
        if self._identity is None:
            self._identity = {"start_time": start_time(os.getpid()), "pid_ns": pid_namespace()}
        doc = {"pid": os.getpid(), **self._identity, "written_ns": time.monotonic_ns(), "time": time.time(),
               "communicators": entries}
        tmp = _rewrite_name(path, self._identity)
        text = json.dumps(doc, default=repr)
        # Under the lock, so that the exit and SIGTERM handlers (which take
        # it) find no half-written file; one write, so that a process killed
        # meanwhile leaves the whole document (with its identity) or nothing.
        with self._lock:
            if self._stopping:
                return
            try:
                with open(tmp, "w") as f:
                    f.write(text)
                os.replace(tmp, path)
                self._wrote_status = True
            except OSError:
                _remove(tmp)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _sweep_quietly() -> None:
    try:
        sweep()
    except Exception:
        pass   # never let the monitor die over a file of another process


def _report_faults(states: list[RankState]) -> None:
    """A rank whose device failed (Daemon.device_fault: every collective of
    it fails with BackendError) is lost to its peers, like a process that
    died, instead of leaving them to their timeouts: the ranks of its
    communicator in this process are told at once, those in other processes
    read RANK_FAILED in its status page (_PeerWatch._check)."""
    for s in states:
        daemon = s.daemon
        if not daemon.device_fault or s.fault_reported or s.closed:
            continue
        s.fault_reported = True
        try:
            s.endpoint.write_status(_RANK_FAILED)
        except Exception:
            pass   # its peers still see the process exit
        why = f"its device {s.where} failed under its daemon ({daemon.device.fault_name(daemon.device_fault)})"
        for other in states:
            if other is s or other.comm_key != s.comm_key or other.daemon.device_fault:
                continue
            with other.lock:
                if not other.closed:
                    other.peer_lost(s.rank, why)


_monitor = _Monitor()


def _forget_in_child() -> None:
    # A forked child has no monitor thread and owns none of its parent's
    # communicators (runtime.py forgets their daemons): each is marked as
    # the parent's, so that using it says so, and the child's monitor starts
    # empty (its lock new: another thread may have held it at the fork).
    parent = os.getppid()
    for state in list(_monitor._ranks.values()):
        state.forked(parent)
    _monitor.__init__()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def register(comm, state: RankState) -> None:
    """Watches the peers of ``comm``'s rank (``state``) and publishes its
    status (Communicator calls this)."""
    _monitor.register(comm, state)
    on_sigterm(_remove_status_file_on_sigterm)


@atexit.register
def _remove_status_file(lock_timeout: float = -1) -> None:
    # The monitor is a daemon thread that outlives this handler: stop its
    # writes first (under its lock), then remove what it wrote.
    locked = _monitor._lock.acquire(timeout=lock_timeout)
    try:
        _monitor._stopping = True
        wrote = _monitor._wrote_status
    finally:
        if locked:
            _monitor._lock.release()
    path = status_path()
    if path is not None and wrote:
        _remove(path)


def _remove_status_file_on_sigterm() -> None:
    # The handler may have interrupted this thread while it held the
    # monitor's lock: wait for it briefly, not for ever.
    _remove_status_file(lock_timeout=0.2)
