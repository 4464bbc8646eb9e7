"""Collectives captured in (simulated) CUDA graphs: SimStream.begin_capture()
/ end_capture() record what dfccl issues on a stream into a SimGraph whose
launch() replays it, as cuStreamBeginCapture / cuGraphLaunch do.  A captured
collective is bound once and every replay runs its tag's next instance
(docs/architecture.md, "CUDA graphs"): replays in divergent orders across
ranks complete, many replays stay bit-identical to eager collectives, a
failed replay is raised by the next dfccl call, and destroying the graph
gives back what the capture held."""

from __future__ import annotations

import time

import numpy as np
import pytest

import dfccl
from dfccl import runtime
from dfccl_support import scenarios as sc

DEV = 4800          # device ids of this module: 4800..4899
TIMEOUT = 30.0


_setup = sc.sim_ranks_with_streams


def _close(comms, streams, graphs=()):
    for g in graphs:
        g.close()
    for s in streams:
        s.synchronize(timeout=TIMEOUT)   # the graphs' releases run after their launches
        s.close()
    for c in comms:
        c._daemon._reap_graphs()
    sc.settle(comms)


def _capture(stream, body):
    """Captures ``body()`` (a Work or a list of them) on ``stream`` and, as
    a stream-ordered eager collective is waited for, the stream's wait for
    each: what follows in the graph waits for the collectives."""
    stream.begin_capture()
    try:
        works = body()
        for w in works if isinstance(works, list) else [works]:
            w.wait(stream)
    finally:
        graph = stream.end_capture()
    return graph, works


def test_a_captured_collective_runs_at_each_replay_and_not_at_capture():
    comms, streams = _setup(DEV)
    graphs = []
    try:
        xs = [np.zeros(64, np.float32) for _ in range(2)]
        for r in range(2):
            g, w = _capture(streams[r], lambda r=r: comms[r].all_reduce(xs[r], tag="grad", stream=streams[r]))
            assert w.captured and w.stream_ordered
            graphs.append(g)
        assert all((x == 0).all() for x in xs)            # nothing ran at capture
        for k in range(1, 21):
            for r in range(2):
                xs[r][:] = (r + 1) * k
            for r in range(2):
                graphs[r].launch(streams[r])
            for s in streams:
                assert s.synchronize(timeout=TIMEOUT)
            assert all((x == 3 * k).all() for x in xs), k
    finally:
        _close(comms, streams, graphs)


def test_replays_in_divergent_orders_across_ranks_complete():
    """Rank 0's graph arms A then B, rank 1's B then A, and each waits for
    both at its end: rank 0's A waits for rank 1's A, armed after rank 1's
    B, which waits for rank 0's B; the daemons run them in any order."""
    comms, streams = _setup(DEV + 2)
    graphs = []
    try:
        a = [np.zeros(1000, np.float32) for _ in range(2)]
        b = [np.zeros(3000, np.float64) for _ in range(2)]
        order = [("A", "B"), ("B", "A")]
        for r in range(2):
            def body(r=r):
                out = []
                for name in order[r]:
                    buf = a[r] if name == "A" else b[r]
                    out.append(comms[r].all_reduce(buf, tag=name, stream=streams[r]))
                return out
            graphs.append(_capture(streams[r], body)[0])
        for k in range(1, 31):
            for r in range(2):
                a[r][:] = np.arange(1000, dtype=np.float32) * (r + k)
                b[r][:] = np.arange(3000, dtype=np.float64) + r * k
            for r in range(2):
                graphs[r].launch(streams[r])
            for s in streams:
                assert s.synchronize(timeout=TIMEOUT), f"replay {k} did not complete"
            want_a = np.arange(1000, dtype=np.float32) * (1 + 2 * k)
            want_b = 2 * np.arange(3000, dtype=np.float64) + k
            for r in range(2):
                assert np.array_equal(a[r], want_a) and np.array_equal(b[r], want_b), (k, r)
    finally:
        _close(comms, streams, graphs)


def test_replays_are_bit_identical_to_eager_collectives():
    comms, streams = _setup(DEV + 4, n=3)
    graphs = []
    rng = np.random.default_rng(44)
    try:
        bufs = [np.zeros(4099, np.float32) for _ in range(3)]
        for r in range(3):
            graphs.append(_capture(streams[r],
                                   lambda r=r: comms[r].all_reduce(bufs[r], stream=streams[r]))[0])
        for k in range(12):
            inputs = [rng.standard_normal(4099).astype(np.float32) for _ in range(3)]
            eager = [x.copy() for x in inputs]
            for w in [comms[r].all_reduce(eager[r], tag="eager") for r in range(3)]:
                w.synchronize(timeout=TIMEOUT)
            for r in range(3):
                bufs[r][:] = inputs[r]
            for r in (2, 0, 1):
                graphs[r].launch(streams[r])
            for s in streams:
                assert s.synchronize(timeout=TIMEOUT)
            for r in range(3):
                assert bufs[r].tobytes() == eager[0].tobytes(), (k, r)
    finally:
        _close(comms, streams, graphs)


def test_a_tag_used_eagerly_and_in_a_graph_keeps_both_sequences():
    """A captured collective runs on a tag of its own (the tag's n-th
    capture), so eager uses of the same tag between replays pair as before."""
    comms, streams = _setup(DEV + 6)
    graphs = []
    try:
        xs = [np.zeros(16, np.int32) for _ in range(2)]
        for r in range(2):
            graphs.append(_capture(streams[r], lambda r=r: comms[r].all_reduce(xs[r], tag="t", stream=streams[r]))[0])
        for k in range(5):
            ys = [np.full(16, 10 + r, np.int32) for r in range(2)]
            ws = [comms[r].all_reduce(ys[r], tag="t") for r in range(2)]
            for r in range(2):
                xs[r][:] = r + 1
                graphs[r].launch(streams[r])
            for w in ws:
                w.synchronize(timeout=TIMEOUT)
            for s in streams:
                assert s.synchronize(timeout=TIMEOUT)
            assert all((y == 21).all() for y in ys) and all((x == 3).all() for x in xs)
    finally:
        _close(comms, streams, graphs)


def test_a_captured_work_refuses_host_waits():
    comms, streams = _setup(DEV + 8)
    graphs = []
    try:
        x = np.zeros(8, np.float32)
        g, w = _capture(streams[0], lambda: comms[0].all_reduce(x, tag="t", stream=streams[0]))
        graphs.append(g)
        with pytest.raises(dfccl.NotSupportedError, match="captured in a CUDA graph"):
            w.synchronize()
        with pytest.raises(dfccl.NotSupportedError):
            w.done()
    finally:
        _close(comms, streams, graphs)


@pytest.mark.parametrize("shared", [False, True], ids=["a_daemon_each", "one_daemon"])
def test_a_failed_replay_is_raised_by_the_next_call(shared):
    """Rank 1 captures a collective of another size under the same tag: the
    replay fails on both ranks (MismatchError) without holding the stream,
    the rank's status shows it, and each rank's next collective raises it
    (once: the one after runs); with both ranks on one device (one daemon),
    each rank's call raises its own failure."""
    if shared:
        comms = dfccl.Communicator.for_devices([DEV + 38, DEV + 38], backend="sim")
        streams = [runtime.get_device("sim", DEV + 38).create_stream() for _ in range(2)]
    else:
        comms, streams = _setup(DEV + 10)
    graphs = []
    try:
        xs = [np.ones(64, np.float32), np.ones(32, np.float32)]
        for r in range(2):
            graphs.append(_capture(streams[r], lambda r=r: comms[r].all_reduce(xs[r], tag="m", stream=streams[r]))[0])
        for r in range(2):
            graphs[r].launch(streams[r])
        for s in streams:
            assert s.synchronize(timeout=TIMEOUT)        # a failed replay releases its stream
        for r in range(2):
            shown = str(comms[r].status())               # what `dfccl status` prints
            assert "1 with a failed replay" in shown and "replay 1 of a captured collective failed" in shown
            with pytest.raises(dfccl.MismatchError, match="replay 1 of a captured collective failed"):
                comms[r].all_reduce(np.ones(4, np.float32), tag="after")
            failed = [n for n in comms[r]._daemon.captured if n["error"] and n["rank"] == r]
            assert len(failed) == 1 and "replay 1" in failed[0]["error"]
        ws = [comms[r].all_reduce(np.ones(4, np.float32), tag="after") for r in range(2)]
        for w in ws:
            w.synchronize(timeout=TIMEOUT)
    finally:
        _close(comms, streams, graphs)


def test_destroying_the_graph_gives_back_its_slot_and_tag():
    comms, streams = _setup(DEV + 12)
    graphs = []
    try:
        daemon = comms[0]._daemon
        free_before = daemon.free_slots
        x = np.zeros(8, np.float32)
        g, _ = _capture(streams[0], lambda: comms[0].all_reduce(x, tag="t", stream=streams[0]))
        assert daemon.free_slots == free_before - 1 and len(daemon.captured) == 1
        g.close()                                     # never launched: released at once
        assert daemon.captured == [] and daemon.free_slots == free_before
        ys = [np.ones(8, np.float32) for _ in range(2)]
        for r in range(2):
            # Tag "u": rank 0's next capture of "t" is its second, rank 1's its first.
            graphs.append(_capture(streams[r], lambda r=r: comms[r].all_reduce(ys[r], tag="u", stream=streams[r]))[0])
        for r in range(2):
            graphs[r].launch(streams[r])
            graphs[r].close()                         # released once its launch has run
        for s in streams:
            assert s.synchronize(timeout=TIMEOUT)
        assert all((y == 2).all() for y in ys)
        assert daemon.captured == [] and daemon.free_slots == free_before
    finally:
        _close(comms, streams, graphs)


def test_many_replays_back_to_back():
    """Replays queued back to back without waiting on the host in between
    (the stream orders them: each replay's arm node runs after the previous
    replay's wait)."""
    comms, streams = _setup(DEV + 14)
    graphs = []
    try:
        xs = [np.ones(4, np.float64) for _ in range(2)]
        for r in range(2):
            graphs.append(_capture(streams[r], lambda r=r: comms[r].all_reduce(xs[r], stream=streams[r]))[0])
        n = 200
        for r in range(2):
            for _ in range(n):
                graphs[r].launch(streams[r])
        for s in streams:
            assert s.synchronize(timeout=60.0)
        assert all((x == 2.0 ** n).all() for x in xs)
    finally:
        _close(comms, streams, graphs)


# -- all-to-all --------------------------------------------------------------------------------
def _a2a_expected(sends, counts):
    """What each rank receives: rank p's recv is every rank r's part p, in
    rank order (counts[r][p] elements sent from r to p)."""
    n = len(sends)
    offsets = [np.concatenate([[0], np.cumsum(c)[:-1]]).astype(int) for c in counts]
    return [np.concatenate([sends[r][offsets[r][p]:offsets[r][p] + counts[r][p]] for r in range(n)])
            for p in range(n)]


@pytest.mark.parametrize("path", ["auto", "ring"])   # ring: peers read a staged copy of the send buffer
def test_all_to_all_replays_with_the_counts_fixed_at_capture(path):
    """An uneven all_to_all_single (zeros included) and an equal all_to_all,
    captured in different orders on the ranks next to an all-reduce: every
    replay is a new instance that moves the replay's fresh inputs with the
    split table bound at capture, exactly."""
    n = 3
    comms = dfccl.Communicator.for_devices(list(range(DEV + 20 + 3 * (path == "ring"), DEV + 23 + 3 * (path == "ring"))),
                                           backend="sim", options=dfccl.CommOptions(path=path))
    streams = [runtime.get_device("sim", c.device).create_stream() for c in comms]
    graphs = []
    rng = np.random.default_rng(47)
    try:
        counts = [[3, 0, 1000], [7, 2, 0], [0, 513, 9]]          # counts[r][p]: r sends p
        recv_counts = [[counts[r][p] for r in range(n)] for p in range(n)]
        sends = [np.zeros(sum(counts[r]), np.float32) for r in range(n)]
        recvs = [np.zeros(sum(recv_counts[p]), np.float32) for p in range(n)]
        eq_send = [np.zeros(n * 40, np.int64) for _ in range(n)]
        eq_recv = [np.zeros(n * 40, np.int64) for _ in range(n)]
        xs = [np.zeros(100, np.float64) for _ in range(n)]
        for r in range(n):
            issue = [lambda r=r: comms[r].all_to_all_single(sends[r], recvs[r], send_splits=counts[r],
                                                            recv_splits=recv_counts[r], tag="uneven",
                                                            stream=streams[r]),
                     lambda r=r: comms[r].all_to_all(eq_send[r], eq_recv[r], tag="equal", stream=streams[r]),
                     lambda r=r: comms[r].all_reduce(xs[r], tag="sum", stream=streams[r])]
            order = [0, 1, 2] if r == 0 else [2, 1, 0] if r == 1 else [1, 2, 0]
            g, works = _capture(streams[r], lambda issue=issue, order=order: [issue[i]() for i in order])
            assert all(w.captured for w in works)
            graphs.append(g)
        assert all((x == 0).all() for x in recvs + eq_recv)      # nothing ran at capture
        for k in range(1, 16):
            for r in range(n):
                sends[r][:] = rng.standard_normal(sends[r].size).astype(np.float32)
                eq_send[r][:] = np.arange(n * 40) + 1000 * r + 100_000 * k
                xs[r][:] = k * (r + 1)
            for r in (2, 0, 1):
                graphs[r].launch(streams[r])
            for s in streams:
                assert s.synchronize(timeout=TIMEOUT), f"replay {k} did not complete"
            want = _a2a_expected(sends, counts)
            want_eq = _a2a_expected(eq_send, [[40] * n] * n)
            for p in range(n):
                assert recvs[p].tobytes() == want[p].tobytes(), (k, p)
                assert np.array_equal(eq_recv[p], want_eq[p]), (k, p)
                assert (xs[p] == 6 * k).all(), (k, p)
    finally:
        _close(comms, streams, graphs)


def test_a_captured_all_to_all_pairs_with_eager_ones_of_its_tag():
    """Eager all-to-alls of the captured tag between replays keep their own
    sequence (each with the counts of its own call), while the replays keep
    the captured counts."""
    comms, streams = _setup(DEV + 30)
    graphs = []
    try:
        counts = [[2, 5], [1, 4]]
        recv_counts = [[2, 1], [5, 4]]
        sends = [np.arange(sum(counts[r]), dtype=np.int32) + 10 * r for r in range(2)]
        recvs = [np.zeros(sum(recv_counts[r]), np.int32) for r in range(2)]
        for r in range(2):
            graphs.append(_capture(streams[r], lambda r=r: comms[r].all_to_all_single(
                sends[r], recvs[r], send_splits=counts[r], recv_splits=recv_counts[r], tag="t",
                stream=streams[r]))[0])
        for k in range(1, 6):
            es = [np.full(4, 100 * k + r, np.int32) for r in range(2)]
            er = [np.zeros(4, np.int32) for _ in range(2)]
            ws = [comms[r].all_to_all(es[r], er[r], tag="t") for r in range(2)]
            for r in range(2):
                sends[r][:] = np.arange(sends[r].size) + 10 * r + 1000 * k
                graphs[r].launch(streams[r])
            for w in ws:
                w.synchronize(timeout=TIMEOUT)
            for s in streams:
                assert s.synchronize(timeout=TIMEOUT)
            want = _a2a_expected(sends, counts)
            assert all(np.array_equal(recvs[p], want[p]) for p in range(2)), k
            assert all(np.array_equal(er[p], np.array([100 * k] * 2 + [100 * k + 1] * 2)) for p in range(2)), k
    finally:
        _close(comms, streams, graphs)


def test_destroying_the_graph_gives_back_the_split_table():
    """The split table (and staged send copy) a captured all-to-all holds in
    the arena is given back with its graph, launched or not."""
    comms, streams = _setup(DEV + 32)
    graphs = []
    try:
        pools = [c._endpoint.staging for c in comms]
        before = [p.in_use for p in pools]
        sends = [np.arange(64, dtype=np.float32) + r for r in range(2)]
        recvs = [np.zeros(64, np.float32) for _ in range(2)]
        g, _ = _capture(streams[0], lambda: comms[0].all_to_all(sends[0], recvs[0], tag="once", stream=streams[0]))
        assert pools[0].in_use > before[0], "the capture holds the table"
        g.close()                                     # never launched: released at once
        assert comms[0]._daemon.captured == [] and pools[0].in_use == before[0]
        for r in range(2):
            graphs.append(_capture(streams[r], lambda r=r: comms[r].all_to_all(sends[r], recvs[r], tag="twice",
                                                                               stream=streams[r]))[0])
        for _ in range(2):
            for r in range(2):
                graphs[r].launch(streams[r])
        for r in range(2):
            graphs[r].close()                         # released once its launches have run
        graphs = []
        for s in streams:
            assert s.synchronize(timeout=TIMEOUT)
        assert np.array_equal(recvs[0], np.concatenate([sends[0][:32], sends[1][:32]]))
        for c, p, b in zip(comms, pools, before):
            c._daemon._reap_graphs()
            assert c._daemon.captured == [] and p.in_use == b
    finally:
        _close(comms, streams, graphs)


# -- barrier -----------------------------------------------------------------------------------
def test_barrier_completes_only_when_every_rank_reached_it():
    comms, streams = _setup(DEV + 34)
    try:
        w0 = comms[0].barrier(tag="b")
        time.sleep(0.2)
        assert not w0.done(), "rank 0's barrier passed before rank 1 reached it"
        w1 = comms[1].barrier(tag="b")
        for w in (w0, w1):
            w.synchronize(timeout=TIMEOUT)
    finally:
        _close(comms, streams)


def test_a_captured_barrier_holds_each_replay_until_every_rank_reaches_it():
    """Rank 0's graph is a barrier, then a write of a flag; rank 1's graph
    waits for a gate the host opens, then its barrier.  At every replay
    rank 0's stream stops at the barrier until the gate opens."""
    comms, streams = _setup(DEV + 36)
    graphs = []
    try:
        words = np.zeros(2, np.uint32)                 # [flag, gate], "device memory" of the simulator
        flag, gate = words.ctypes.data, words.ctypes.data + 4

        def rank0():
            w = comms[0].barrier(stream=streams[0])
            w.wait(streams[0])
            streams[0].write32(flag, 1)
            return w

        def rank1():
            streams[1].wait32(gate, 1)
            w = comms[1].barrier(stream=streams[1])
            w.wait(streams[1])
            return w

        for r, body in enumerate((rank0, rank1)):
            streams[r].begin_capture()
            try:
                assert body().captured
            finally:
                graphs.append(streams[r].end_capture())
        for k in range(1, 6):
            words[:] = 0
            for r in range(2):
                graphs[r].launch(streams[r])
            assert not streams[0].synchronize(timeout=0.2), f"replay {k}: rank 0 passed the barrier alone"
            assert words[0] == 0
            words[1] = 1                               # rank 1 reaches its barrier
            for s in streams:
                assert s.synchronize(timeout=TIMEOUT), f"replay {k} did not complete"
            assert words[0] == 1
    finally:
        _close(comms, streams, graphs)
