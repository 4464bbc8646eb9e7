"""The API contract of dfccl on the simulator backend: argument validation,
plans, zero-count collectives, tags, mismatch detection, timeouts, abort and
close, Work objects (callbacks, stats, exceptions) and typed errors."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import dfccl
from dfccl_support import scenarios as sc
from dfccl.errors import ErrorCode
from dfccl.tags import tag_key
from reference import KINDS

DEV = 2000          # device ids of this module: 2000..2199
PATHS = ("direct", "ring")
TIMEOUT = 30.0


# -- helpers ------------------------------------------------------------------------------
@pytest.fixture
def make():
    """make(n, path) -> fresh communicators on devices DEV.., closed after the test."""
    made = []

    def _make(n: int, path: str = "auto", base: int = DEV, **options):
        comms = dfccl.Communicator.for_devices([base + i for i in range(n)], backend="sim",
                                               options=dfccl.CommOptions(path=path, **options))
        made.append(comms)
        return comms

    yield _make
    for comms in made:
        sc.settle(comms)


@pytest.fixture(scope="module")
def pair():
    """Two ranks (direct path) shared by the validation tests, which never submit
    anything that reaches the daemon unless every rank does."""
    comms = dfccl.Communicator.for_devices([DEV + 50, DEV + 51], backend="sim")
    yield comms
    sc.settle(comms)


def outcome(work, timeout=10.0):
    """'ok' or the exception synchronize() raised."""
    try:
        work.synchronize(timeout=timeout)
    except dfccl.DfcclError as exc:
        return exc
    return "ok"


def all_reduce_ok(comms, tag=None, count=33):
    """Runs an all_reduce on every rank and checks the result (the communicator works)."""
    xs = [np.full(count, r + 1, np.int64) for r in range(len(comms))]
    ws = [c.all_reduce(x, tag=tag) for c, x in zip(comms, xs)]
    for w in ws:
        w.synchronize(timeout=TIMEOUT)
    want = sum(range(1, len(comms) + 1))
    for r, x in enumerate(xs):
        assert np.all(x == want), f"rank {r}: {x[:4]} != {want}"


def submit(c, kind, send, recv=None, **kw):
    return getattr(c, kind)(send, recv, **kw)


# ==========================================================================================
# Argument validation
# ==========================================================================================
def _shapes(kind, n, count):
    """(send count, recv count) of a well-formed call."""
    return {"all_gather": (count, n * count), "reduce_scatter": (n * count, count)}.get(kind, (count, count))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("which", ("send", "recv"))
def test_non_contiguous_rejected(pair, kind, which):
    c = pair[0]
    s_n, r_n = _shapes(kind, 2, 8)
    send = np.ones(s_n, np.float32)
    recv = np.ones(r_n, np.float32)
    if which == "send":
        send = np.ones(2 * s_n, np.float32)[::2]
    else:
        recv = np.ones(2 * r_n, np.float32)[::2]
    with pytest.raises(dfccl.InvalidArgumentError, match="contiguous") as info:
        submit(c, kind, send, recv)
    assert info.value.code == ErrorCode.INVALID_ARGUMENT


def test_fortran_order_2d_rejected_c_order_accepted(pair):
    f = np.asfortranarray(np.ones((4, 3), np.float32))
    with pytest.raises(dfccl.InvalidArgumentError, match="contiguous"):
        pair[0].all_reduce(f, np.ones((4, 3), np.float32))
    # 2-D C-contiguous arrays are fine (and a row of a C array too).
    xs = [np.full((4, 3), r + 1.0, np.float32) for r in range(2)]
    ws = [c.all_reduce(x, tag="2d") for c, x in zip(pair, xs)]
    for w in ws:
        w.synchronize(timeout=TIMEOUT)
    assert all(np.all(x == 3.0) for x in xs)


@pytest.mark.parametrize("bad", [np.complex64, np.bool_, np.float128 if hasattr(np, "float128") else np.complex128,
                                 np.int16, np.uint16, ">f4", object])
@pytest.mark.parametrize("kind", ("all_reduce", "broadcast"))
def test_unsupported_dtype_rejected(pair, bad, kind):
    arr = np.zeros(8, dtype=bad)
    with pytest.raises(dfccl.InvalidArgumentError) as info:
        submit(pair[0], kind, arr)
    assert info.value.code == ErrorCode.INVALID_ARGUMENT


@pytest.mark.parametrize("bad", [[1.0, 2.0], 3.0, "abc", None, b"bytes"])
def test_non_array_rejected(pair, bad):
    with pytest.raises(dfccl.InvalidArgumentError, match="not an array"):
        pair[0].all_reduce(bad, np.zeros(2, np.float32))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("delta", (-1, 1))
def test_count_mismatch_rejected(pair, kind, delta):
    n = 2
    s_n, r_n = _shapes(kind, n, 8)
    with pytest.raises(dfccl.InvalidArgumentError) as info:
        submit(pair[1], kind, np.ones(s_n, np.float32), np.ones(r_n + delta, np.float32))
    assert info.value.rank == 1, "argument errors of a communicator name its rank"
    assert "elements" in str(info.value)


@pytest.mark.parametrize("kind", KINDS)
def test_dtype_mismatch_rejected(pair, kind):
    s_n, r_n = _shapes(kind, 2, 8)
    with pytest.raises(dfccl.InvalidArgumentError, match="float32.*int32|int32.*float32") as info:
        submit(pair[0], kind, np.ones(s_n, np.float32), np.ones(r_n, np.int32))
    assert info.value.rank == 0


@pytest.mark.parametrize("kind", ("broadcast", "reduce"))
@pytest.mark.parametrize("root", (-1, 2, 100, 1.0, "0", None))
def test_bad_root_rejected(pair, kind, root):
    with pytest.raises(dfccl.InvalidArgumentError, match="root") as info:
        submit(pair[0], kind, np.ones(4, np.float32), root=root)
    assert info.value.rank == 0
    with pytest.raises(dfccl.InvalidArgumentError, match="root"):
        getattr(pair[0], f"prepare_{kind}")(4, "float32", root=root)


@pytest.mark.parametrize("kind", KINDS)
def test_readonly_output_rejected(pair, kind):
    s_n, r_n = _shapes(kind, 2, 8)
    recv = np.ones(r_n, np.float32)
    recv.setflags(write=False)
    with pytest.raises(dfccl.InvalidArgumentError, match="read-only") as info:
        submit(pair[0], kind, np.ones(s_n, np.float32), recv)
    assert info.value.rank == 0


@pytest.mark.parametrize("kind", ("all_reduce", "broadcast", "reduce"))
def test_readonly_in_place_rejected(pair, kind):
    buf = np.ones(8, np.float32)
    buf.setflags(write=False)
    with pytest.raises(dfccl.InvalidArgumentError, match="read-only"):
        submit(pair[0], kind, buf)


def test_readonly_input_accepted(pair):
    """Only the output must be writable."""
    xs = [np.full(16, r + 1, np.int32) for r in range(2)]
    for x in xs:
        x.setflags(write=False)
    outs = [np.zeros(16, np.int32) for _ in range(2)]
    ws = [c.all_reduce(x, o, tag="ro-in") for c, x, o in zip(pair, xs, outs)]
    for w in ws:
        w.synchronize(timeout=TIMEOUT)
    assert all(np.all(o == 3) for o in outs)


def _overlapping(kind, rank, n=2, count=8):
    """(send, recv) views of one array that overlap without being the in-place form."""
    big = np.zeros(n * count + 4, np.float32)
    whole = big[:n * count]
    other = (rank + 1) % n
    shifted = big[rank * count + 1:rank * count + 1 + count]       # this rank's slot, one element off
    if kind == "all_gather":
        return [(whole[other * count:(other + 1) * count], whole),  # another rank's slot
                (shifted, whole)]
    if kind == "reduce_scatter":
        return [(whole, whole[other * count:(other + 1) * count]), (whole, shifted)]
    return [(big[:count], big[1:count + 1]), (big[count // 2:count // 2 + count], big[:count])]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", (0, 1))
def test_overlap_not_in_place_rejected(pair, kind, case):
    send, recv = _overlapping(kind, 1)[case]
    with pytest.raises(dfccl.InvalidArgumentError, match="overlap") as info:
        submit(pair[1], kind, send, recv)
    assert info.value.rank == 1


def test_validation_errors_submit_nothing(pair):
    """After a batch of rejected calls both ranks still pair up: nothing was
    submitted (tagged calls here, see test_failed_untagged_submission_* for
    the sequence numbers of untagged ones)."""
    c = pair[0]
    with pytest.raises(dfccl.InvalidArgumentError):
        c.all_reduce(np.ones(4, np.float32), np.ones(5, np.float32), tag="v")
    with pytest.raises(dfccl.InvalidArgumentError):
        c.all_reduce(np.ones(4, np.float32), np.ones(4, np.int32), tag="v")
    with pytest.raises(dfccl.InvalidArgumentError):
        c.all_reduce(np.ones(4, np.float32), op="median", tag="v")
    all_reduce_ok(pair, tag="v")


@pytest.mark.parametrize("op", ("median", "", None, 7, "SUMM"))
def test_bad_op_rejected(pair, op):
    with pytest.raises(dfccl.InvalidArgumentError, match="reduction"):
        pair[0].all_reduce(np.ones(4, np.float32), op=op)
    with pytest.raises(dfccl.InvalidArgumentError, match="reduction"):
        pair[0].prepare_all_reduce(4, "float32", op=op)


@pytest.mark.parametrize("op", ("SUM", "Prod", "product", "mean", dfccl.ReduceOp.MAX))
def test_op_spellings_accepted(pair, op):
    xs = [np.full(5, 2 + r, np.int64) for r in range(2)]
    ws = [c.all_reduce(x, op=op, tag=("spell", str(op))) for c, x in zip(pair, xs)]
    for w in ws:
        w.synchronize(timeout=TIMEOUT)
    want = {"SUM": 5, "Prod": 6, "product": 6, "mean": 2, dfccl.ReduceOp.MAX: 3}[op]
    assert all(np.all(x == want) for x in xs), (op, xs)


def test_bool_tag_rejected(pair):
    for tag in (True, False, (1, True), 1.5, [1], ("a", None), b"x"):
        with pytest.raises(dfccl.InvalidArgumentError, match="tag"):
            pair[0].all_reduce(np.ones(4, np.float32), tag=tag)
        with pytest.raises(dfccl.InvalidArgumentError, match="tag"):
            pair[0].prepare_all_reduce(4, "float32", tag=tag)
    all_reduce_ok(pair, tag="after-bad-tags")


def test_bfloat16_buffer_from_pointer(pair):
    """bfloat16 only through Buffer.from_pointer; checks the wrapped values."""
    vals = [np.array([1.0, 2.0, -3.5, 0.25], np.float32), np.array([0.5, 0.5, 0.5, 0.5], np.float32)]
    bits = [(v.view(np.uint32) >> 16).astype(np.uint16) for v in vals]   # exact in bf16
    bufs = [dfccl.Buffer.from_pointer(b.ctypes.data, b.size, "bfloat16", owner=b) for b in bits]
    assert bufs[0].dtype == dfccl.DataType.BFLOAT16 and bufs[0].nbytes == 8
    ws = [c.all_reduce(b, tag="bf16") for c, b in zip(pair, bufs)]
    for w in ws:
        w.synchronize(timeout=TIMEOUT)
    got = (bits[0].astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(got, vals[0] + vals[1])
    np.testing.assert_array_equal(bits[0], bits[1])
    with pytest.raises(dfccl.InvalidArgumentError):
        dfccl.Buffer.from_pointer(bits[0].ctypes.data, -1, "bfloat16")
    with pytest.raises(dfccl.InvalidArgumentError):
        dfccl.Buffer.from_pointer(bits[0].ctypes.data, 4, "bfloat8")
    ro = dfccl.Buffer.from_pointer(bits[0].ctypes.data, 4, "bfloat16", owner=bits[0], readonly=True)
    with pytest.raises(dfccl.InvalidArgumentError, match="read-only"):
        pair[0].all_reduce(ro)


def test_construction_errors():
    with pytest.raises(dfccl.InvalidArgumentError):
        dfccl.Communicator.for_devices([], backend="sim")
    with pytest.raises(dfccl.InvalidArgumentError):
        dfccl.Communicator.for_devices([DEV + 60], backend="nccl")
    with pytest.raises(dfccl.InvalidArgumentError):
        dfccl.Communicator.for_devices([-1], backend="sim")
    with pytest.raises(dfccl.InvalidArgumentError):
        dfccl.CommOptions(path="tree")
    for slots in (0, 65):
        with pytest.raises(dfccl.InvalidArgumentError):
            dfccl.CommOptions(ring_slots=slots)
    for n in (0, 7, 12, 4095):
        with pytest.raises(dfccl.InvalidArgumentError):
            dfccl.DaemonOptions(max_outstanding=n)
    for b in (0, 33):
        with pytest.raises(dfccl.InvalidArgumentError):
            dfccl.DaemonOptions(blocks=b)


def test_daemon_options_must_match_first_ones():
    dev = DEV + 70
    comms = dfccl.Communicator.for_devices([dev], backend="sim", daemon_options=dfccl.DaemonOptions(blocks=3))
    try:
        assert comms[0].channels == 3
        with pytest.raises(dfccl.InvalidArgumentError, match="already runs"):
            dfccl.Communicator.for_devices([dev], backend="sim", daemon_options=dfccl.DaemonOptions(blocks=4))
        same = dfccl.Communicator.for_devices([dev], backend="sim", daemon_options=dfccl.DaemonOptions(blocks=3))
        none = dfccl.Communicator.for_devices([dev], backend="sim")
        assert same[0].channels == 3 and none[0].channels == 3
        for c in same + none:
            c.close()
    finally:
        comms[0].close()


def test_properties(make):
    comms = make(3, "auto", base=DEV + 10)
    for r, c in enumerate(comms):
        assert (c.rank, c.world_size, c.device, c.backend) == (r, 3, DEV + 10 + r, "sim")
        assert c.path == "direct", "auto picks direct when every rank is in this process"
        assert 1 <= c.channels <= 32 and not c.closed
        assert f"rank {r}/3" in repr(c)
    ring = make(2, "ring", base=DEV + 10)
    assert all(c.path == "ring" for c in ring)


def test_submissions_taken_by_the_daemon(make):
    comms = make(2, "direct", base=DEV + 12)
    daemon = comms[0]._daemon
    published, taken = daemon.submissions
    assert taken <= published
    all_reduce_ok(comms, tag="taken")
    after, taken = daemon.submissions
    assert after == published + 1, "rank 0's device got one submission"
    assert taken == after, "a completed collective was copied to the device"


def test_daemon_profile_counts_runs_and_the_simulator_has_no_sms(make):
    comms = make(2, "direct", base=DEV + 132)
    daemon = comms[0]._daemon
    before = sum(b["runs"] for b in daemon.daemon_profile())
    all_reduce_ok(comms, tag="profiled")
    deadline = time.monotonic() + TIMEOUT   # a busy block stores its counters every few passes
    while sum(b["runs"] for b in daemon.daemon_profile()) <= before and time.monotonic() < deadline:
        time.sleep(1e-3)
    assert sum(b["runs"] for b in daemon.daemon_profile()) > before
    assert daemon.daemon_sms() == [None] * daemon.nblocks


def test_base_window_adapts_to_observed_waits(make):
    """Every retirement feeds the policy; once per period the daemon hands
    the observations to policy.adapt() and publishes the new base window."""
    comms = make(2, "direct", base=DEV + 16)
    daemon = comms[0]._daemon
    start = daemon.policy.base_window_ns
    deadline = time.monotonic() + TIMEOUT
    while not daemon.policy.history and time.monotonic() < deadline:
        all_reduce_ok(comms, tag="adapt")
        time.sleep(2e-3)
    assert daemon.policy.history, "the base window never adapted"
    assert daemon.policy.base_window_ns != start and daemon.policy.history[-1][0] == daemon.policy.base_window_ns


def test_unwaited_collectives_are_retired_by_the_watcher(make):
    """Nobody synchronizes these: the daemon's watcher retires them (slots
    and tag records given back), and a callback added later still runs."""
    comms = make(2, "direct", base=DEV + 14)
    daemons = [c._daemon for c in comms]   # a rank may finish after its peer: watch both
    xs = [[np.full(8, r + 1.0, np.float32) for _ in range(40)] for r in range(2)]
    works = [[c.all_reduce(x, tag=("unwaited", i)) for i, x in enumerate(xs[r])] for r, c in enumerate(comms)]
    called = threading.Event()
    works[0][-1].add_done_callback(lambda w: called.set())
    deadline = time.monotonic() + TIMEOUT
    while any(daemon.outstanding_count for daemon in daemons) and time.monotonic() < deadline:
        time.sleep(1e-3)
    assert [daemon.outstanding_count for daemon in daemons] == [0, 0], "completed collectives were left unretired"
    assert all(w.done() and w.exception() is None for ws in works for w in ws)
    assert called.wait(TIMEOUT)
    assert all(np.all(x == 3.0) for r in range(2) for x in xs[r])


# ==========================================================================================
# Plans
# ==========================================================================================
def _prepare(c, kind, count, dtype="float32", **kw):
    return getattr(c, f"prepare_{kind}")(count, dtype, **kw)


@pytest.mark.parametrize("kind", KINDS)
def test_plan_wrong_buffers_rejected(pair, kind):
    c = pair[0]
    p = _prepare(c, kind, 8, tag=("plan-check", kind))
    s_n, r_n = _shapes(kind, 2, 8)
    good_s, good_r = np.ones(s_n, np.float32), np.ones(r_n, np.float32)
    bad = [(np.ones(s_n + 1, np.float32), good_r), (good_s, np.ones(r_n - 1, np.float32)),
           (np.ones(s_n, np.int32), np.ones(r_n, np.int32)), (np.ones(s_n, np.float64), good_r),
           (good_s, np.ones(r_n, np.float64))]
    for s, r in bad:
        with pytest.raises(dfccl.InvalidArgumentError) as info:
            p(s, r)
        assert info.value.rank == 0 and info.value.code == ErrorCode.INVALID_ARGUMENT
    assert p.kind == kind and p.count == 8 and p.dtype == dfccl.DataType.FLOAT32
    assert repr(p).startswith("<dfccl.Plan")


def test_plan_bad_arguments():
    comms = dfccl.Communicator.for_devices([DEV + 80], backend="sim")
    c = comms[0]
    try:
        with pytest.raises(dfccl.InvalidArgumentError):
            c.prepare_all_reduce(-1, "float32")
        for dt in ("complex64", "int16", "float8", np.bool_):
            with pytest.raises(dfccl.InvalidArgumentError, match="dtype"):
                c.prepare_all_reduce(4, dt)
        for dt in ("float32", np.dtype("int8"), dfccl.DataType.BFLOAT16, "double", "half", "torch.float16"):
            assert c.prepare_all_reduce(4, dt).dtype in set(dfccl.DataType)
    finally:
        c.close()


@pytest.mark.parametrize("path", PATHS)
def test_plans_untagged_prepared_in_same_order(make, path):
    """Untagged plans are named by creation order; calls may interleave freely."""
    comms = make(2, path)
    plans = [(c.prepare_all_reduce(10, "int32"), c.prepare_broadcast(10, "int32", root=1)) for c in comms]
    xs = [np.full(10, r + 1, np.int32) for r in range(2)]
    ys = [np.full(10, 10 * (r + 1), np.int32) for r in range(2)]
    works = [plans[0][1](ys[0]), plans[0][0](xs[0]),   # rank 0: broadcast first
             plans[1][0](xs[1]), plans[1][1](ys[1])]   # rank 1: all_reduce first
    for w in works:
        w.synchronize(timeout=TIMEOUT)
    assert all(np.all(x == 3) for x in xs)
    assert all(np.all(y == 20) for y in ys)


@pytest.mark.parametrize("path", PATHS)
def test_plan_in_place_and_out_of_place_calls(make, path):
    comms = make(2, path)
    plans = [c.prepare_all_gather(5, "int64", tag="ag-plan") for c in comms]
    for it in range(3):
        outs = [np.full(10, -1, np.int64) for _ in range(2)]
        sends = []
        for r in range(2):
            if it % 2:  # in place
                outs[r][r * 5:(r + 1) * 5] = 100 * it + r
                sends.append(outs[r][r * 5:(r + 1) * 5])
            else:
                sends.append(np.full(5, 100 * it + r, np.int64))
        ws = [p(s, o) for p, s, o in zip(plans, sends, outs)]
        for w in ws:
            w.synchronize(timeout=TIMEOUT)
        want = np.repeat(np.array([100 * it, 100 * it + 1], np.int64), 5)
        for r in range(2):
            np.testing.assert_array_equal(outs[r], want, err_msg=f"call {it} rank {r}")


# ==========================================================================================
# Zero-count collectives
# ==========================================================================================
@pytest.mark.parametrize("kind", KINDS)
def test_zero_count_completes_at_once(pair, kind):
    c = pair[0]   # only one rank: nothing to wait for
    empty = np.zeros(0, np.float32)
    w = submit(c, kind, empty, np.zeros(0, np.float32))
    assert w.done()
    assert w.synchronize(timeout=0) is None
    assert w.exception() is None
    st = w.stats
    assert set(st) >= {"preemptions", "resumes", "queued_ns", "running_ns", "wall_ns", "host_ns", "channels"}
    assert all(v == 0 for v in st.values()), st
    assert w.kind == kind and w.rank == 0
    called = []
    w.add_done_callback(called.append)
    assert called == [w]
    p = _prepare(c, kind, 0, tag=("zero", kind))
    w2 = p(empty, empty)
    assert w2.done() and w2.exception() is None
    all_reduce_ok(pair, tag=("after-zero", kind))


def test_zero_count_in_place_and_none_recv(pair):
    w = pair[1].all_reduce(np.zeros(0, np.int8))
    assert w.done()
    w = pair[1].reduce(np.zeros(0, np.int8), root=1)
    assert w.done()


# ==========================================================================================
# Tags
# ==========================================================================================
@pytest.mark.parametrize("path", PATHS)
def test_tag_reuse_in_different_orders(make, path):
    """k-th use of a tag on one rank meets the k-th use on the others."""
    n = 3
    comms = make(n, path)
    orders = [["A", "B", "A", "C", "B", "A"],
              ["B", "B", "A", "A", "C", "A"],
              ["C", "A", "A", "A", "B", "B"]]
    uses = {}
    works, results = [], {}
    for r in range(n):
        seen = {}
        for tag in orders[r]:
            k = seen.get(tag, 0)
            seen[tag] = k + 1
            x = np.full(7, (ord(tag) * 100 + k) * 10 + r, np.int64)
            results[(r, tag, k)] = x
            works.append(comms[r].all_reduce(x, tag=tag))
            uses[tag] = max(uses.get(tag, 0), k + 1)
    for w in works:
        w.synchronize(timeout=TIMEOUT)
    for (r, tag, k), x in results.items():
        want = sum((ord(tag) * 100 + k) * 10 + q for q in range(n))
        assert np.all(x == want), f"rank {r}: use {k} of tag {tag!r} got {x[0]}, want {want}"
    assert [w.instance for w in works[:6]] == [1, 1, 2, 1, 2, 3]


@pytest.mark.parametrize("tag", [0, 1, -5, 2**70, "x", "", "ünïcode", (1, "a"), ((1, 2), ("b",)), ()])
def test_tag_types(pair, tag):
    xs = [np.full(3, r + 1, np.int32) for r in range(2)]
    ws = [c.all_reduce(x, tag=tag) for c, x in zip(pair, xs)]
    for w in ws:
        w.synchronize(timeout=TIMEOUT)
        assert w.tag == tag
    assert all(np.all(x == 3) for x in xs)


def test_distinct_tags_do_not_match(make):
    """Tags 1 and "1" (and (1,)) are different collectives."""
    comms = make(2, "direct")
    a = [np.full(4, 1, np.int32), np.full(4, 2, np.int32)]
    b = [np.full(4, 10, np.int32), np.full(4, 20, np.int32)]
    c_ = [np.full(4, 100, np.int32), np.full(4, 200, np.int32)]
    ws = [comms[0].all_reduce(a[0], tag=1), comms[0].all_reduce(b[0], tag="1"), comms[0].all_reduce(c_[0], tag=(1,)),
          comms[1].all_reduce(c_[1], tag=(1,)), comms[1].all_reduce(b[1], tag="1"), comms[1].all_reduce(a[1], tag=1)]
    for w in ws:
        w.synchronize(timeout=TIMEOUT)
    assert np.all(a[0] == 3) and np.all(b[0] == 30) and np.all(c_[0] == 300)
    assert np.all(a[1] == 3) and np.all(b[1] == 30) and np.all(c_[1] == 300)


def test_same_tag_in_two_communicators(make):
    """Tags are scoped by communicator: two communicators over the same devices
    use tag "t" with different shapes at once."""
    c1 = make(2, "direct")
    c2 = make(2, "ring")
    x1 = [np.full(10, r + 1, np.int32) for r in range(2)]
    x2 = [np.full(999, 10 * (r + 1), np.float64) for r in range(2)]
    ws = [c1[0].all_reduce(x1[0], tag="t"), c2[1].all_reduce(x2[1], tag="t"),
          c2[0].all_reduce(x2[0], tag="t"), c1[1].all_reduce(x1[1], tag="t")]
    for w in ws:
        w.synchronize(timeout=TIMEOUT)
    assert all(np.all(x == 3) for x in x1) and all(np.all(x == 30.0) for x in x2)


def test_untagged_and_tagged_interleave(make):
    comms = make(2, "ring")
    xs = {(r, k): np.full(5, 10 * k + r, np.int64) for r in range(2) for k in range(4)}
    ws = [comms[0].all_reduce(xs[(0, 0)]), comms[0].all_reduce(xs[(0, 1)], tag="t"), comms[0].all_reduce(xs[(0, 2)]),
          comms[1].all_reduce(xs[(1, 1)], tag="t"), comms[1].all_reduce(xs[(1, 0)]), comms[1].all_reduce(xs[(1, 2)])]
    for w in ws:
        w.synchronize(timeout=TIMEOUT)
    for k in range(3):
        for r in range(2):
            assert np.all(xs[(r, k)] == 20 * k + 1), (r, k, xs[(r, k)])


# ==========================================================================================
# Mismatch detection
# ==========================================================================================
def _mismatched_call(c, what, odd, tag):
    """Rank's submission for a mismatch test; ``odd`` ranks differ in ``what``."""
    count = 64 + (1 if odd and what == "count" else 0)
    dtype = np.int32 if odd and what == "dtype" else np.float32
    x = np.ones(count, dtype)
    if what == "op":
        return c.all_reduce(x, op="max" if odd else "sum", tag=tag), x
    if what == "root":
        return c.broadcast(x, root=1 if odd else 0, tag=tag), x
    if what == "kind":
        return (c.reduce(x, tag=tag) if odd else c.all_reduce(x, tag=tag)), x
    return c.all_reduce(x, tag=tag), x


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("n", (2, 3))
@pytest.mark.parametrize("what", ("count", "dtype", "op", "root", "kind"))
def test_mismatch_detected(make, path, n, what):
    comms = make(n, path)
    odd_rank = n - 1
    order = list(range(n))[::-1] if what in ("op", "kind") else list(range(n))
    works = {}
    for r in order:
        works[r] = _mismatched_call(comms[r], what, r == odd_rank, ("mm", what))
    results = {r: outcome(w, timeout=15) for r, (w, _x) in works.items()}
    for r, res in results.items():
        assert isinstance(res, (dfccl.MismatchError, dfccl.PeerAbortedError)), \
            f"{what} mismatch, rank {r}: {res!r} (expected MismatchError or PeerAbortedError)"
        assert res.rank == r and res.tag == ("mm", what)
        assert works[r][0].done() and works[r][0].exception() is res
    mism = [res for res in results.values() if isinstance(res, dfccl.MismatchError)]
    assert mism, f"no rank reported MismatchError: {results}"
    for res in mism:
        assert res.code == ErrorCode.MISMATCH and res.peer is not None and 0 <= res.peer < n and res.peer != res.rank
        assert (res.rank == odd_rank) != (res.peer == odd_rank), \
            f"rank {res.rank} reports peer {res.peer}, but rank {odd_rank} is the odd one"
    for res in results.values():
        if isinstance(res, dfccl.PeerAbortedError):
            assert res.code == ErrorCode.PEER_ABORTED and res.origin is not None and 0 <= res.origin < n
    # The data of a failed collective is never "completed": synchronize raises again.
    with pytest.raises((dfccl.MismatchError, dfccl.PeerAbortedError)):
        works[0][0].synchronize(timeout=1)
    # The communicator keeps working: other tags, untagged, and the same tag again.
    all_reduce_ok(comms, tag="after-mismatch")
    all_reduce_ok(comms)
    all_reduce_ok(comms, tag=("mm", what))


# ==========================================================================================
# Timeouts
# ==========================================================================================
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("n", (2, 3))
def test_timeout_names_missing_rank_and_work_completes_later(make, path, n):
    comms = make(n, path)
    missing = n - 1
    xs = [np.full(1000, r + 1, np.float32) for r in range(n)]
    early = [comms[r].all_reduce(xs[r], tag="late") for r in range(n) if r != missing]
    t0 = time.monotonic()
    with pytest.raises(dfccl.CollectiveTimeoutError) as info:
        early[0].synchronize(timeout=0.5)
    waited = time.monotonic() - t0
    assert 0.45 <= waited < 5.0, f"synchronize(timeout=0.5) returned after {waited:.2f} s"
    err = info.value
    assert isinstance(err, TimeoutError) and err.code == ErrorCode.TIMEOUT
    assert err.rank == 0 and err.tag == "late"
    assert f"rank {missing}" in str(err), f"message does not name rank {missing}: {err}"
    assert err.waiting_on == missing
    assert not early[0].done() and early[0].exception() is None and early[0].stats is None
    for w in early[1:]:
        with pytest.raises(dfccl.CollectiveTimeoutError, match=f"rank {missing}"):
            w.synchronize(timeout=0.05)
    late = comms[missing].all_reduce(xs[missing], tag="late")
    for w in early + [late]:
        w.synchronize(timeout=TIMEOUT)
        assert w.done() and w.exception() is None
        assert w.stats["preemptions"] >= 0
    want = sum(range(1, n + 1))
    assert all(np.all(x == want) for x in xs)
    assert early[0].stats["preemptions"] >= 1, "the early rank waited 0.5 s for its peer without preemption"


def test_untagged_collectives_never_read_like_an_int_tag(make):
    from dfccl import trace

    comms = make(2, "direct")
    xs = [np.ones(4, np.float32) for _ in range(4)]
    first = [c.all_reduce(x) for c, x in zip(comms, xs)]   # untagged #1 on both ranks
    for w in first:
        w.synchronize(timeout=TIMEOUT)
    untagged = comms[0].all_reduce(xs[2])                   # untagged #2: rank 1 never joins
    tagged = comms[0].all_reduce(xs[3], tag=2)              # an int tag equal to its position
    assert (first[0].tag, first[0].instance, first[0].name) == (None, 1, "untagged #1")
    assert (untagged.tag, untagged.instance, untagged.name) == (None, 2, "untagged #2")
    assert (tagged.tag, tagged.instance, tagged.name) == (2, 1, "tag 2 (instance 1)")
    assert repr(untagged) == "<dfccl.Work all_reduce untagged #2 rank=0 pending>"
    with pytest.raises(dfccl.CollectiveTimeoutError) as info:
        untagged.synchronize(timeout=0.1)
    assert str(info.value).startswith("rank 0: all_reduce untagged #2 did not complete") and info.value.tag is None
    with pytest.raises(dfccl.CollectiveTimeoutError) as info:
        tagged.synchronize(timeout=0.1)
    assert str(info.value).startswith("rank 0: all_reduce tag 2 (instance 1) did not complete")
    assert info.value.tag == 2
    status = str(comms[0].status())
    assert "all_reduce untagged #2, " in status and "all_reduce tag 2 (instance 1), " in status, status
    names = {ev["name"] for ev in trace.trace_events()}
    assert {"all_reduce untagged", "all_reduce untagged (pending)", "all_reduce 2 (pending)"} <= names
    comms[0].abort()
    with pytest.raises(dfccl.AbortedError, match=r"^rank 0: all_reduce untagged #2 was aborted$"):
        untagged.synchronize(timeout=TIMEOUT)


def test_timeout_zero_returns_at_once(make):
    comms = make(2, "direct")
    w = comms[0].all_reduce(np.ones(4, np.float32), tag="t0")
    t0 = time.monotonic()
    with pytest.raises(dfccl.CollectiveTimeoutError):
        w.synchronize(timeout=0)
    assert time.monotonic() - t0 < 1.0
    comms[1].all_reduce(np.ones(4, np.float32), tag="t0").synchronize(timeout=TIMEOUT)
    w.synchronize(timeout=TIMEOUT)


# ==========================================================================================
# abort() and close()
# ==========================================================================================
@pytest.mark.parametrize("path", PATHS)
def test_abort_fails_pending_and_peer(make, path):
    comms = make(2, path)
    w0 = comms[0].all_reduce(np.ones(100, np.float32), tag="x")
    w0b = comms[0].broadcast(np.ones(100, np.float32), tag="y")
    comms[0].abort()
    for w in (w0, w0b):
        res = outcome(w)
        assert isinstance(res, dfccl.AbortedError), f"pending work of the aborted rank: {res!r}"
        assert res.code == ErrorCode.ABORTED and res.rank == 0
        assert w.exception() is res
    w1 = comms[1].all_reduce(np.ones(100, np.float32), tag="x")
    res = outcome(w1)
    assert isinstance(res, dfccl.PeerAbortedError), f"peer of the aborted rank: {res!r}"
    assert res.origin == 0 and res.rank == 1 and res.code == ErrorCode.PEER_ABORTED
    with pytest.raises(dfccl.ClosedError) as info:
        comms[0].all_reduce(np.ones(100, np.float32), tag="z")
    assert info.value.code == ErrorCode.CLOSED
    with pytest.raises(dfccl.ClosedError):
        comms[0].prepare_all_reduce(4, "float32")(np.ones(4, np.float32))
    comms[0].abort()  # idempotent
    assert not comms[0].closed


@pytest.mark.parametrize("path", PATHS)
def test_abort_after_completion_keeps_results(make, path):
    comms = make(2, path)
    xs = [np.full(50, r + 1, np.int64) for r in range(2)]
    ws = [c.all_reduce(x, tag="done") for c, x in zip(comms, xs)]
    for w in ws:
        w.synchronize(timeout=TIMEOUT)
    comms[0].abort()
    for w in ws:
        assert w.exception() is None
        w.synchronize(timeout=1)
    assert all(np.all(x == 3) for x in xs)


@pytest.mark.parametrize("path", PATHS)
def test_abort_racing_a_running_collective(make, path):
    """Both ranks submit, rank 0 aborts at once: each side either completes or
    fails with AbortedError / PeerAbortedError; nobody hangs, and a completed
    rank has the right data."""
    comms = make(2, path)
    count = 1 << 18
    xs = [np.full(count, r + 1, np.float32) for r in range(2)]
    ws = [c.all_reduce(x, tag="race") for c, x in zip(comms, xs)]
    comms[0].abort()
    res = [outcome(w, timeout=15) for w in ws]
    assert res[0] == "ok" or isinstance(res[0], dfccl.AbortedError), res
    assert res[1] == "ok" or isinstance(res[1], dfccl.PeerAbortedError), res
    for r in range(2):
        if res[r] == "ok":
            assert np.all(xs[r] == 3.0), f"rank {r} completed with wrong data"


@pytest.mark.parametrize("path", PATHS)
def test_close_is_idempotent_and_final(make, path):
    comms = make(2, path)
    all_reduce_ok(comms, tag="before-close")
    for c in comms:
        c.close()
        assert c.closed
        c.close()
        assert "closed" in repr(c)
    for kind in KINDS:
        s_n, r_n = _shapes(kind, 2, 4)
        with pytest.raises(dfccl.ClosedError):
            submit(comms[0], kind, np.ones(s_n, np.float32), np.ones(r_n, np.float32))
    comms[0].abort()  # no effect after close


def test_close_aborts_pending(make):
    comms = make(2, "direct")
    w = comms[0].all_reduce(np.ones(10, np.float32), tag="pending")
    comms[0].close(timeout=10)
    assert w.done()
    assert isinstance(w.exception(), dfccl.AbortedError), w.exception()
    with pytest.raises(dfccl.AbortedError):
        w.synchronize(timeout=1)
    w1 = comms[1].all_reduce(np.ones(10, np.float32), tag="pending")
    assert isinstance(outcome(w1), dfccl.PeerAbortedError)


def test_context_manager_closes():
    comms = dfccl.Communicator.for_devices([DEV + 90, DEV + 91], backend="sim")
    with comms[0] as c0, comms[1] as c1:
        all_reduce_ok([c0, c1], tag="cm")
    assert comms[0].closed and comms[1].closed



_CLOSE_SCRIPT = textwrap.dedent("""
    import os, threading, time
    import numpy as np
    import dfccl
    comms = dfccl.Communicator.for_devices([7000, 7001], backend="sim")
    gate, entered = threading.Event(), threading.Event()
    def hold(_work):          # keeps the progress thread busy: no callback runs meanwhile
        entered.set()
        gate.wait(30)
    ws = [c.all_reduce(np.ones(4, np.float32), tag="blocker") for c in comms]
    ws[0].add_done_callback(hold)
    for w in ws:
        w.synchronize(timeout=30)
    assert entered.wait(10)
    xs = [np.ones(4, np.float32) for _ in comms]
    ws = [c.all_reduce(x, tag="t") for c, x in zip(comms, xs)]
    while not (ws[0]._peek_done() and ws[1]._peek_done()):
        time.sleep(1e-4)      # the daemon completes both; nobody waits for them
    t = threading.Thread(target=comms[0].close, daemon=True)
    t.start()
    t.join(2)
    print("HUNG" if t.is_alive() else "CLOSED", flush=True)
    gate.set()
    os._exit(0)
""")


def test_close_with_completed_unretired_work():
    # In a child process: the deadlocked thread would hold the communicator's lock for good.
    # It imports the installed dfccl, whatever kind of install this is.
    proc = subprocess.run([sys.executable, "-c", _CLOSE_SCRIPT], capture_output=True, text=True, timeout=60)
    assert "CLOSED" in proc.stdout, f"close() did not return within 2 s: {proc.stdout!r} {proc.stderr[-2000:]!r}"


# ==========================================================================================
# Failed submissions must not shift the matching of later collectives
# ==========================================================================================


def test_failed_untagged_submission_keeps_sequence(make):
    comms = make(2, "direct")
    a = np.ones(200, np.float32)
    with pytest.raises(dfccl.InvalidArgumentError, match="overlap"):
        comms[0].all_reduce(a[:100], a[50:150])   # rejected: nothing submitted
    xs = [np.full(10, r + 1, np.float32) for r in range(2)]
    ws = [c.all_reduce(x) for c, x in zip(comms, xs)]
    for w in ws:
        w.synchronize(timeout=1)
    assert all(np.all(x == 3) for x in xs)




@pytest.mark.parametrize("failure", ("stream", "outstanding"))
def test_failed_tagged_submission_keeps_instance(make, failure):
    if failure == "stream":
        comms = make(2, "direct")
        with pytest.raises(dfccl.InvalidArgumentError, match="stream"):
            comms[0].all_reduce(np.ones(10, np.float32), tag="t", stream=1)   # the simulator has no streams
        pending = []
    else:
        dev = DEV + 110   # a daemon with 8 completion slots
        comms = dfccl.Communicator.for_devices([dev, dev + 1], backend="sim",
                                               daemon_options=dfccl.DaemonOptions(max_outstanding=8))
        pending = [comms[0].all_reduce(np.ones(4, np.float32), tag=i) for i in range(8)]
        try:
            with pytest.raises(dfccl.ResourceError, match="outstanding"):
                comms[0].all_reduce(np.ones(10, np.float32), tag="t")
            pending += [comms[1].all_reduce(np.ones(4, np.float32), tag=i) for i in range(8)]
            for w in pending:
                w.synchronize(timeout=TIMEOUT)
        except BaseException:
            sc.settle(comms)
            raise
    try:
        xs = [np.full(10, r + 1, np.float32) for r in range(2)]
        ws = [c.all_reduce(x, tag="t") for c, x in zip(comms, xs)]
        for w in ws:
            w.synchronize(timeout=1)
        assert all(np.all(x == 3) for x in xs)
    finally:
        if failure == "outstanding":
            sc.settle(comms)


# ==========================================================================================
# Resource limits
# ==========================================================================================
@pytest.mark.parametrize("path", PATHS)
def test_too_many_pending_tags(make, path):
    comms = make(2, path, max_tags=4)
    xs = [np.full(8, 1, np.int32) for _ in range(4)]
    ws = [comms[0].all_reduce(x, tag=i) for i, x in enumerate(xs)]
    with pytest.raises(dfccl.ResourceError) as info:
        comms[0].all_reduce(np.ones(8, np.int32), tag=99)
    assert info.value.code == ErrorCode.RESOURCE
    # A tag already bound reuses its record: a second instance is fine.
    ws.append(comms[0].all_reduce(np.full(8, 1, np.int32), tag=0))
    ys = [np.full(8, 2, np.int32) for _ in range(5)]
    ws += [comms[1].all_reduce(ys[i], tag=i) for i in range(4)] + [comms[1].all_reduce(ys[4], tag=0)]
    for w in ws:
        w.synchronize(timeout=TIMEOUT)
    assert all(np.all(x == 3) for x in xs + ys[:4])
    # Records were freed: five new tags in a row work.
    for t in range(5):
        all_reduce_ok(comms, tag=("fresh", t))


def test_too_many_outstanding_collectives():
    dev = DEV + 100
    comms = dfccl.Communicator.for_devices([dev, dev + 1], backend="sim",
                                           daemon_options=dfccl.DaemonOptions(max_outstanding=8))
    try:
        xs = [np.full(4, 1, np.int32) for _ in range(8)]
        ws = [comms[0].all_reduce(x, tag=i) for i, x in enumerate(xs)]
        with pytest.raises(dfccl.ResourceError, match="outstanding"):
            comms[0].all_reduce(np.ones(4, np.int32), tag="one-too-many")
        ys = [np.full(4, 2, np.int32) for _ in range(8)]
        ws += [comms[1].all_reduce(y, tag=i) for i, y in enumerate(ys)]
        for w in ws:
            w.synchronize(timeout=TIMEOUT)
        assert all(np.all(x == 3) for x in xs + ys)
        all_reduce_ok(comms, tag="after-outstanding")
    finally:
        sc.settle(comms)


def test_staging_beyond_the_shared_part_loops_through_a_reserved_fifo(make):
    """The third tag does not fit the shared staging: it takes a reserved
    minimum FIFO instead of raising ResourceError (design decision 40)."""
    comms = make(2, "ring", staging_bytes=1 << 20, ring_tags=2)
    pool = comms[0]._endpoint.staging
    # Each 256 Ki-element float32 all_reduce holds 2 channels x 4 slots x 48 KiB = 384 KiB of the 768 KiB shared.
    xs = [np.ones(1 << 18, np.float32) for _ in range(3)]
    ws = [comms[0].all_reduce(x, tag=("s", i)) for i, x in enumerate(xs)]
    third = comms[0]._endpoint.tags.staging_of(tag_key(comms[0]._comm_key, ("s", 2)))
    assert third[0] < pool.base + pool.blocks * pool.block_bytes and third[1] == pool.block_bytes
    ys = [np.ones(1 << 18, np.float32) for _ in range(3)]
    ws += [comms[1].all_reduce(y, tag=("s", i)) for i, y in enumerate(ys)]
    for w in ws:
        w.synchronize(timeout=TIMEOUT)
    assert all(np.all(v == 2.0) for v in xs + ys)


def test_staging_shared_by_a_tag_and_given_back_when_short(make):
    comms = make(2, "ring", staging_bytes=1 << 20, ring_tags=2)
    pool = comms[0]._endpoint.staging
    for it in range(5):   # 384 KiB each (of 768 KiB shared): a FIFO per instance would not fit thrice
        xs = [np.ones(1 << 18, np.float32) for _ in range(2)]
        ws = [c.all_reduce(x, tag="reuse") for c, x in zip(comms, xs)]
        for w in ws:
            w.synchronize(timeout=TIMEOUT)
        assert all(np.all(x == 2.0) for x in xs)
        assert pool.in_use == 3 << 17, f"iteration {it}: the idle tag keeps exactly one FIFO ({pool.in_use} bytes)"
    # Queued instances of one tag share the tag's FIFO: ten pending fit in 1 MiB.
    xs = [[np.full(1 << 18, r + 1, np.float32) for _ in range(10)] for r in range(2)]
    ws = [comms[r].all_reduce(x, tag="reuse") for r in range(2) for x in xs[r]]
    assert pool.in_use == 3 << 17
    for w in ws:
        w.synchronize(timeout=TIMEOUT)
    assert all(np.all(x == 3.0) for r in range(2) for x in xs[r])
    # Two other tags need the whole pool: the idle tag's FIFO is given back.
    ys = [[np.ones(1 << 18, np.float32) for _ in range(2)] for _ in range(2)]
    ws = [comms[r].all_reduce(ys[r][i], tag=("other", i)) for r in range(2) for i in range(2)]
    for w in ws:
        w.synchronize(timeout=TIMEOUT)
    assert all(np.all(y == 2.0) for yy in ys for y in yy)


def test_staging_beyond_the_shared_part_leaves_pool_consistent(make):
    comms = make(2, "ring", staging_bytes=1 << 20, ring_tags=2)
    pool = comms[0]._endpoint.staging
    xs = [np.ones(1 << 18, np.float32) for _ in range(4)]
    ws = [comms[0].all_reduce(x, tag=("s", i)) for i, x in enumerate(xs)]   # the last two in reserved FIFOs
    assert pool.free_blocks == pool.blocks - 2
    ws += [comms[1].all_reduce(np.ones(1 << 18, np.float32), tag=("s", i)) for i in range(4)]
    for w in ws:
        w.synchronize(timeout=TIMEOUT)
    rng = np.random.default_rng(7)
    try:
        for it in range(4):
            vals = [rng.standard_normal(1 << 17).astype(np.float32) for _ in range(2)]
            want = vals[0] + vals[1]
            ws = [c.all_reduce(v, tag=("after", it)) for c, v in zip(comms, vals)]
            for w in ws:
                w.synchronize(timeout=5)
            for r, v in enumerate(vals):
                np.testing.assert_allclose(v, want, rtol=1e-5, atol=1e-5, err_msg=f"after exhaustion, call {it} rank {r}")
    finally:
        assert pool.in_use >= 0 and min(pool._starts, default=pool.base) >= pool.base, \
            f"staging pool corrupted: in_use={pool.in_use}, free ranges start at {pool._starts} (base {pool.base})"


def test_staging_short_of_the_planned_fifo_hands_out_smaller_shared_ones(make):
    """Past the planned FIFOs, tags get halved shared FIFOs while the shared
    part has room (a deep queue of large messages loops through FIFOs of
    many slots, not all through minimum ones), then reserved blocks."""
    comms = make(2, "ring", staging_bytes=4 << 20, ring_tags=2)
    pool = comms[0]._endpoint.staging
    # The first, small message leaves a shared remainder that is not a
    # multiple of the planned 256 KiB FIFO of the others.
    xs = [np.full(1 << 12 if i == 0 else 1 << 18, 1.0 + i, np.float32) for i in range(20)]
    ws = [comms[0].all_reduce(x, tag=("h", i)) for i, x in enumerate(xs)]
    sizes = [comms[0]._endpoint.tags.staging_of(tag_key(comms[0]._comm_key, ("h", i)))[1] for i in range(20)]
    planned = sizes[1]
    smaller = [n for n in sizes[1:] if pool.block_bytes < n < planned]
    assert len(smaller) >= 2 and smaller == sorted(smaller, reverse=True), sizes
    assert all(planned % n == 0 for n in smaller), sizes
    assert sizes[-1] == pool.block_bytes, sizes
    ws += [comms[1].all_reduce(np.full_like(x, 2.0), tag=("h", i)) for i, x in enumerate(xs)]
    for w in ws:
        w.synchronize(timeout=TIMEOUT)
    for i, x in enumerate(xs):
        assert np.all(x == 3.0 + i), i


def test_recvs_beyond_the_shared_part_loop_through_reserved_fifos(make):
    """Receives queued on distinct tags past the shared staging take reserved
    minimum FIFOs (the sender cuts each message in the receiver's smaller
    slots) instead of raising ResourceError; sends posted afterwards, in the
    opposite order, deliver every message whole (design decision 40)."""
    comms = make(2, "ring", staging_bytes=1 << 20, ring_tags=2)
    pool = comms[1]._endpoint.staging
    rng = np.random.default_rng(11)
    sent = [rng.standard_normal((1 << 16) + 3 * i).astype(np.float32) for i in range(12)]
    got = [np.full_like(x, np.nan) for x in sent]
    ws = [comms[1].recv(g, 0, tag=("p", i)) for i, g in enumerate(got)]
    assert pool.free_blocks < pool.blocks, "the last receives loop through reserved FIFOs"
    ws += [comms[0].send(x, 1, tag=("p", i)) for i, x in reversed(list(enumerate(sent)))]
    for w in ws:
        w.synchronize(timeout=TIMEOUT)
    for i, (x, g) in enumerate(zip(sent, got)):
        np.testing.assert_array_equal(g, x, err_msg=f"message {i}")


# ==========================================================================================
# Work objects
# ==========================================================================================
STATS_KEYS = {"preemptions", "resumes", "queued_ns", "running_ns", "wall_ns", "host_ns", "channels"}


@pytest.mark.parametrize("path", PATHS)
def test_done_callback_before_completion(make, path):
    comms = make(2, path)
    calls, threads = [], []
    fired = threading.Event()

    def cb(work):
        calls.append(work)
        threads.append(threading.current_thread())
        fired.set()

    w0 = comms[0].all_reduce(np.ones(100, np.float32), tag="cb")
    w0.add_done_callback(cb)
    time.sleep(0.05)
    assert calls == [] and not w0.done(), "callback ran before the collective completed"
    w1 = comms[1].all_reduce(np.ones(100, np.float32), tag="cb")
    w1.synchronize(timeout=TIMEOUT)
    assert fired.wait(10), "callback never ran"
    time.sleep(0.05)
    assert calls == [w0], f"callback ran {len(calls)} times"
    assert threads[0] is not threading.main_thread(), "the callback must run on a background thread"
    w0.synchronize(timeout=1)
    time.sleep(0.02)
    assert len(calls) == 1, "synchronize() after completion ran the callback again"


def test_done_callback_after_completion_runs_at_once(make):
    comms = make(2, "direct")
    ws = [c.all_reduce(np.ones(8, np.float32), tag="cb2") for c in comms]
    for w in ws:
        w.synchronize(timeout=TIMEOUT)
    calls = []
    ws[0].add_done_callback(lambda w: calls.append((w, threading.current_thread())))
    assert calls == [(ws[0], threading.current_thread())]
    time.sleep(0.02)
    assert len(calls) == 1


def test_done_callbacks_order_failure_and_raising(make):
    comms = make(2, "direct")
    order = []
    done = threading.Event()
    w = comms[0].all_reduce(np.ones(8, np.float32), tag="cb3")
    w.add_done_callback(lambda wk: order.append("a"))

    def boom(wk):
        order.append("boom")
        raise RuntimeError("callback failure must not stop the others")

    w.add_done_callback(boom)
    w.add_done_callback(lambda wk: (order.append(("c", type(wk.exception()).__name__)), done.set()))
    with pytest.warns(RuntimeWarning, match="callback"):
        comms[0].abort()
        assert done.wait(10), "callbacks after a raising one did not run"
        time.sleep(0.02)
    assert order == ["a", "boom", ("c", "AbortedError")], order
    # The progress thread survived: callbacks of later works still run in the background.
    later = threading.Event()
    ws = [c.all_reduce(np.ones(8, np.float32), tag="cb4") for c in make(2, "ring")]
    ws[1].add_done_callback(lambda wk: later.set())
    ws[0].synchronize(timeout=TIMEOUT)
    assert later.wait(10)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", KINDS)
def test_work_stats_and_attributes(make, path, kind):
    n = 3
    comms = make(n, path)
    s_n, r_n = _shapes(kind, n, 5000)
    ws = []
    for r, c in enumerate(comms):
        ws.append(submit(c, kind, np.ones(s_n, np.float64), np.zeros(r_n, np.float64), tag=("stats", kind)))
    for r, w in enumerate(ws):
        w.synchronize(timeout=TIMEOUT)
        assert w.done() and w.exception() is None and w.status == 0
        st = w.stats
        assert set(st) >= STATS_KEYS, st
        assert all(isinstance(v, int) and v >= 0 for v in st.values()), st
        assert 1 <= st["channels"] <= comms[r].channels
        assert st["resumes"] <= st["preemptions"]
        assert st["host_ns"] > 0
        assert w.kind == kind and w.rank == r and w.tag == ("stats", kind) and w.instance == 1
        assert "done" in repr(w) and kind in repr(w)
        st["channels"] = -1
        assert w.stats["channels"] >= 1, "stats must return a copy"


def test_exceptions_carry_code_and_rank(make):
    codes = {dfccl.InvalidArgumentError: ErrorCode.INVALID_ARGUMENT, dfccl.MismatchError: ErrorCode.MISMATCH,
             dfccl.PeerAbortedError: ErrorCode.PEER_ABORTED, dfccl.AbortedError: ErrorCode.ABORTED,
             dfccl.CollectiveTimeoutError: ErrorCode.TIMEOUT, dfccl.ResourceError: ErrorCode.RESOURCE,
             dfccl.BackendError: ErrorCode.BACKEND, dfccl.ClosedError: ErrorCode.CLOSED}
    for cls, code in codes.items():
        assert issubclass(cls, dfccl.DfcclError) and issubclass(cls, RuntimeError)
        assert cls.code == code
        e = cls("msg") if cls is not dfccl.BackendError else cls("msg", driver_code=3)
        assert e.code == code and str(e) == "msg"
    assert issubclass(dfccl.InvalidArgumentError, ValueError)
    assert issubclass(dfccl.CollectiveTimeoutError, TimeoutError)
    e = dfccl.MismatchError("m", rank=2, tag="t", peer=1)
    assert (e.rank, e.tag, e.peer) == (2, "t", 1)
    e = dfccl.PeerAbortedError("m", rank=1, tag=(1,), origin=0)
    assert (e.rank, e.tag, e.origin) == (1, (1,), 0)




def test_closed_error_carries_rank(make):
    comms = make(2, "direct")
    comms[1].close()
    with pytest.raises(dfccl.ClosedError) as info:
        comms[1].all_reduce(np.ones(4, np.float32))
    assert "rank 1" in str(info.value)
    assert info.value.rank == 1




@pytest.mark.parametrize("case", ("non-contiguous", "complex64", "not-an-array", "bad-op"))
def test_argument_errors_carry_rank(pair, case):
    c = pair[1]
    with pytest.raises(dfccl.InvalidArgumentError) as info:
        if case == "non-contiguous":
            c.all_reduce(np.ones(8, np.float32)[::2])
        elif case == "complex64":
            c.all_reduce(np.ones(4, np.complex64))
        elif case == "not-an-array":
            c.all_reduce([1.0, 2.0])
        else:
            c.all_reduce(np.ones(4, np.float32), op="median")
    assert info.value.code == ErrorCode.INVALID_ARGUMENT
    assert info.value.rank == 1




def test_timeout_does_not_name_a_stale_rank():
    comms = dfccl.Communicator.for_devices([DEV + 120, DEV + 121, DEV + 122], backend="sim",
                                           options=dfccl.CommOptions(path="direct"))
    try:
        # 1. rank 0's collective waits (and is preempted) for rank 2, then completes.
        ws = [comms[0].all_reduce(np.ones(8, np.float32), tag="a"), comms[1].all_reduce(np.ones(8, np.float32), tag="a")]
        with pytest.raises(dfccl.CollectiveTimeoutError) as first:
            ws[0].synchronize(timeout=0.3)
        assert first.value.waiting_on == 2
        ws.append(comms[2].all_reduce(np.ones(8, np.float32), tag="a"))
        for w in ws:
            w.synchronize(timeout=TIMEOUT)
        # 2. Rank 2 has joined "b", rank 1 has not: whatever the timeout says, it must not blame rank 2.
        wb = [comms[2].all_reduce(np.ones(8, np.float32), tag="b"), comms[0].all_reduce(np.ones(8, np.float32), tag="b")]
        with pytest.raises(dfccl.CollectiveTimeoutError) as info:
            wb[1].synchronize(timeout=0)
        wb.append(comms[1].all_reduce(np.ones(8, np.float32), tag="b"))
        for w in wb:
            w.synchronize(timeout=TIMEOUT)
        assert info.value.waiting_on in (None, 1), f"names rank {info.value.waiting_on}: {info.value}"
    finally:
        sc.settle(comms)


def test_threads_driving_communicators_that_share_devices():
    """Two communicators on the same two devices share each device's
    daemon (its submission ring and completion slots); a thread drives
    each, submitting and waiting as fast as it can.  Submissions from the
    two threads must not interleave inside the ring, and a thread waiting
    for a collective must see it complete although the other thread
    retired it and reused its slot (a wait that looked for the slot's
    generation alone missed it and hung)."""
    devs = [DEV + 130, DEV + 131]
    pairs = {"a": dfccl.Communicator.for_devices(devs, backend="sim"),
             "b": dfccl.Communicator.for_devices(devs, backend="sim")}
    assert pairs["a"][0]._daemon is pairs["b"][0]._daemon
    errors, rounds = [], 2000

    def drive(name):
        comms = pairs[name]
        try:
            for i in range(rounds):
                xs = [np.full(8, r + 1 + i, np.float32) for r in range(2)]
                works = [comms[r].all_reduce(xs[r]) for r in range(2)]
                for w in works:
                    w.synchronize(timeout=TIMEOUT)
                if not all((x == 2 * i + 3).all() for x in xs):
                    errors.append(f"{name}, round {i}: {xs[0][0]}, {xs[1][0]}, not {2 * i + 3}")
                    return
        except Exception as exc:  # reported below, with the thread's name
            errors.append(f"{name}: {type(exc).__name__}: {exc}")

    try:
        sc.run_concurrently([lambda n=name: drive(n) for name in pairs], timeout=4 * TIMEOUT)
    finally:
        for comms in pairs.values():
            for c in comms:
                c.close()
    assert not errors, errors


# -- plain calls: one descriptor per shape ----------------------------------------------------
def test_plain_calls_reuse_one_descriptor_per_shape_on_other_buffers(make):
    """An untagged call builds its shape's descriptor once; later calls of
    that shape submit it at their own buffers (fresh arrays every time, out
    of place and in place, every reduction), and the kept descriptor holds
    no reference to the buffers it was built from."""
    rng = np.random.default_rng(7)
    comms = make(2, "direct", base=DEV + 140)
    for it in range(12):
        op = ("sum", "max", "min")[it % 3]
        xs = [rng.standard_normal(257).astype(np.float32) for _ in comms]
        outs = [np.full(257, np.nan, np.float32) for _ in comms] if it % 2 else [None, None]
        want = {"sum": xs[0] + xs[1], "max": np.maximum(xs[0], xs[1]), "min": np.minimum(xs[0], xs[1])}[op]
        ws = [c.all_reduce(x, o, op=op) for c, x, o in zip(comms, xs, outs)]
        for w in ws:
            w.synchronize(timeout=TIMEOUT)
        for r in range(2):
            got = outs[r] if it % 2 else xs[r]
            np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=f"call {it} rank {r} {op}")
    for c in comms:
        tasks = list(c._submitter._plain_tasks.values())
        assert len(tasks) == 3            # one per reduction: the size and dtype never changed
        assert all(t.owners is None for t in tasks)
    # A tagged call keeps its own descriptor: the untagged ones are not touched.
    all_reduce_ok(comms, tag="plain-vs-tagged")
    assert all(len(c._submitter._plain_tasks) == 4 for c in comms)
    assert all(sum(t.tag == "plain-vs-tagged" for t in c._submitter._plain_tasks.values()) == 1 for c in comms)


def test_tagged_calls_reuse_one_descriptor_per_shape_and_tag(make):
    """str and int tags, and tuples of them, keep a descriptor per (shape,
    tag): later calls of a tag submit it at their own buffers and still take
    the tag's next instance, so two tags issued in opposite orders on the
    two ranks still meet (the deadlock-freedom guarantee), every round.  A
    tuple holding anything else is still checked (a bool is no tag, though
    it equals an int)."""
    rng = np.random.default_rng(13)
    comms = make(2, "direct", base=DEV + 146)
    tags = ("grad", 7)
    for it in range(6):
        xs = {t: [rng.standard_normal(64).astype(np.float32) for _ in comms] for t in tags}
        wants = {t: xs[t][0] + xs[t][1] for t in tags}
        order = [tags, tags[::-1]]  # rank 1 submits the tags in the other order
        works = [[c.all_reduce(xs[t][r], tag=t) for t in order[r]] for r, c in enumerate(comms)]
        for ws in works:
            for w in ws:
                w.synchronize(timeout=TIMEOUT)
        for t in tags:
            for r in range(2):
                np.testing.assert_allclose(xs[t][r], wants[t], rtol=1e-6, err_msg=f"round {it} tag {t!r} rank {r}")
        assert [w.tag for w in works[0]] == list(tags)
    for c in comms:
        kept = [t for t in c._submitter._plain_tasks.values() if t.tag is not None]
        assert sorted(map(str, (t.tag for t in kept))) == ["7", "grad"]
        assert all(t.owners is None for t in kept)
    all_reduce_ok(comms, tag=("layer", 3))
    all_reduce_ok(comms, tag=("layer", 3))
    all_reduce_ok(comms, tag=("layer", 3, ("sub", 1)))
    with pytest.raises(dfccl.InvalidArgumentError, match="not a bool"):
        comms[0].all_reduce(np.ones(64, np.float32), tag=("layer", True))
    for c in comms:
        tuples = sorted(map(repr, (t.tag for t in c._submitter._plain_tasks.values() if isinstance(t.tag, tuple))))
        assert tuples == ["('layer', 3)", "('layer', 3, ('sub', 1))"], tuples


def test_plain_call_descriptors_are_bounded(make, monkeypatch):
    import dfccl.submission as ds

    monkeypatch.setattr(ds, "_PLAIN_TASKS_KEPT", 8)
    comms = make(2, "direct", base=DEV + 142)
    for count in range(1, 20):
        all_reduce_ok(comms, count=count)
        assert all(len(c._submitter._plain_tasks) <= 8 for c in comms)


def test_all_reduce_at_a_pointer_matches_the_array_call(make):
    """The raw in-place path the torch backend takes (Communicator._all_reduce_at):
    same result as the array call, its first call (no descriptor yet) too,
    zero elements complete at once, and a closed communicator says so."""
    rng = np.random.default_rng(11)
    comms = make(2, "direct", base=DEV + 144)
    f32 = dfccl.DataType.FLOAT32
    for it in range(4):
        xs = [rng.standard_normal(100).astype(np.float32) for _ in comms]
        want = xs[0] + xs[1]
        ws = [c._all_reduce_at(x.ctypes.data, x.size, f32, dfccl.ReduceOp.SUM, None, x) for c, x in zip(comms, xs)]
        for w in ws:
            w.synchronize(timeout=TIMEOUT)
        for x in xs:
            np.testing.assert_allclose(x, want, rtol=1e-6)
    assert comms[0]._all_reduce_at(0, 0, f32, dfccl.ReduceOp.SUM, None, None).done()
    c = comms[0]
    for other in comms:
        other.close()
    with pytest.raises(dfccl.ClosedError, match="closed"):
        c._all_reduce_at(xs[0].ctypes.data, 100, f32, dfccl.ReduceOp.SUM, None, xs[0])


def test_plain_in_place_sum_skips_the_buffer_and_nothing_else(make, monkeypatch):
    """The in-place sum of a plain array whose shape has a kept descriptor is
    submitted without a Buffer (Submitter.all_reduce_kept); whatever
    differs from that case takes the general path and gets its answer: a
    read-only array, a strided view, another dtype, a tuple tag, a closed
    communicator."""
    import dfccl.submission as ds

    taken = []
    kept = ds.Submitter.all_reduce_kept
    monkeypatch.setattr(ds.Submitter, "all_reduce_kept",
                        lambda self, *a: taken.append(kept(self, *a)) or taken[-1])
    comms = make(2, "direct", base=DEV + 148)
    for shape in [(64,), (64,), (8, 8), (64,)]:
        taken.clear()
        xs = [np.full(shape, r + 1.0, np.float32) for r in range(2)]
        ws = [c.all_reduce(x) for c, x in zip(comms, xs)]
        for w in ws:
            w.synchronize(timeout=TIMEOUT)
        assert all(np.all(x == 3.0) for x in xs)
    assert all(isinstance(w, dfccl.Work) for w in taken), "the kept descriptor served the later calls"
    c = comms[0]
    ro = np.zeros(64, np.float32)
    ro.setflags(write=False)
    with pytest.raises(dfccl.InvalidArgumentError, match="read-only"):
        c.all_reduce(ro)
    with pytest.raises(dfccl.InvalidArgumentError, match="not C-contiguous"):
        c.all_reduce(np.zeros(128, np.float32)[::2])
    assert taken[-2:] == [None, None]
    all_reduce_ok(comms, count=64)   # int64: its own descriptor, built by the general path
    all_reduce_ok(comms, tag=("tuple",), count=64)
    assert taken[-4:] == [None, None, None, None]
    for other in comms:
        other.close()
    with pytest.raises(dfccl.ClosedError, match="closed"):
        c.all_reduce(np.zeros(64, np.float32))
    assert taken[-1] is None
