"""A rank's status page (state, heartbeat, pid in host shared memory): what
peers in other processes read without touching a device; and how pages and
status files that killed processes left are told from those of live ones."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import struct
import subprocess
import time

import pytest

from dfccl import liveness, processes, status_page
from dfccl.status_page import StatusPage


@pytest.fixture(autouse=True)
def page_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DFCCL_STATUS_DIR", str(tmp_path))
    return tmp_path


def _read_in_child(path, out):
    page = StatusPage.open(path)
    out.put(page.read())
    page.close()


def test_written_by_the_owner_read_by_another_process(page_dir):
    page = StatusPage.create(0)
    try:
        assert page.read() == (0, 0, os.getpid())
        page.write(2, 17)
        mp_context = mp.get_context("spawn")
        out = mp_context.Queue()
        p = mp_context.Process(target=_read_in_child, args=(page.path, out))
        p.start()
        got = out.get(timeout=30)
        p.join(30)
        assert got == (2, 17, os.getpid())
    finally:
        page.close()


def test_unlink_keeps_the_mappings_close_is_idempotent(page_dir):
    page = StatusPage.create(0)
    peer = StatusPage.open(page.path)
    page.unlink()
    assert not os.path.exists(page.path)
    page.write(1, 5)
    assert peer.read() == (1, 5, os.getpid())  # both mappings still see one page
    peer.close()
    peer.close()
    assert peer.read() == (0, 0, 0)
    page.close()
    page.close()


def test_a_peer_page_is_read_only(page_dir):
    page = StatusPage.create(0)
    peer = StatusPage.open(page.path)
    with pytest.raises(TypeError):
        peer.write(1, 1)
    peer.close()
    page.close()


def _page(path, pid: int, start: int, namespace: int) -> None:
    """A page as its owner ``pid`` (started at ``start``, in pid namespace
    ``namespace``; 0: not recorded) leaves it."""
    words = struct.pack("<QQQQQ", 0, 7, pid, start, namespace)
    path.write_bytes(words + b"\0" * (64 - len(words)))


@pytest.fixture
def exited():
    """The pid and start time of a process that has exited (and been reaped)."""
    p = subprocess.Popen(["sleep", "30"])
    start = processes.start_time(p.pid)
    p.kill()
    p.wait()
    return p.pid, start


@pytest.fixture
def running():
    """The pid and start time of a process that runs."""
    p = subprocess.Popen(["sleep", "30"])
    yield p.pid, processes.start_time(p.pid)
    p.kill()
    p.wait()


def test_pages_of_exited_processes_are_swept(page_dir, monkeypatch, exited):
    pid, start = exited
    stale = page_dir / f"dfccl-rank-{os.getuid()}-{pid}-0"
    _page(stale, pid, start, processes.pid_namespace())
    mine = page_dir / f"dfccl-rank-{os.getuid()}-{os.getpid()}-999"
    mine.write_bytes(b"\0" * 64)
    monkeypatch.setattr(status_page, "_swept", False)
    page = StatusPage.create(0)
    try:
        assert not stale.exists()
        assert mine.exists()  # this process's own pages stay
    finally:
        page.close()
        mine.unlink()


def test_a_page_records_its_owner(page_dir):
    page = StatusPage.create(0)
    try:
        words = struct.unpack_from("<QQQQQ", (page_dir / os.path.basename(page.path)).read_bytes())
        assert words[2:] == (os.getpid(), processes.start_time(os.getpid()), processes.pid_namespace())
    finally:
        page.close()


def test_a_reused_pid_does_not_keep_a_page(page_dir, running):
    pid, start = running   # the page's owner had this pid before, and started earlier
    stale = page_dir / f"dfccl-rank-{os.getuid()}-{pid}-0"
    _page(stale, pid, start - 1, processes.pid_namespace())
    live = page_dir / f"dfccl-rank-{os.getuid()}-{pid}-1"
    _page(live, pid, start, processes.pid_namespace())
    assert status_page.sweep() == [str(stale)]
    assert live.exists()


def test_a_page_of_another_pid_namespace_stays(page_dir, exited):
    pid, start = exited   # means nothing here: the owner's pid is of its namespace
    foreign = page_dir / f"dfccl-rank-{os.getuid()}-{pid}-0"
    _page(foreign, pid, start, processes.pid_namespace() + 1)
    assert status_page.sweep() == []
    assert foreign.exists()


def test_an_unidentified_page_goes_only_once_it_is_old(page_dir, exited):
    # Written by an earlier version, or by an owner still writing it: the
    # pid alone may be another namespace's, so a fresh page stays.
    pid, _ = exited
    legacy = page_dir / f"dfccl-rank-{os.getuid()}-{pid}-0"
    legacy.write_bytes(b"\0" * 64)
    assert status_page.sweep() == []
    old = time.time() - processes.UNIDENTIFIED_AGE - 1
    os.utime(legacy, (old, old))
    assert status_page.sweep() == [str(legacy)]


def test_the_owner_removes_its_file_on_close(page_dir):
    page = StatusPage.create(0)
    path = page.path
    assert os.path.exists(path)
    page.close()
    assert not os.path.exists(path)
    assert not list(page_dir.iterdir())


# -- the process status files (liveness.py), left the same way ---------------------------
def _status_file(directory, pid: int, start: int | None, namespace: int | None, suffix: str = "") -> str:
    doc = {"pid": pid, "time": time.time(), "communicators": []}
    if start is not None:
        doc.update(start_time=start, pid_ns=namespace)
    path = directory / f"dfccl-status-{os.getuid()}-{pid}.json{suffix}"
    path.write_text(json.dumps(doc))
    return str(path)


def test_status_files_of_exited_processes_are_removed_when_read(page_dir, exited, running):
    ns = processes.pid_namespace()
    dead = _status_file(page_dir, *exited, ns)
    rewrite = _status_file(page_dir, *exited, ns, suffix=".140.tmp")   # killed while rewriting it
    reused = _status_file(page_dir, running[0], running[1] - 1, ns)
    docs = liveness.collect_status(str(page_dir))
    assert docs == [] and not os.path.exists(dead) and not os.path.exists(rewrite) and not os.path.exists(reused)
    live = _status_file(page_dir, *running, ns)
    foreign = _status_file(page_dir, exited[0], exited[1], ns + 1)
    assert [d["pid"] for d in liveness.collect_status(str(page_dir))] == [running[0]]
    assert os.path.exists(live) and os.path.exists(foreign)


def test_an_unidentified_status_file_goes_only_once_it_is_old(page_dir, exited):
    legacy = _status_file(page_dir, exited[0], None, None)
    assert liveness.collect_status(str(page_dir)) == [] and os.path.exists(legacy)
    old = time.time() - processes.UNIDENTIFIED_AGE - 1
    os.utime(legacy, (old, old))
    liveness.collect_status(str(page_dir))
    assert not os.path.exists(legacy)


def test_an_empty_rewrite_of_an_exited_process_goes_at_once(page_dir, exited, running):
    # Killed between creating its first rewrite and writing it: the file is
    # empty, and only its name says whose it is.
    ns = processes.pid_namespace()
    cut = page_dir / f"dfccl-status-{os.getuid()}-{exited[0]}.json.{exited[1]}-{ns}-140.tmp"
    cut.write_bytes(b"")
    writing = page_dir / f"dfccl-status-{os.getuid()}-{running[0]}.json.{running[1]}-{ns}-140.tmp"
    writing.write_bytes(b"")
    assert liveness.collect_status(str(page_dir)) == []
    assert not cut.exists() and writing.exists()


def test_a_rewrite_is_named_after_its_writer():
    name = liveness._rewrite_name("/d/dfccl-status-0-7.json", {"start_time": 11, "pid_ns": 22})
    assert re.match(r"^/d/dfccl-status-0-7\.json\.11-22-\d+\.tmp$", name)


class _FrozenPeerEndpoint:
    """A rank 0 whose one peer, rank 1 on another host, stopped: its
    heartbeat never moves."""
    rank = 0

    def __init__(self):
        self.peers = [{"pid": os.getpid(), "host": "a", "host_id": "a"},
                      {"pid": os.getpid() + 1, "host": "b", "host_id": "b"}]

    def write_status(self, state=None):
        pass

    def peer_status(self, rank):
        return 0, 7, self.peers[rank]["pid"]


class _RankOfFrozenPeer:
    """What the monitor reads of a rank (rank_state.RankState's fields)."""

    def __init__(self):
        import threading
        self.endpoint = _FrozenPeerEndpoint()
        self.peer_timeout = 0.5
        self.lock = threading.RLock()
        self.closed = self.aborted = self.fault_reported = False
        self.lost_rank = None
        self.daemon = type("Daemon", (), {"device_fault": 0, "closed": False})()
        self.comm_key = 1
        self.lost = threading.Event()

    def peer_lost(self, peer, why):
        self.lost_rank = peer
        self.lost.set()


def test_a_stalled_status_write_does_not_delay_finding_a_lost_peer(monkeypatch):
    """The status file's write can stall (a rename on a disk file system was
    seen to take over 30 s): a stopped peer is still found lost within
    peer_timeout, because the liveness checks run on a thread of their own."""
    import threading
    release = threading.Event()
    writing = threading.Event()

    def stalled_write(self, ranks):
        if ranks:
            writing.set()
            release.wait(30)

    monitor = liveness._Monitor()
    monkeypatch.setattr(liveness._Monitor, "_write_status", stalled_write)

    class Comm:
        pass

    comm, state = Comm(), _RankOfFrozenPeer()
    try:
        monitor.register(comm, state)
        assert writing.wait(5), "the status thread never wrote"
        t0 = time.monotonic()
        assert state.lost.wait(5), "the stopped peer was not found lost while the status write stalled"
        assert state.lost_rank == 1
        assert time.monotonic() - t0 < 2.0
    finally:
        release.set()
        state.closed = True
        for t in (monitor._thread, monitor._status_thread):
            if t is not None:
                t.join(5)
