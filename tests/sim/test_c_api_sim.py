"""The C API (cuda/include/dfccl/dfccl_api.h) on the simulator: the
example of examples/c_api built with the system C compiler and run, the
table's entries called from C (tests/capi_calls.c, through ctypes), C
submissions mixed with Python ones on one tag, handles that fail, are
retired without a Work, or outlive their plan, and submissions that run
while another thread holds the GIL."""

from __future__ import annotations

import ctypes
import gc
import importlib.util
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import dfccl
from dfccl import capi
from dfccl._native.layout import STATUS_ABORTED
from dfccl_support import scenarios as sc

DEV = 4400          # device ids of this module: 4400..4499
TIMEOUT = 30.0
ROOT = Path(__file__).resolve().parents[2]
CC = shutil.which("cc")

pytestmark = pytest.mark.skipif(CC is None, reason="no C compiler (cc) to build the C API's example and test shells")



def _compile(tmp: Path, source: Path, name: str) -> str:
    lib = tmp / name
    subprocess.check_call([CC, "-O2", "-std=c11", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC",
                           f"-I{capi.include_dir()}", str(source), "-o", str(lib)])
    return str(lib)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("capi")
    return {"example": _compile(tmp, ROOT / "examples" / "c_api" / "submit.c", "libexample.so"),
            "calls": _compile(tmp, ROOT / "tests" / "capi_calls.c", "libcalls.so")}


@pytest.fixture(scope="module")
def example(built):
    spec = importlib.util.spec_from_file_location("c_api_example", ROOT / "examples" / "c_api" / "run.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod, mod.load(built["example"])


class Calls:
    """tests/capi_calls.c: the table's entries, called without the GIL."""

    def __init__(self, path: str):
        self.lib = lib = ctypes.CDLL(path)
        self.held = ctypes.PyDLL(path)    # the same functions, called with the GIL held
        vp, u32p, i32p, u64p = (ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_int32),
                                ctypes.POINTER(ctypes.c_uint64))
        for name, args, res in [
                ("t_codes", [ctypes.POINTER(ctypes.c_int)], None), ("t_handle_bytes", [], ctypes.c_size_t), ("t_api_bytes", [], ctypes.c_size_t),
                ("t_api_version", [], ctypes.c_uint), ("t_table_size", [vp], ctypes.c_size_t),
                ("t_table_version", [vp], ctypes.c_uint), ("t_handle_gen", [vp], ctypes.c_uint32),
                ("t_handle_zeroed", [vp], ctypes.c_int), ("t_submit", [vp, vp, vp], ctypes.c_int),
                ("t_submit_at", [vp, vp, ctypes.c_uint64, ctypes.c_uint64, vp], ctypes.c_int),
                ("t_submit_on", [vp, vp, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint64, vp], ctypes.c_int),
                ("t_test", [vp, vp, u32p, i32p], ctypes.c_int),
                ("t_wait", [vp, vp, ctypes.c_int64, u32p, i32p], ctypes.c_int),
                ("t_stream_wait", [vp, vp, ctypes.c_uint64], ctypes.c_int), ("t_release", [vp, vp], ctypes.c_int),
                ("t_error_string", [vp, ctypes.c_int], ctypes.c_char_p), ("t_last_error", [vp], ctypes.c_char_p),
                ("t_plan_retain", [vp, vp], ctypes.c_int), ("t_plan_release", [vp, vp], ctypes.c_int),
                ("t_submit_when", [vp, vp, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int), vp, u64p, u64p],
                 ctypes.c_int),
                ("t_hold", [ctypes.POINTER(ctypes.c_int), ctypes.c_uint64, u64p, u64p], None)]:
            for l in (lib, self.held):
                f = getattr(l, name)
                f.argtypes, f.restype = args, res
        self.api = capi.table_address()
        self.hbytes = lib.t_handle_bytes()

    def handles(self, n: int = 1):
        return ctypes.create_string_buffer(n * self.hbytes)

    def at(self, buf, i: int) -> int:
        return ctypes.addressof(buf) + i * self.hbytes

    def submit(self, plan, h, i: int = 0) -> int:
        return self.lib.t_submit(self.api, plan.c_plan, self.at(h, i))

    def test(self, h, i: int = 0):
        status, detail = ctypes.c_uint32(), ctypes.c_int32()
        rc = self.lib.t_test(self.api, self.at(h, i), ctypes.byref(status), ctypes.byref(detail))
        return rc, status.value, detail.value

    def wait(self, h, i: int = 0, timeout: float = TIMEOUT):
        status, detail = ctypes.c_uint32(), ctypes.c_int32()
        rc = self.lib.t_wait(self.api, self.at(h, i), int(timeout * 1e9), ctypes.byref(status), ctypes.byref(detail))
        return rc, status.value, detail.value

    def release(self, h, i: int = 0) -> int:
        return self.lib.t_release(self.api, self.at(h, i))

    def last_error(self) -> str:
        return self.lib.t_last_error(self.api).decode()


@pytest.fixture(scope="module")
def calls(built):
    global OK, PENDING, FAILED, E_INVALID, E_RESOURCE, E_CLOSED
    c = Calls(built["calls"])
    codes = (ctypes.c_int * 8)()
    c.lib.t_codes(codes)   # the header's dfccl_api_code values
    OK, PENDING, FAILED, E_INVALID, E_RESOURCE, E_CLOSED = codes[:6]
    return c


@pytest.fixture
def make():
    made = []

    def _make(n: int = 2, base: int = DEV, **options):
        comms = dfccl.Communicator.for_devices([base + i for i in range(n)], backend="sim",
                                               options=dfccl.CommOptions(**options))
        made.append(comms)
        return comms

    yield _make
    for comms in made:
        sc.settle(comms)


def _bound(comms, count: int = 256, tag=None, fill=None):
    xs = [np.full(count, r + 1.0 if fill is None else fill, np.float32) for r in range(len(comms))]
    return xs, [c.prepare_all_reduce(count, "float32", tag=tag).bind(x) for c, x in zip(comms, xs)]


# -- the table and the example --------------------------------------------------------------
def test_table_matches_the_header_and_the_header_is_cxx(calls, tmp_path):
    assert calls.lib.t_table_size(calls.api) == calls.lib.t_api_bytes()
    assert calls.lib.t_table_version(calls.api) == calls.lib.t_api_version() == capi.API_VERSION
    assert capi.CAPSULE_NAME == "dfccl._native.capi.api"
    for code, words in [(OK, "completed"), (PENDING, "pending"), (FAILED, "failed"), (E_INVALID, "invalid"),
                        (E_CLOSED, "closed")]:
        assert words in calls.lib.t_error_string(calls.api, code).decode()
    cxx = shutil.which("c++")
    if cxx is not None:   # plain C, usable from C++ as well
        src = tmp_path / "use.cpp"
        src.write_text("#include <dfccl/dfccl_api.h>\nint main() { dfccl_api a{}; return (int)a.version; }\n")
        subprocess.check_call([cxx, "-std=c++11", "-Wall", "-Werror", "-fsyntax-only", f"-I{capi.include_dir()}",
                               str(src)])


def test_capsule_is_importable_by_name():
    """What PyCapsule_Import(DFCCL_API_CAPSULE) does: import the module, take
    its attribute, check the name."""
    imp = ctypes.pythonapi.PyCapsule_Import
    imp.restype, imp.argtypes = ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_int]
    assert imp(capi.CAPSULE_NAME.encode(), 0) == capi.table_address()


def test_example_runs_as_a_user_runs_it():
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "c_api" / "run.py"), "--iterations", "12",
                        "--devices", f"{DEV + 90},{DEV + 91}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-4000:]
    assert "12 rounds of all-reduce on 2 ranks from C: results checked" in r.stdout


def test_example_rounds_checked_in_c_and_submit_loop(example, make):
    mod, lib = example
    comms = make(2)
    buffers = [np.zeros(1000, np.float32) for _ in comms]
    plans = [c.prepare_all_reduce(1000, "float32").bind(b) for c, b in zip(comms, buffers)]
    mod.all_reduce(lib, plans, buffers, 25)
    # 200 back to back per rank, all outstanding at once, then waited for.
    for b in buffers:
        b.fill(1.0)
    submit_s, cpu_s, wait_s = mod.submit_loop(lib, plans, 10)
    assert submit_s > 0 and cpu_s > 0 and wait_s >= 0
    assert all(np.all(b == 2.0 ** 10) for b in buffers)
    assert [c._daemon.outstanding_count for c in comms] == [0, 0]


# -- handles ------------------------------------------------------------------------------------
def test_c_and_python_submissions_are_instances_of_one_tag(calls, make):
    """Rank 0 submits through C, rank 1 calls the plan: they meet as the same
    instances, and the Python calls count on from the C ones."""
    comms = make(2, base=DEV + 2)
    xs, plans = _bound(comms, tag="mixed")
    for k in range(5):
        for r, x in enumerate(xs):
            x.fill(r + 1.0)
        h = calls.handles()
        assert calls.submit(plans[0], h) == OK
        w = plans[1]()
        assert calls.wait(h) == (OK, 0, -1)
        w.synchronize(TIMEOUT)
        assert calls.release(h) == OK and calls.lib.t_handle_zeroed(calls.at(h, 0))
        assert w.instance == k + 1
        assert all(np.all(x == 3.0) for x in xs)
    ws = [p() for p in plans]
    assert ws[0].instance == 6, "rank 0's Python call counts on from its five C submissions"
    for w in ws:
        w.synchronize(TIMEOUT)


def test_submit_at_other_buffers(calls, make):
    comms = make(2, base=DEV + 4)
    _, plans = _bound(comms)
    ys = [np.full(256, 10.0 * (r + 1), np.float32) for r in range(2)]
    h = calls.handles(2)
    for r in range(2):
        assert calls.lib.t_submit_at(calls.api, plans[r].c_plan, ys[r].ctypes.data, ys[r].ctypes.data,
                                     calls.at(h, r)) == OK
    assert [calls.wait(h, r)[0] for r in range(2)] == [OK, OK]
    assert [calls.release(h, r) for r in range(2)] == [OK, OK]
    assert all(np.all(y == 30.0) for y in ys)


def test_handles_retire_without_a_work_and_release_frees_them(calls, make):
    """Nobody tests these: the watcher and the progress thread retire them
    (the tag's instances given back); their slots stay until released."""
    comms = make(2, base=DEV + 6)
    _, plans = _bound(comms, tag="unwaited")
    h = calls.handles(2 * 20)
    for i in range(20):
        for r in range(2):
            assert calls.submit(plans[r], h, 2 * i + r) == OK
    daemons = [c._daemon for c in comms]
    deadline = time.monotonic() + TIMEOUT
    while any(daemon.outstanding_count for daemon in daemons) and time.monotonic() < deadline:
        time.sleep(1e-3)
    assert [daemon.outstanding_count for daemon in daemons] == [0, 0], "completed C submissions were left unretired"
    table = comms[0]._endpoint.tags
    assert table.used == 0, "every instance went back to the tag table"
    assert all(calls.test(h, i) == (OK, 0, -1) for i in range(40))
    assert all(calls.release(h, i) == OK for i in range(40))
    # Released: the handle is zeroed (a second release does nothing); a copy
    # of a released handle names nothing.
    assert calls.release(h, 0) == OK
    stale = calls.handles()
    h2 = calls.handles()
    assert calls.submit(plans[0], h2) == OK and calls.submit(plans[1], stale) == OK
    ctypes.memmove(stale, h2, calls.hbytes)
    assert calls.wait(h2)[0] == OK and calls.release(h2) == OK
    assert calls.test(stale)[0] == E_INVALID and "names no collective" in calls.last_error()


def test_abort_fails_pending_handles(calls, make):
    """A C submission whose peer never comes fails with ABORTED when its
    communicator aborts; the handle reports it, then releases."""
    comms = make(2, base=DEV + 8)
    _, plans = _bound(comms, tag="lonely")
    h = calls.handles()
    assert calls.submit(plans[0], h) == OK
    assert calls.test(h)[0] == PENDING
    assert calls.wait(h, timeout=0.05)[0] == PENDING
    comms[0].abort(timeout=5.0)
    rc, status, _ = calls.wait(h)
    assert (rc, status) == (FAILED, STATUS_ABORTED)
    assert calls.release(h) == OK
    # The aborted rank takes nothing more, from C either.
    address = comms[0]._daemon.c_plan(plans[0]._task)
    assert calls.lib.t_submit(calls.api, address, calls.at(h, 0)) == E_CLOSED
    assert "closed or aborted" in calls.last_error() and calls.lib.t_handle_zeroed(calls.at(h, 0))


def test_closed_communicator_refuses_c_submissions(calls, make):
    comms = make(2, base=DEV + 10)
    _, plans = _bound(comms)
    addresses = [p.c_plan for p in plans]
    for c in comms:
        c.close()
    h = calls.handles()
    # The daemon outlives its communicators, but the closed rank's endpoint
    # may go to another communicator: nothing is submitted for it.
    assert calls.lib.t_submit(calls.api, addresses[0], calls.at(h, 0)) == E_CLOSED
    assert "closed or aborted" in calls.last_error()
    with pytest.raises(dfccl.ClosedError):
        plans[0].c_plan


def test_plan_outlives_its_bound_plan_once_retained(calls, make):
    comms = make(2, base=DEV + 12)
    xs, plans = _bound(comms, tag="kept")
    addresses = [p.c_plan for p in plans]
    assert all(calls.lib.t_plan_retain(calls.api, a) == OK for a in addresses)
    del plans
    gc.collect()
    h = calls.handles(2)
    for r in range(2):
        assert calls.lib.t_submit(calls.api, addresses[r], calls.at(h, r)) == OK
    assert [calls.wait(h, r)[0] for r in range(2)] == [OK, OK]
    assert all(np.all(x == 3.0) for x in xs)
    assert [calls.release(h, r) for r in range(2)] == [OK, OK]
    assert all(calls.lib.t_plan_release(calls.api, a) == OK for a in addresses)


def test_submissions_run_while_another_thread_holds_the_gil(calls, make):
    """Once a tag has its bucket, a C submission takes no GIL: 50 rounds on
    two ranks start and end while this thread holds it in C."""
    comms = make(2, base=DEV + 14)
    _, plans = _bound(comms, tag="no-gil")
    h = calls.handles(2)
    for r in range(2):   # the first instance claims the tag's bucket (under the GIL)
        assert calls.submit(plans[r], h, r) == OK
    assert [calls.wait(h, r)[0] for r in range(2)] == [OK, OK] and [calls.release(h, r) for r in range(2)] == [0, 0]
    n = 50
    go = ctypes.c_int(0)
    handles = calls.handles(2 * n)
    started, ended, held_from, held_to = (ctypes.c_uint64() for _ in range(4))
    plan_array = (ctypes.c_void_p * 2)(*[p.c_plan for p in plans])
    result = []
    t = threading.Thread(target=lambda: result.append(calls.lib.t_submit_when(
        calls.api, plan_array, 2, n, ctypes.byref(go), handles, ctypes.byref(started), ctypes.byref(ended))))
    t.start()
    calls.held.t_hold(ctypes.byref(go), 2 * 10**9, ctypes.byref(held_from), ctypes.byref(held_to))
    t.join(TIMEOUT)
    assert result == [OK]
    assert held_from.value <= started.value and ended.value < held_to.value, (
        f"the submissions ran {(ended.value - started.value) / 1e6:.1f} ms, not within the 2 s the GIL was held")
    assert all(calls.wait(handles, i)[0] == OK for i in range(2 * n))
    assert all(calls.release(handles, i) == OK for i in range(2 * n))


def test_probe_runs_on_the_simulator():
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "probes" / "c_api_probe.py"), "--backend", "sim",
                        "--devices", f"{DEV + 92},{DEV + 93}", "--n", "20", "--reps", "2"], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-4000:]
    rows = [line for line in r.stdout.splitlines() if " cpu " in line]
    assert [row.split(":")[0].strip() for row in rows] == ["C API, a loop in C", "bound plan, from Python",
                                                            "comm.all_reduce(x), numpy"]
    assert all(float(row.split(":")[1].split()[0]) > 0 for row in rows)


def test_submissions_on_a_capturing_stream_are_captured(calls, make):
    """A C submission on a stream that captures a graph is captured as a
    Python one is: nothing runs at capture, every replay runs it as the
    next instance (two tags in opposite orders on the ranks, rank 1's
    captured from Python, fresh inputs per replay), the handle's stream
    wait is captured, its host waits are refused, and it is released at
    once while the graph keeps what the collective holds."""
    from dfccl import runtime
    comms = make(2, DEV + 90)
    xs = [np.zeros(300, np.float32) for _ in range(2)]
    ys = [np.zeros(5, np.float64) for _ in range(2)]
    px = [c.prepare_all_reduce(300, "float32", tag="x").bind(x) for c, x in zip(comms, xs)]
    py = [c.prepare_all_reduce(5, "float64", tag="y").bind(y) for c, y in zip(comms, ys)]
    streams = [runtime.get_device("sim", DEV + 90 + r).create_stream() for r in range(2)]
    free = [c._daemon.free_slots for c in comms]
    graphs = []
    try:
        h = calls.handles(2)
        streams[0].begin_capture()
        try:
            for i, (plan, buf) in enumerate([(py[0], ys[0]), (px[0], xs[0])]):
                a = buf.ctypes.data
                assert calls.lib.t_submit_on(calls.api, plan.c_plan, a, a, streams[0].handle, calls.at(h, i)) == OK
                assert calls.lib.t_handle_gen(calls.at(h, i)) == 0x80000000   # DFCCL_GRAPH_GEN_BIT: captured
                assert calls.test(h, i)[0] == E_INVALID and "captured in a CUDA graph" in calls.last_error()
                assert calls.wait(h, i)[0] == E_INVALID and "no completion on the host" in calls.last_error()
                assert calls.lib.t_stream_wait(calls.api, calls.at(h, i), streams[0].handle) == OK
        finally:
            graphs.append(streams[0].end_capture())
        assert [calls.release(h, i) for i in range(2)] == [OK, OK] and calls.lib.t_handle_zeroed(calls.at(h, 0))
        streams[1].begin_capture()
        try:
            for w in [comms[1].all_reduce(xs[1], tag="x", stream=streams[1]),
                      comms[1].all_reduce(ys[1], tag="y", stream=streams[1])]:
                assert w.captured
                w.wait(streams[1])
        finally:
            graphs.append(streams[1].end_capture())
        assert graphs[0].size == graphs[1].size == 6           # per collective: wait, arm, captured wait
        assert all((x == 0).all() for x in xs + ys)             # nothing ran at capture
        for k in range(1, 21):
            for r in range(2):
                xs[r][:] = np.arange(300) * (r + 1) + k
                ys[r][:] = (r + 1) * k
            for r in (1, 0):
                graphs[r].launch(streams[r])
            for s in streams:
                assert s.synchronize(timeout=TIMEOUT), f"replay {k} did not complete"
            for r in range(2):
                assert np.array_equal(xs[r], np.arange(300, dtype=np.float32) * 3 + 2 * k), (k, r)
                assert (ys[r] == 3 * k).all(), (k, r)
        for g in graphs:
            g.close()
        graphs = []
        for s in streams:
            assert s.synchronize(timeout=TIMEOUT)
        for c, f in zip(comms, free):
            c._daemon._reap_graphs()
            assert c._daemon.captured == [] and c._daemon.free_slots == f
    finally:
        for g in graphs:
            g.close()
        for s in streams:
            s.synchronize(timeout=TIMEOUT)
            s.close()


def test_a_captured_handle_outside_its_capture(calls, make):
    """A captured handle's stream wait needs a stream under capture, and
    names nothing once its graph is destroyed."""
    from dfccl import runtime
    comms = make(2, DEV + 94)
    xs, plans = _bound(comms, tag="c")
    stream = runtime.get_device("sim", DEV + 94).create_stream()
    try:
        h = calls.handles()
        a = xs[0].ctypes.data
        stream.begin_capture()
        try:
            assert calls.lib.t_submit_on(calls.api, plans[0].c_plan, a, a, stream.handle, calls.at(h, 0)) == OK
        finally:
            graph = stream.end_capture()
        assert calls.lib.t_stream_wait(calls.api, calls.at(h, 0), stream.handle) < 0
        assert "captures into the same graph" in calls.last_error()
        graph.close()
        comms[0]._daemon._reap_graphs()
        assert calls.lib.t_stream_wait(calls.api, calls.at(h, 0), stream.handle) == E_INVALID
        assert "its graph was destroyed" in calls.last_error()
        assert calls.release(h) == OK
    finally:
        stream.close()


def test_example_captures_from_c(example, make):
    mod, lib = example
    comms = make(3, DEV + 96)
    buffers = [np.zeros(1000, np.float32) for _ in comms]
    plans = [c.prepare_all_reduce(1000, "float32", tag="g").bind(b) for c, b in zip(comms, buffers)]
    mod.replay_graphs(lib, comms, plans, buffers, 10)
    assert [c._daemon.captured for c in comms] == [[], [], []]
