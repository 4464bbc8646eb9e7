"""Abort that always returns, the flight recorder, Communicator.status(),
`dfccl status`, trace export, and the daemon's rejection of bad descriptors
(a raw descriptor submitted on the simulator, tests only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import dfccl
from dfccl_support import scenarios as sc
from dfccl import trace
from dfccl._native.layout import NUM_DTYPES, NUM_KINDS, NUM_OPS, NUM_PATHS

DEV = 3300          # device ids of this module: 3300..3499
TIMEOUT = 30.0


# -- abort ----------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ("ring", "direct"))
def test_abort_under_traffic_returns_fails_everything_and_devices_stay_usable(path):
    devs = [DEV + (0 if path == "ring" else 2), DEV + (1 if path == "ring" else 3)]
    comms = dfccl.Communicator.for_devices(devs, backend="sim", options=dfccl.CommOptions(path=path))
    stop = threading.Event()
    works = [[], []]

    def traffic(r):
        rng = np.random.default_rng(0)   # the same sequence on both ranks
        i = 0
        while not stop.is_set() and i < 400:
            try:
                works[r].append(comms[r].all_reduce(np.ones(int(rng.integers(1, 50000)), np.float32),
                                                    tag=int(rng.integers(0, 8))))
            except dfccl.ClosedError:
                return
            i += 1

    threads = [threading.Thread(target=traffic, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    comms[0].abort(timeout=5.0)
    assert time.monotonic() - t0 < 6.0
    stop.set()
    for t in threads:
        t.join()
    comms[1].abort(timeout=5.0)
    for r in range(2):
        for w in works[r]:
            assert w.done(), "abort returned with a pending Work"
            err = w.exception()
            assert err is None or isinstance(err, (dfccl.AbortedError, dfccl.PeerAbortedError)), repr(err)
    with pytest.raises(dfccl.ClosedError, match="aborted"):
        comms[0].all_reduce(np.ones(4, np.float32))
    for c in comms:
        c.close()
    fresh = dfccl.Communicator.for_devices(devs, backend="sim", options=dfccl.CommOptions(path=path))
    xs = [np.full(1000, r + 1, np.float32) for r in range(2)]
    for w in [c.all_reduce(x) for c, x in zip(fresh, xs)]:
        w.synchronize(timeout=TIMEOUT)
    assert (xs[0] == 3).all()
    sc.settle(fresh)


def test_abort_bad_timeout():
    comms = dfccl.Communicator.for_devices([DEV + 4, DEV + 5], backend="sim")
    try:
        for bad in (-1, float("nan"), "1", True):
            with pytest.raises(dfccl.InvalidArgumentError, match="abort: timeout"):
                comms[0].abort(timeout=bad)
    finally:
        sc.settle(comms)


# -- status, recorder, trace, CLI ------------------------------------------------------------
def test_status_names_what_each_pending_collective_waits_for(tmp_path):
    comms = dfccl.Communicator.for_devices([DEV + 10, DEV + 11, DEV + 12], backend="sim",
                                           options=dfccl.CommOptions(path="ring"))
    try:
        x = [np.ones(256, np.float32) for _ in range(3)]
        for w in [c.all_reduce(v, tag="done") for c, v in zip(comms, x)]:
            w.synchronize(timeout=TIMEOUT)
        pending = [comms[r].all_gather(np.ones(8, np.int32), np.zeros(24, np.int32), tag="stuck") for r in (0, 1)]
        time.sleep(0.1)
        st = comms[0].status()
        assert st.state == "open" and st.rank == 0 and st.world_size == 3
        assert len(st.pending) == 1
        p = st.pending[0]
        assert p.kind == "all_gather" and p.tag == "stuck" and p.instance == 1
        assert p.missing_ranks == [2] and p.joined_ranks == [0, 1] and p.waiting_for == 2
        text = str(st)
        assert "all_gather tag 'stuck'" in text and "ranks [2] have not joined" in text
        events = [e["event"] for e in st.recent]
        assert events.count("submit") == 2 and "complete" in events
        done = [e for e in st.recent if e["event"] == "complete"][0]
        assert done["tag"] == "done" and done["bytes"] == 1024 and done["dtype"] == "float32"
        # Trace across the ranks of this process.
        path = trace.export(tmp_path / "t.json")
        doc = json.load(open(path))
        names = [e["name"] for e in doc["traceEvents"] if e["ph"] == "X"]
        assert names.count("all_reduce done") >= 3 and "all_gather stuck (pending)" in names
        merged = trace.merge([path, path], tmp_path / "m.json")
        assert len(json.load(open(merged))["traceEvents"]) == 2 * len(doc["traceEvents"])
        pending.append(comms[2].all_gather(np.ones(8, np.int32), np.zeros(24, np.int32), tag="stuck"))
        for w in pending:
            w.synchronize(timeout=TIMEOUT)
        assert comms[0].status().pending == []
    finally:
        sc.settle(comms)
    assert comms[0].status().state == "closed"


def test_close_keeps_memory_the_daemon_still_holds():
    """A collective abandoned on the host (an abort that could not wait) is
    still the daemon's until it writes its completion word: closing the
    communicator afterwards must not free the memory under it."""
    comms = dfccl.Communicator.for_devices([DEV + 15, DEV + 16], backend="sim")
    c = comms[0]
    w = c.all_reduce(np.ones(64, np.float32), tag="alone")  # rank 1 never joins
    ep = c._endpoint
    assert c._daemon.held_by_daemon(ep.id) == 1
    assert c._daemon.abandon(w) and w.done() and isinstance(w.exception(), dfccl.AbortedError)
    time.sleep(0.05)
    assert c._daemon.held_by_daemon(ep.id) == 1  # the daemon still runs it
    for cc in comms:
        cc.close()
    assert ep.arena != 0, "the arena was freed under a collective the daemon still held"


def test_work_position_and_stream_reached_without_a_stream():
    """Each submission's entry in the ring (Work.position, compared with
    Daemon.submissions) grows; one submitted without a stream is armed at
    submission, so there is no armed word to read (stream_reached: None)."""
    comms = dfccl.Communicator.for_devices([DEV + 13, DEV + 14], backend="sim")
    try:
        xs = [np.ones(64, np.float32) for _ in range(4)]
        works = [comms[0].all_reduce(xs[0], tag="chain"), comms[0].all_reduce(xs[1], tag="chain")]
        assert works[0].position < works[1].position < comms[0]._daemon.submissions[0]
        assert not works[1].stream_ordered and comms[0]._daemon.stream_reached(works[1]) is None
        works += [comms[1].all_reduce(xs[2], tag="chain"), comms[1].all_reduce(xs[3], tag="chain")]
        for w in works:
            w.synchronize(timeout=TIMEOUT)
        assert comms[0]._daemon.submissions[1] > works[1].position
        assert all(bool((x == 2.0).all()) for x in xs)
    finally:
        sc.settle(comms)


def _wait_released_by_daemon(daemon, idx, timeout=TIMEOUT):
    deadline = time.monotonic() + timeout
    while daemon.held_by_daemon(idx) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert daemon.held_by_daemon(idx) == 0, "the daemon never let go of the abandoned collective"


def test_closed_endpoint_keeps_its_id_while_the_daemon_holds_it():
    """The endpoint of a communicator closed while the daemon still runs one
    of its collectives drains: its id is not handed to the next communicator
    (the collective would run against that one's peers) and its device entry
    stays until the daemon lets go; then the entry is cleared and the id
    reused."""
    comms = dfccl.Communicator.for_devices([DEV + 17, DEV + 18], backend="sim")
    c = comms[0]
    daemon, idx = c._daemon, c._endpoint.id
    w = c.all_reduce(np.ones(64, np.float32), tag="alone")   # rank 1 never joins
    assert daemon.abandon(w)
    c.close()
    assert daemon.draining == [idx] and daemon.endpoint_entry(idx) == (0, 2)
    later = dfccl.Communicator.for_devices([DEV + 17, DEV + 18], backend="sim")
    try:
        assert later[0]._endpoint.id != idx
        comms[1].close()              # rank 0's abandoned collective fails now: its peer left
        _wait_released_by_daemon(daemon, idx)
        assert daemon.reclaim_endpoints() == 0 and daemon.draining == []
        assert daemon.endpoint_entry(idx) == (0, 0)
        # The daemon still serves the communicator created meanwhile.
        ys = [np.full(64, r + 1, np.float32) for r in range(2)]
        for ww in [cc.all_reduce(y, tag="after") for cc, y in zip(later, ys)]:
            ww.synchronize(timeout=TIMEOUT)
        assert (ys[0] == 3).all() and (ys[1] == 3).all()
        again = dfccl.Communicator.for_devices([DEV + 17, DEV + 18], backend="sim")
        assert again[0]._endpoint.id == idx     # released, so reused
        sc.settle(again)
    finally:
        sc.settle(later)


def test_daemon_rejects_descriptor_naming_a_released_endpoint():
    """A descriptor naming the id of a closed communicator (stale, or corrupt)
    is rejected, not run against memory that communicator freed."""
    live = dfccl.Communicator.for_devices([DEV + 19, DEV + 20], backend="sim")
    gone = dfccl.Communicator.for_devices([DEV + 19, DEV + 20], backend="sim")
    try:
        daemon, stale = gone[0]._daemon, gone[0]._endpoint.id
        for cc in gone:
            cc.close()
        assert daemon.endpoint_entry(stale) == (0, 0) and daemon.draining == []
        c = live[0]
        x = np.ones(64, np.float32)
        task = c._submitter.task(0, *c._submitter.pair(x, None, "all_reduce"), 64, dfccl.ReduceOp.SUM, 0, "raw", None)
        before = daemon.bad_tasks
        w = daemon.submit(task, {"endpoint": stale})
        with pytest.raises(dfccl.BackendError, match="BAD_TASK"):
            w.synchronize(timeout=TIMEOUT)
        assert daemon.bad_tasks == before + 1 and (x == 1).all()
    finally:
        sc.settle(live)


def test_remove_endpoint_refuses_an_id_not_registered():
    comms = dfccl.Communicator.for_devices([DEV + 21, DEV + 22], backend="sim")
    daemon, idx = comms[0]._daemon, comms[0]._endpoint.id
    sc.settle(comms)
    with pytest.raises(dfccl.InvalidArgumentError, match="not registered"):
        daemon.remove_endpoint(idx)      # already removed by close()
    with pytest.raises(dfccl.InvalidArgumentError, match="not registered"):
        daemon.remove_endpoint(daemon.max_endpoints)


def test_trace_bad_arguments(tmp_path):
    with pytest.raises(dfccl.InvalidArgumentError, match="path must be"):
        trace.export(42)
    with pytest.raises(dfccl.InvalidArgumentError, match="list of trace files"):
        trace.merge("one.json", tmp_path / "o.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(dfccl.InvalidArgumentError, match="not a trace"):
        trace.merge([bad], tmp_path / "o.json")


def test_cli_status_shows_a_running_process(tmp_path):
    script = textwrap.dedent("""
        import sys, time
        import numpy as np
        import dfccl
        comms = dfccl.Communicator.for_devices([3320, 3321], backend="sim")
        w = comms[0].all_reduce(np.ones(16, np.float32), tag="hung")
        print("ready", flush=True)
        sys.stdin.readline()
        comms[0].abort()
    """)
    env = dict(os.environ, DFCCL_STATUS_DIR=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=env)
    try:
        assert proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 20
        out = ""
        while time.monotonic() < deadline:
            r = subprocess.run([sys.executable, "-m", "dfccl", "status", "--dir", str(tmp_path)], capture_output=True,
                               text=True, env=env, timeout=60)
            out = r.stdout
            if "hung" in out:
                break
            time.sleep(0.3)
        assert f"process {proc.pid}" in out and "all_reduce tag 'hung'" in out and "ranks [1] have not joined" in out, out
        r = subprocess.run([sys.executable, "-m", "dfccl", "status", "--dir", str(tmp_path), "--json"],
                           capture_output=True, text=True, env=env, timeout=60)
        docs = json.loads(r.stdout)
        assert docs[0]["pid"] == proc.pid
        assert [p["tag"] for c in docs[0]["communicators"] for p in c["pending"]] == ["hung"]
    finally:
        proc.stdin.write("\n")
        proc.stdin.flush()
        proc.wait(timeout=30)
    assert not [f for f in os.listdir(tmp_path) if str(proc.pid) in f], "status file left behind"
    r = subprocess.run([sys.executable, "-m", "dfccl", "status", "--dir", str(tmp_path / "nope")], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "does not exist" in r.stderr


# -- bad descriptors ----------------------------------------------------------------------
_BAD_FIELDS = [
    {"kind": NUM_KINDS}, {"kind": 255}, {"dtype": NUM_DTYPES}, {"dtype": 200}, {"op": NUM_OPS}, {"op": 99},
    {"path": NUM_PATHS}, {"path": 7}, {"nchannels": 0}, {"nchannels": 33}, {"nchannels": 65535},
    {"endpoint": 1 << 20}, {"endpoint": 255}, {"bucket": 1 << 30}, {"root": 9}, {"instance": 0},
    {"slice_bytes": 0, "path": 1}, {"slice_bytes": 3, "path": 1, "dtype": 7}, {"fifo_slots": 0, "path": 1},
    {"first_block": 32}, {"first_block": 1 << 31},
]


@pytest.mark.parametrize("fields", _BAD_FIELDS, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
def test_daemon_rejects_bad_descriptor(fields):
    comms = dfccl.Communicator.for_devices([DEV + 30, DEV + 31], backend="sim")
    try:
        c = comms[0]
        x = np.ones(64, np.float32)
        task = c._submitter.task(0, *c._submitter.pair(x, None, "all_reduce"), 64, dfccl.ReduceOp.SUM, 0, "raw", None)
        before = c._daemon.bad_tasks
        w = c._daemon.submit(task, fields)
        with pytest.raises(dfccl.BackendError, match="BAD_TASK"):
            w.synchronize(timeout=TIMEOUT)
        assert c._daemon.bad_tasks == before + 1
        assert (x == 1).all()        # never run
        # The daemon goes on.
        ys = [np.full(64, r + 1, np.float32) for r in range(2)]
        for ww in [cc.all_reduce(y, tag="after") for cc, y in zip(comms, ys)]:
            ww.synchronize(timeout=TIMEOUT)
        assert (ys[0] == 3).all()
    finally:
        sc.settle(comms)


def test_daemon_counts_descriptor_with_bad_slot():
    comms = dfccl.Communicator.for_devices([DEV + 32, DEV + 33], backend="sim")
    try:
        c = comms[0]
        x = np.ones(64, np.float32)
        task = c._submitter.task(0, *c._submitter.pair(x, None, "all_reduce"), 64, dfccl.ReduceOp.SUM, 0, "raw", None)
        before = c._daemon.bad_tasks
        c._daemon.submit(task, {"slot": 1 << 30})
        deadline = time.monotonic() + TIMEOUT
        while c._daemon.bad_tasks == before and time.monotonic() < deadline:
            time.sleep(0.01)
        assert c._daemon.bad_tasks == before + 1
        ys = [np.full(64, r + 1, np.float32) for r in range(2)]
        for ww in [cc.all_reduce(y, tag="after") for cc, y in zip(comms, ys)]:
            ww.synchronize(timeout=TIMEOUT)
        assert (ys[1] == 3).all()
    finally:
        sc.settle(comms, timeout=1.0)


def test_raw_descriptor_rejects_unknown_field():
    comms = dfccl.Communicator.for_devices([DEV + 34, DEV + 35], backend="sim")
    try:
        c = comms[0]
        x = np.ones(4, np.float32)
        task = c._submitter.task(0, *c._submitter.pair(x, None, "all_reduce"), 4, dfccl.ReduceOp.SUM, 0, "raw", None)
        with pytest.raises(dfccl.InvalidArgumentError, match="not one a test may set"):
            c._daemon.submit(task, {"send_addr": 0})
    finally:
        sc.settle(comms)
