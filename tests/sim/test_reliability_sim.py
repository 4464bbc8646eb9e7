"""Failures must be loud and precise, on the simulator: timeouts name who has
and has not joined, a signature mismatch reaches every rank with the field,
the values and the ranks, aborting or closing a rank releases the ranks that
wait for it, and a dead peer process is reported as PeerLostError."""

from __future__ import annotations

import time

import numpy as np
import pytest

import dfccl
from dfccl_support import scenarios as sc

DEV = 2800          # device ids of this module: 2800..2999
TIMEOUT = 30.0


def _comms(n, path, dev):
    return dfccl.Communicator.for_devices(list(range(dev, dev + n)), backend="sim",
                                          options=dfccl.CommOptions(path=path))


# -- defect: the wrong rank named on the ring path ----------------------------------------
@pytest.mark.parametrize("path", ("ring", "direct"))
def test_timeout_names_ranks_that_have_not_joined(path):
    comms = _comms(4, path, DEV + (0 if path == "ring" else 10))
    try:
        xs = [np.full(4096, r + 1, np.float32) for r in range(4)]
        works = [comms[r].all_reduce(xs[r], tag="t") for r in range(3)]   # rank 3 never comes
        for r in range(3):
            with pytest.raises(dfccl.CollectiveTimeoutError) as info:
                works[r].synchronize(timeout=0.3)
            err = info.value
            assert err.missing_ranks == [3], str(err)
            assert err.joined_ranks == [0, 1, 2], str(err)
            assert err.waiting_on == 3
            assert "ranks [3] have not joined" in str(err), str(err)
            assert "ranks [0, 1, 2] have" in str(err), str(err)
            assert "rank 0, which has not joined" not in str(err)
        works.append(comms[3].all_reduce(xs[3], tag="t"))
        for w in works:
            w.synchronize(timeout=TIMEOUT)
        assert (xs[0] == 10).all()
    finally:
        sc.settle(comms)


# -- defect: a mismatch reaches one rank only ---------------------------------------------
@pytest.mark.parametrize("path", ("ring", "direct"))
def test_mismatch_reaches_every_rank_naming_field_values_and_ranks(path):
    comms = _comms(3, path, DEV + (20 if path == "ring" else 30))
    try:
        works = [comms[0].all_reduce(np.ones(8, np.float32), tag="m")]
        works += [comms[r].all_reduce(np.ones(16, np.float32), tag="m") for r in (1, 2)]
        for r, w in enumerate(works):
            with pytest.raises(dfccl.MismatchError) as info:
                w.synchronize(timeout=TIMEOUT)
            err = info.value
            msg = str(err)
            assert err.rank == r and err.tag == "m"
            assert err.field == "count", msg
            assert err.values == {0: 8, 1: 16, 2: 16}, msg
            assert err.ranks == [0], msg
            assert "count" in msg and "rank 0 has 8" in msg and "ranks [1, 2] have 16" in msg, msg
        # The communicator goes on: the next instance of the tag matches.
        xs = [np.full(8, r + 1, np.float32) for r in range(3)]
        ws = [c.all_reduce(x, tag="m") for c, x in zip(comms, xs)]
        for w in ws:
            w.synchronize(timeout=TIMEOUT)
        assert (xs[1] == 6).all()
    finally:
        sc.settle(comms)


def test_mismatch_names_dtype_and_op():
    comms = _comms(2, "direct", DEV + 40)
    try:
        w0 = comms[0].all_reduce(np.ones(8, np.float32), op="max", tag="d")
        w1 = comms[1].all_reduce(np.ones(8, np.float32), op="sum", tag="d")
        for w in (w0, w1):
            with pytest.raises(dfccl.MismatchError) as info:
                w.synchronize(timeout=TIMEOUT)
            assert info.value.field == "op", str(info.value)
            assert "max" in str(info.value) and "sum" in str(info.value)
    finally:
        sc.settle(comms)


# -- defect: aborting or closing the absent rank does not release the others -------------
@pytest.mark.parametrize("how", ("abort", "close"))
@pytest.mark.parametrize("path", ("ring", "direct"))
def test_abort_or_close_of_absent_rank_releases_the_others(how, path):
    comms = _comms(4, path, DEV + (50 if path == "ring" else 60) + (0 if how == "abort" else 5))
    try:
        works = [comms[r].all_reduce(np.ones(4096, np.float32), tag="x") for r in range(3)]
        time.sleep(0.05)
        t0 = time.monotonic()
        getattr(comms[3], how)()
        for w in works:
            with pytest.raises(dfccl.PeerAbortedError) as info:
                w.synchronize(timeout=5.0)   # far less than a collective timeout
            assert info.value.origin == 3, str(info.value)
            assert "rank 3" in str(info.value)
        assert time.monotonic() - t0 < 2.0
    finally:
        sc.settle(comms)


# -- bad inputs of the reliability API ----------------------------------------------------
@pytest.mark.parametrize("kw,frag", [
    ({"peer_timeout": 0.5}, "peer_timeout must be None or a finite number of seconds >= 1"),
    ({"peer_timeout": "10"}, "peer_timeout must be None"),
    ({"peer_timeout": float("inf")}, "peer_timeout must be None"),
    ({"peer_timeout": True}, "peer_timeout must be None"),
    ({"flight_events": -1}, "flight_events must be >= 0"),
    ({"flight_events": 1.5}, "flight_events must be an int"),
])
def test_comm_options_reliability_bad_values(kw, frag):
    with pytest.raises(dfccl.InvalidArgumentError, match=frag):
        dfccl.CommOptions(**kw)


def test_flight_recorder_off_and_status_after_close():
    comms = dfccl.Communicator.for_devices([DEV + 90, DEV + 91], backend="sim",
                                           options=dfccl.CommOptions(flight_events=0))
    xs = [np.ones(8, np.float32) for _ in range(2)]
    for w in [c.all_reduce(x) for c, x in zip(comms, xs)]:
        w.synchronize(timeout=TIMEOUT)
    st = comms[0].status()
    assert st.pending == [] and not [e for e in st.recent if e["event"] == "submit"]
    sc.settle(comms)
    assert comms[1].status().state == "closed"
    assert "closed" in str(comms[1].status())


def test_ctrl_c_stops_a_wait_for_a_collective_that_never_completes():
    """synchronize() without a timeout on a collective whose peer never
    comes: Ctrl-C (SIGINT) raises KeyboardInterrupt there within a fraction
    of a second (the wait runs signal handlers every 20 ms), and the
    collective stays pending, as after a timeout."""
    import signal
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import signal, sys, time
        import numpy as np
        import dfccl
        signal.signal(signal.SIGINT, signal.default_int_handler)   # whatever the parent ignores
        comms = dfccl.Communicator.for_devices([2990, 2991], backend="sim")
        w = comms[0].all_reduce(np.ones(8, np.float32), tag="never")   # rank 1 never joins
        print("waiting", flush=True)
        try:
            w.synchronize()
        except KeyboardInterrupt:
            print("interrupted", time.monotonic(), "pending" if not w.done() else "done", flush=True)
            comms[0].abort()
            sys.exit(0)
        sys.exit(1)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "waiting"
        time.sleep(0.3)   # in the wait's yielding phase
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        line = proc.stdout.readline().split()
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert line[0] == "interrupted" and line[2] == "pending", line
    assert float(line[1]) - sent < 2.0, line


def test_a_device_fault_fails_everything_pending_and_refuses_more():
    """A GPU whose context failed (an illegal address in any kernel of the
    process) runs no kernel again, the daemon included, and never writes
    the completion words of what it held: without a check, synchronize()
    would wait forever.  The watcher asks the device every 100 ms
    (Device.query_fault; injected here): a waiting synchronize(), a
    collective nobody waits for and its done-callback all fail with a
    BackendError naming the fault, new collectives are refused, and close()
    returns at once, freeing nothing under the failed device."""
    comms = _comms(2, "direct", DEV + 150)   # its own devices: the injected fault stays on them
    try:
        c = comms[0]
        waited = c.all_reduce(np.ones(64, np.float32), tag="waited")       # rank 1 never joins
        unwatched = c.all_reduce(np.ones(64, np.float32), tag="unwatched")
        called = []
        unwatched.add_done_callback(lambda w: called.append(type(w.exception()).__name__))
        time.sleep(0.1)
        c._daemon.device.inject_fault(700)
        t0 = time.monotonic()
        with pytest.raises(dfccl.BackendError, match="failed under the dfccl daemon: simulated device fault 700"):
            waited.synchronize()                                              # no timeout: it would hang
        assert time.monotonic() - t0 < 2.0
        deadline = time.monotonic() + TIMEOUT
        while not called and time.monotonic() < deadline:
            time.sleep(0.01)
        assert unwatched.done() and isinstance(unwatched.exception(), dfccl.BackendError)
        assert called == ["BackendError"]
        assert c._daemon.device_fault == 700
        with pytest.raises(dfccl.BackendError, match="restart the process") as info:
            c.all_reduce(np.ones(4, np.float32), tag="later")
        assert info.value.driver_code == 700
        assert c.status().pending == []
        t0 = time.monotonic()
        ep = c._endpoint
        c.close()
        assert time.monotonic() - t0 < 2.0 and ep.arena != 0   # kept: nothing is freed on a failed device
    finally:
        comms[1].close()


def test_a_device_fault_reaches_the_peers_in_this_process_as_a_lost_rank():
    """Rank 0's device fails while rank 1 (another device of this process)
    waits for it: rank 1's collective fails with PeerLostError naming rank 0
    and the fault, within a fraction of a second, instead of waiting for its
    timeout; rank 1's later calls say so too."""
    comms = _comms(2, "direct", DEV + 152)   # its own devices: the injected fault stays on them
    try:
        mine = comms[0].all_reduce(np.ones(64, np.float32), tag="rank 0 alone")   # keeps rank 0's watcher busy
        waiting = comms[1].all_reduce(np.ones(64, np.float32), tag="rank 1 alone")
        time.sleep(0.1)
        comms[0]._daemon.device.inject_fault(700)
        t0 = time.monotonic()
        with pytest.raises(dfccl.PeerLostError, match="rank 0 is lost: its device sim:2952 failed under its daemon "
                                                      r"\(simulated device fault 700\)") as info:
            waiting.synchronize(timeout=TIMEOUT)
        assert time.monotonic() - t0 < 3.0
        assert info.value.origin == 0
        with pytest.raises(dfccl.BackendError, match="failed under the dfccl daemon"):
            mine.synchronize(timeout=TIMEOUT)
        with pytest.raises(dfccl.PeerLostError, match="lost rank 0"):
            comms[1].all_reduce(np.ones(4, np.float32))
        assert comms[0].status().state == "device failed (simulated device fault 700)"
    finally:
        for c in comms:
            c.close()


def test_a_device_fault_found_at_the_next_launch():
    """A device that failed while nothing was pending (its daemon had left)
    is found when the next collective launches the daemon: the submission
    raises the device's BackendError, not a bare launch failure, and the
    daemon refuses collectives from then on."""
    comms = _comms(2, "direct", DEV + 154)   # its own devices: the injected fault stays on them
    try:
        zs = [np.ones(8, np.float32) for _ in range(2)]
        for w in [c.all_reduce(z, tag="before") for c, z in zip(comms, zs)]:
            w.synchronize(timeout=TIMEOUT)
        daemon = comms[0]._daemon
        deadline = time.monotonic() + TIMEOUT
        while daemon.daemon_state[1] != "exited" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert daemon.daemon_state[1] == "exited"   # idle: the daemon has left
        daemon.device.inject_fault(700)
        with pytest.raises(dfccl.BackendError, match="failed under the dfccl daemon: simulated device fault 700"):
            comms[0].all_reduce(np.ones(8, np.float32), tag="after")
        assert daemon.device_fault == 700
        with pytest.raises(dfccl.BackendError, match="restart the process"):
            comms[0].all_reduce(np.ones(8, np.float32), tag="later")
    finally:
        for c in comms:
            c.close()


def test_a_failed_collective_keeps_its_buffers_until_no_peer_can_read_them():
    """A rank that fails a collective does not wait for its peers, and on
    the direct path a peer that has met it reads its buffers in place until
    it sees the failure: so the failed collective's buffers stay alive (as
    its tag record does) until the communicator's memory goes, not just
    until it retires.  A collective that completed lets go at once."""
    import gc
    import weakref

    comms = _comms(2, "direct", DEV + 160)
    try:
        done_buf = np.ones(256, np.float32)
        peer = np.ones(256, np.float32)
        ws = [comms[0].all_reduce(done_buf, tag="completes"), comms[1].all_reduce(peer, tag="completes")]
        for w in ws:
            w.synchronize(timeout=TIMEOUT)
        done_ref = weakref.ref(done_buf)
        failed_buf = np.ones(256, np.float32)
        failed_ref = weakref.ref(failed_buf)
        w = comms[0].all_reduce(failed_buf, tag="rank 1 never comes")
        time.sleep(0.05)
        comms[0].abort()
        with pytest.raises(dfccl.AbortedError):
            w.synchronize(timeout=TIMEOUT)
        deadline = time.monotonic() + TIMEOUT
        while comms[0]._daemon.held_by_daemon(comms[0]._endpoint.id) and time.monotonic() < deadline:
            time.sleep(1e-3)   # until the daemon let go of it and it retired
        del ws, w, done_buf, failed_buf
        gc.collect()
        assert done_ref() is None, "a completed collective's buffer is let go at once"
        assert failed_ref() is not None, "a failed collective's buffer must outlive its retirement"
    finally:
        sc.settle(comms)
    gc.collect()
    assert failed_ref() is None, "once every rank closed, nothing keeps it"


_ABORT_WHILE_PEER_READS = r"""
import gc, random, sys, time
import numpy as np
import dfccl
random.seed(int(sys.argv[1]))
for it in range(20):
    comms = dfccl.Communicator.for_devices([100 + 2 * it, 101 + 2 * it], backend="sim",
                                           options=dfccl.CommOptions(path="direct"))
    # 32 MiB each: malloc maps them, and free unmaps them at once.
    a, b = np.ones(8 << 20, np.float32), np.ones(8 << 20, np.float32)
    works = [comms[0].all_reduce(a, tag="t"), comms[1].all_reduce(b, tag="t")]
    del a                                    # only rank 0's Work keeps it now
    time.sleep(random.uniform(0, 0.004))     # rank 1 is reading it in place, or about to
    comms[0].abort()
    for w in works:
        try:
            w.synchronize(timeout=30)
        except dfccl.DfcclError:
            pass
    del works
    gc.collect()
    comms[1].abort()
    for c in comms:
        c.close()
print("COMPLETED")
"""


def test_abort_while_a_peer_reads_the_buffers_in_place():
    """Rank 0 aborts an all-reduce that rank 1's daemon reads in place
    (direct path), and nothing but rank 0's Work keeps rank 0's input.  The
    failed collective retires at once, without waiting for rank 1; had its
    buffer gone with it, rank 1's read would land in unmapped memory (a
    segmentation fault here, an illegal address on a GPU: seen as a rare
    crash under abort with heavy traffic).  In a subprocess, so that a crash
    fails this test rather than the run."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _ABORT_WHILE_PEER_READS, str(int(time.time()))],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0 and "COMPLETED" in out.stdout, (out.returncode, out.stdout[-2000:], out.stderr[-4000:])
