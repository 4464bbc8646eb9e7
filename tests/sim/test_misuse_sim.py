"""What a new user gets wrong, on the simulator backend: bad arguments to every
public function (each must raise InvalidArgumentError or ClosedError naming the
argument, the value and the rule), numpy scalars passed as buffers, ranks that
never arrive at start-up, and the shared-memory files of communicators built
from a UniqueId (none may outlive the process, however it ends)."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import dfccl
from dfccl_support import scenarios as sc
from dfccl import bootstrap
from dfccl import communicator as comm_mod
from dfccl.shared_files import shared_directory
from reference import KINDS

DEV = 2400          # device ids of this module: 2400..2599
TIMEOUT = 30.0


@pytest.fixture(scope="module")
def pair():
    comms = dfccl.Communicator.for_devices([DEV, DEV + 1], backend="sim")
    yield comms
    sc.settle(comms)


def _shapes(kind, n, count):
    return {"all_gather": (count, n * count), "reduce_scatter": (n * count, count)}.get(kind, (count, count))


def _raises(exc_type, *fragments, call):
    """call() raises exc_type whose message contains every fragment."""
    with pytest.raises(exc_type) as info:
        call()
    msg = str(info.value)
    for f in fragments:
        assert f in msg, f"{f!r} not in {msg!r}"
    return info.value


def _shm_files(pid: int) -> list[str]:
    d = shared_directory()
    return sorted(f for f in os.listdir(d) if f.startswith(f"dfccl-{pid}-"))


def _run(script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    # The installed dfccl, whatever kind of install: no PYTHONPATH games.
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args], capture_output=True, text=True,
                          timeout=timeout)


def _pids(out: str) -> list[int]:
    return [int(p) for p in re.findall(r"PID (\d+)", out)]


# ==========================================================================================
# 1. Shared-memory files of communicators built from a UniqueId
# ==========================================================================================
_THREADS_SCRIPT = """
    import os, sys, threading
    import numpy as np
    import dfccl
    from dfccl.shared_files import shared_directory
    print("PID", os.getpid(), flush=True)
    uid = dfccl.UniqueId.create()
    comms = [None, None]
    def make(r):
        comms[r] = dfccl.Communicator(uid, r, 2, backend="sim", device=7100 + r, timeout=30)
    ts = [threading.Thread(target=make, args=(r,)) for r in range(2)]
    for t in ts: t.start()
    for t in ts: t.join()
    xs = [np.full(8, r + 1, np.float32) for r in range(2)]
    for w in [c.all_reduce(x, tag="t") for c, x in zip(comms, xs)]:
        w.synchronize(timeout=30)
    assert all((x == 3).all() for x in xs)
    left = [f for f in os.listdir(shared_directory()) if f.startswith(f"dfccl-{os.getpid()}-")]
    print("AFTER-INIT", len(left), flush=True)
    for c in comms: c.close()
"""


def test_shm_files_removed_after_clean_close_and_exit():
    proc = _run(_THREADS_SCRIPT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (pid,) = _pids(proc.stdout)
    assert "AFTER-INIT 0" in proc.stdout, f"arena files outlive start-up: {proc.stdout!r}"
    assert _shm_files(pid) == [], f"left behind: {_shm_files(pid)}"


_FAILED_SCRIPT = """
    import os, sys
    import dfccl
    print("PID", os.getpid(), flush=True)
    uid = dfccl.UniqueId.create()
    try:
        dfccl.Communicator(uid, 0, 2, backend="sim", device=7110, timeout=0.5)
    except dfccl.StartupTimeoutError as exc:
        print("FAILED", exc.missing_ranks, flush=True)
    # A second failure, before anything is published: the store is gone.
    uid.close()
    try:
        dfccl.Communicator(uid, 1, 2, backend="sim", device=7111, timeout=0.5)
    except dfccl.StartupTimeoutError as exc:
        print("NO-STORE", exc.missing_ranks, flush=True)
    from dfccl.shared_files import shared_directory
    print("LEFT", len([f for f in os.listdir(shared_directory()) if f.startswith(f"dfccl-{os.getpid()}-")]), flush=True)
"""


def test_shm_files_removed_after_failed_construction():
    proc = _run(_FAILED_SCRIPT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (pid,) = _pids(proc.stdout)
    assert "FAILED [1]" in proc.stdout and "NO-STORE None" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert "LEFT 0" in proc.stdout, f"a failed construction left its arena file: {proc.stdout!r}"
    assert _shm_files(pid) == []


_RANK_SCRIPT = """
    import os, signal, sys
    import numpy as np
    import dfccl
    print("PID", os.getpid(), flush=True)
    rank = int(sys.argv[1])
    uid = dfccl.UniqueId.from_string(sys.argv[2])
    c = dfccl.Communicator(uid, rank, 2, backend="sim", device=7120 + rank, timeout=60)
    assert c.path == "staged"
    x = np.full(1000, rank + 1, np.float32)
    c.all_reduce(x, tag="x").synchronize(timeout=30)
    assert (x == 3).all()
    print("DONE", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)   # no close(), no atexit
"""


def test_shm_files_gone_when_ranks_are_killed():
    """Ranks in two processes (staged direct path over the shared arenas) are killed
    after start-up: nothing of theirs stays in shared memory."""
    uid = dfccl.UniqueId.create()
    try:
        procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(_RANK_SCRIPT), str(r), uid.to_string()],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        uid.close()
    for (out, err), p in zip(outs, procs):
        assert "DONE" in out, err[-3000:]
        assert p.returncode == -9
        (pid,) = _pids(out)
        assert _shm_files(pid) == [], f"process {pid} left {_shm_files(pid)}"


# ==========================================================================================
# 2. Bad arguments: constructors
# ==========================================================================================
def test_constructor_bad_rank_world_size_device_timeout():
    uid = dfccl.UniqueId.create()
    try:
        t0 = time.monotonic()
        for rank, frag in ((True, "rank must be an int, not bool"), (1.0, "rank must be an int, not float (1.0)"),
                           ("0", "rank must be an int, not str ('0')"), (-1, "rank must be >= 0, not -1"),
                           (2, "rank 2 is outside 0..1 (world_size 2)")):
            _raises(dfccl.InvalidArgumentError, frag, call=lambda: dfccl.Communicator(uid, rank, 2, backend="sim"))
        for ws, frag in (("2", "world_size must be an int, not str ('2')"), (0, "world_size must be >= 1, not 0"),
                         (2.0, "world_size must be an int, not float"), (10**6, "world_size 1000000 is above")):
            _raises(dfccl.InvalidArgumentError, frag, call=lambda: dfccl.Communicator(uid, 0, ws, backend="sim"))
        for dev, frag in ((True, "device must be an int, not bool"), (-3, "device must be >= 0, not -3"),
                          ("1", "device must be an int, not str")):
            _raises(dfccl.InvalidArgumentError, frag,
                    call=lambda: dfccl.Communicator(uid, 0, 2, backend="sim", device=dev))
        for t, frag in (("30", "timeout must be a number of seconds, not str"), (0, "timeout must be finite and > 0"),
                        (-1, "timeout must be finite and > 0"), (float("inf"), "timeout must be finite"),
                        (True, "timeout must be a number of seconds, not bool")):
            _raises(dfccl.InvalidArgumentError, frag,
                    call=lambda: dfccl.Communicator(uid, 0, 2, backend="sim", timeout=t))
        _raises(dfccl.InvalidArgumentError, "unique_id must be a dfccl.UniqueId, not str", "from_string",
                call=lambda: dfccl.Communicator(uid.to_string(), 0, 2, backend="sim"))
        _raises(dfccl.InvalidArgumentError, "backend must be", "int",
                call=lambda: dfccl.Communicator(uid, 0, 2, backend=1))
        _raises(dfccl.InvalidArgumentError, "backend must be 'cuda' or 'sim', not 'nccl'",
                call=lambda: dfccl.Communicator(uid, 0, 2, backend="nccl"))
        _raises(dfccl.InvalidArgumentError, "options must be a dfccl.CommOptions or None, not dict",
                call=lambda: dfccl.Communicator(uid, 0, 2, backend="sim", options={"path": "ring"}))
        _raises(dfccl.InvalidArgumentError, "daemon_options must be a dfccl.DaemonOptions or None, not CommOptions",
                call=lambda: dfccl.Communicator(uid, 0, 2, backend="sim", daemon_options=dfccl.CommOptions()))
        assert time.monotonic() - t0 < 5, "argument errors must be raised before any waiting"
    finally:
        uid.close()


def test_for_devices_bad_arguments():
    for devs, frag in (([True], "devices[0] must be an int, not bool"), ([0, 1.0], "devices[1] must be an int, not float"),
                       (["0"], "devices[0] must be an int, not str"), ([-1], "devices[0] must be >= 0, not -1"),
                       ("01", "devices must be a sequence of device numbers, not str"),
                       (3, "devices must be a sequence of device numbers, not int"),
                       ([], "at least one device"), (list(range(65)), "at most")):
        _raises(dfccl.InvalidArgumentError, frag, call=lambda: dfccl.Communicator.for_devices(devs, backend="sim"))
    _raises(dfccl.InvalidArgumentError, "options must be a dfccl.CommOptions",
            call=lambda: dfccl.Communicator.for_devices([DEV + 10], backend="sim", options="ring"))
    comms = dfccl.Communicator.for_devices(np.arange(DEV + 10, DEV + 12), backend="sim")   # numpy ints are ints
    sc.settle(comms)


@pytest.mark.parametrize("cls, kw, frag", [
    (dfccl.CommOptions, {"channels": "2"}, "CommOptions.channels must be an int, not str"),
    (dfccl.CommOptions, {"ring_slots": 4.0}, "CommOptions.ring_slots must be an int, not float"),
    (dfccl.CommOptions, {"staging_bytes": -1}, "CommOptions.staging_bytes must be >= 0"),
    (dfccl.CommOptions, {"max_tags": 0}, "CommOptions.max_tags must be >= 1"),
    (dfccl.CommOptions, {"path": "tree"}, "CommOptions.path must be 'auto', 'direct' or 'ring', not 'tree'"),
    (dfccl.DaemonOptions, {"max_outstanding": 12}, "DaemonOptions.max_outstanding must be a power of two"),
    (dfccl.DaemonOptions, {"blocks": True}, "DaemonOptions.blocks must be an int, not bool"),
    (dfccl.DaemonOptions, {"preemption": 0}, "DaemonOptions.preemption must be a bool"),
    (dfccl.DaemonOptions, {"max_endpoints": 0}, "DaemonOptions.max_endpoints must be >= 1"),
])
def test_options_bad_values_name_the_class(cls, kw, frag):
    _raises(dfccl.InvalidArgumentError, frag, call=lambda: cls(**kw))


# ==========================================================================================
# 2. Bad arguments: collectives and plans
# ==========================================================================================
@pytest.mark.parametrize("kind", KINDS)
def test_collective_bad_tag_op_stream(pair, kind):
    c = pair[0]
    s_n, r_n = _shapes(kind, 2, 4)
    args = (np.ones(s_n, np.float32), np.ones(r_n, np.float32))
    e = _raises(dfccl.InvalidArgumentError, f"{kind}: tag 1.5 is not valid", "str, an int or a tuple",
                call=lambda: getattr(c, kind)(*args, tag=1.5))
    assert e.rank == 0
    _raises(dfccl.InvalidArgumentError, f"{kind}: tag ('a', 2.0) is not valid",
            call=lambda: getattr(c, kind)(*args, tag=("a", 2.0)))
    _raises(dfccl.InvalidArgumentError, "stream", call=lambda: getattr(c, kind)(*args, tag="s", stream=1))
    if kind in ("all_reduce", "reduce_scatter", "reduce"):
        e = _raises(dfccl.InvalidArgumentError, f"{kind}: op: unsupported reduction 'median'", "sum, prod",
                    call=lambda: getattr(c, kind)(*args, op="median"))
        assert e.rank == 0
    if kind in ("broadcast", "reduce"):
        _raises(dfccl.InvalidArgumentError, f"{kind}: root must be an int rank, not float (1.0)",
                call=lambda: getattr(c, kind)(*args, root=1.0))
        _raises(dfccl.InvalidArgumentError, f"{kind}: root 2 is outside 0..1",
                call=lambda: getattr(c, kind)(*args, root=2))


@pytest.mark.parametrize("kind", KINDS)
def test_prepare_bad_count_dtype_op_tag(pair, kind):
    c = pair[1]
    prep = getattr(c, f"prepare_{kind}")
    for count, frag in ((2.5, "count must be an int, not float (2.5)"), ("10", "count must be an int, not str ('10')"),
                        (True, "count must be an int, not bool"), (-1, "count must be >= 0, not -1"),
                        (None, "count must be an int, not NoneType")):
        e = _raises(dfccl.InvalidArgumentError, f"prepare_{kind}: {frag}", call=lambda: prep(count, "float32"))
        assert e.rank == 1
    _raises(dfccl.InvalidArgumentError, "unsupported dtype 'complex64'", call=lambda: prep(4, "complex64"))
    _raises(dfccl.InvalidArgumentError, f"prepare_{kind}: tag 2.5 is not valid", call=lambda: prep(4, "int32", tag=2.5))
    if kind in ("all_reduce", "reduce_scatter", "reduce"):
        _raises(dfccl.InvalidArgumentError, f"prepare_{kind}: op: unsupported reduction 7",
                call=lambda: prep(4, "int32", op=7))
    if kind in ("broadcast", "reduce"):
        _raises(dfccl.InvalidArgumentError, f"prepare_{kind}: root must be an int rank, not bool",
                call=lambda: prep(4, "int32", root=True))
    p = prep(np.int64(4), "int32", tag=("np-count", kind))   # numpy integers are fine
    assert p.count == 4 and type(p.count) is int


def test_prepare_after_close_and_abort_raises_closed():
    comms = dfccl.Communicator.for_devices([DEV + 20, DEV + 21], backend="sim")
    comms[0].abort()
    comms[1].close()
    for c, state in ((comms[0], "aborted"), (comms[1], "closed")):
        for kind in KINDS:
            e = _raises(dfccl.ClosedError, f"rank {c.rank}: the communicator", state,
                        call=lambda: getattr(c, f"prepare_{kind}")(4, "float32"))
            assert e.rank == c.rank
    sc.settle(comms)


def test_close_bad_timeout(pair):
    _raises(dfccl.InvalidArgumentError, "close: timeout must be a number of seconds, not str",
            call=lambda: pair[0].close(timeout="1"))
    assert not pair[0].closed


def test_buffer_from_pointer_bad_arguments():
    a = np.zeros(4, np.float32)
    for kw, frag in (({"count": "4"}, "count must be an int, not str"), ({"count": 4.0}, "count must be an int"),
                     ({"count": -1}, "count must be >= 0"), ({"ptr": 1.5}, "ptr must be an int, not float"),
                     ({"device": True}, "device must be an int, not bool"), ({"ptr": 0}, "ptr is NULL")):
        args = {"ptr": a.ctypes.data, "count": 4, **kw}
        _raises(dfccl.InvalidArgumentError, "Buffer.from_pointer: ", frag,
                call=lambda: dfccl.Buffer.from_pointer(args["ptr"], args["count"], "float32",
                                                       **({"device": kw["device"]} if "device" in kw else {})))


def test_read_only_recv_accepted_on_non_root_reduce(pair):
    """A non-root rank's recv of reduce is never written: read-only is fine there
    (and left untouched), but not on the root."""
    sends = [np.full(16, r + 1, np.int32) for r in range(2)]
    out_root = np.zeros(16, np.int32)
    ro = np.full(16, 7, np.int32)
    ro.setflags(write=False)
    _raises(dfccl.InvalidArgumentError, "reduce: the output buffer (recv) is read-only",
            call=lambda: pair[0].reduce(sends[0], ro, root=0))
    ws = [pair[0].reduce(sends[0], out_root, root=0, tag="ro-reduce"),
          pair[1].reduce(sends[1], ro, root=0, tag="ro-reduce")]
    for w in ws:
        w.synchronize(timeout=TIMEOUT)
    assert np.all(out_root == 3) and np.all(ro == 7)
    # In place on a non-root rank with a read-only send: nothing is written either.
    ro_send = np.full(16, 5, np.int32)
    ro_send.setflags(write=False)
    out_root[:] = 0
    ws = [pair[1].reduce(ro_send, root=0, tag="ro-reduce2"), pair[0].reduce(sends[0], out_root, root=0, tag="ro-reduce2")]
    for w in ws:
        w.synchronize(timeout=TIMEOUT)
    assert np.all(out_root == 6) and np.all(ro_send == 5)


# ==========================================================================================
# 3. numpy scalars and other temporary exports
# ==========================================================================================
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bad", [np.float32(3), np.int64(2), 3.0, 7, b"abcd", bytearray(8)])
def test_scalars_and_bytes_rejected(pair, kind, bad):
    s_n, r_n = _shapes(kind, 2, 1)
    e = _raises(dfccl.InvalidArgumentError, f"{kind} send", "pass an array",
                call=lambda: getattr(pair[0], kind)(bad, np.ones(r_n, np.float32)))
    assert e.rank == 0
    _raises(dfccl.InvalidArgumentError, f"{kind} recv", "pass an array",
            call=lambda: getattr(pair[0], kind)(np.ones(s_n, np.float32), bad))


def test_numpy_scalar_in_place_names_the_problem(pair):
    x = np.float32(3)
    _raises(dfccl.InvalidArgumentError, "all_reduce send: a numpy scalar (float32)", "pass an array",
            call=lambda: pair[0].all_reduce(x))


class _CopyingInterface:
    """Exposes its data as a bytes object: a view that may be a copy."""

    def __init__(self):
        self._data = b"\0" * 16

    @property
    def __array_interface__(self):
        return {"shape": (4,), "typestr": "<f4", "data": self._data, "version": 3}


def test_array_interface_without_pointer_rejected(pair):
    _raises(dfccl.InvalidArgumentError, "does not expose a pointer", "pass a numpy array",
            call=lambda: pair[0].all_reduce(_CopyingInterface()))


def test_zero_dim_array_accepted(pair):
    xs = [np.array(r + 1.0, np.float32) for r in range(2)]
    ws = [c.all_reduce(x, tag="0d") for c, x in zip(pair, xs)]
    for w in ws:
        w.synchronize(timeout=TIMEOUT)
    assert all(x == 3.0 for x in xs)


# ==========================================================================================
# 4. Start-up: missing ranks are named, within one deadline, with progress logs
# ==========================================================================================
def _start(uid, ranks, n, timeout, base, results):
    def make(r):
        try:
            results[r] = dfccl.Communicator(uid, r, n, backend="sim", device=base + r, timeout=timeout)
        except BaseException as exc:   # noqa: BLE001 - the test inspects it
            results[r] = exc
    ts = [threading.Thread(target=make, args=(r,)) for r in ranks]
    for t in ts:
        t.start()
    return ts


def test_startup_names_missing_ranks_within_one_deadline(monkeypatch, caplog):
    monkeypatch.setattr(bootstrap, "STARTUP_LOG_INTERVAL", 0.3)
    caplog.set_level(logging.INFO, logger="dfccl")
    uid = dfccl.UniqueId.create()
    results = {}
    try:
        t0 = time.monotonic()
        for t in _start(uid, (0, 1, 2), 4, 1.5, DEV + 30, results):
            t.join(30)
        took = time.monotonic() - t0
    finally:
        uid.close()
    # One deadline for the whole start-up, not one timeout per peer awaited.
    assert took < 4.0, f"start-up gave up after {took:.1f} s with a 1.5 s timeout"
    for r in (0, 1, 2):
        exc = results[r]
        assert isinstance(exc, dfccl.StartupTimeoutError), f"rank {r}: {exc!r}"
        assert isinstance(exc, dfccl.CollectiveTimeoutError) and isinstance(exc, TimeoutError)
        assert exc.missing_ranks == [3] and exc.arrived_ranks == [0, 1, 2] and exc.rank == r
        assert exc.waiting_on == 3 and exc.code == dfccl.ErrorCode.TIMEOUT
        assert str(exc) == (f"rank {r}: communicator start-up timed out after 1.5 s: ranks [3] have not arrived "
                            "(ranks [0, 1, 2] have)"), str(exc)
        assert "comm/" not in str(exc)
    progress = [rec.getMessage() for rec in caplog.records if rec.name == "dfccl" and rec.levelno == logging.INFO]
    assert any("waiting for ranks [3] to arrive" in m for m in progress), progress
    assert "StartupTimeoutError" in dfccl.__all__


def test_startup_default_timeout_is_documented_and_sane():
    import inspect

    default = inspect.signature(dfccl.Communicator.__init__).parameters["timeout"]
    assert default.kind is inspect.Parameter.KEYWORD_ONLY
    assert default.default == comm_mod.DEFAULT_STARTUP_TIMEOUT == 120.0


def test_startup_late_rank_joins_in_time():
    uid = dfccl.UniqueId.create()
    results = {}
    try:
        ts = _start(uid, (0, 1), 3, 20, DEV + 40, results)
        time.sleep(0.5)
        ts += _start(uid, (2,), 3, 20, DEV + 40, results)
        for t in ts:
            t.join(30)
        comms = [results[r] for r in range(3)]
        assert all(isinstance(c, dfccl.Communicator) for c in comms), results
        xs = [np.full(5, r + 1, np.int64) for r in range(3)]
        for w in [c.all_reduce(x, tag="late") for c, x in zip(comms, xs)]:
            w.synchronize(timeout=TIMEOUT)
        assert all(np.all(x == 6) for x in xs)
        sc.settle(comms)
    finally:
        uid.close()


def test_startup_failure_of_one_rank_fails_the_others_at_once():
    """A rank that fails during start-up (here: it asks for a device whose
    daemon already runs with other DaemonOptions) tells the others through
    the store: they fail now, naming it, not at their deadline."""
    busy = dfccl.Communicator.for_devices([DEV + 51], backend="sim",
                                          daemon_options=dfccl.DaemonOptions(blocks=3))
    uid = dfccl.UniqueId.create()
    results = {}

    def make(r, ctx_opts):
        try:
            results[r] = dfccl.Communicator(uid, r, 3, backend="sim", device=DEV + 50 + r, timeout=20,
                                            daemon_options=ctx_opts)
        except BaseException as exc:   # noqa: BLE001
            results[r] = exc
    try:
        t0 = time.monotonic()
        ts = [threading.Thread(target=make, args=(r, dfccl.DaemonOptions(blocks=4) if r == 1 else None))
              for r in range(3)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(30)
        took = time.monotonic() - t0
    finally:
        uid.close()
        sc.settle(busy)
    assert took < 10, f"the other ranks waited {took:.1f} s for a rank that had failed"
    assert isinstance(results[1], dfccl.InvalidArgumentError) and "already runs" in str(results[1])
    for r in (0, 2):
        e = results[r]
        assert isinstance(e, dfccl.PeerAbortedError), f"rank {r}: {e!r}"
        assert e.origin == 1 and e.rank == r
        assert str(e).startswith(f"rank {r}: communicator start-up failed on rank 1: InvalidArgumentError: "), str(e)


def test_startup_store_unreachable():
    uid = dfccl.UniqueId.create()
    uid.close()   # nobody serves it any more
    t0 = time.monotonic()
    e = _raises(dfccl.StartupTimeoutError, "rank 1: communicator start-up timed out after 0.5 s",
                "could not reach the rendezvous store", "UniqueId.create()",
                call=lambda: dfccl.Communicator(uid, 1, 2, backend="sim", device=DEV + 60, timeout=0.5))
    assert e.missing_ranks is None and time.monotonic() - t0 < 5
