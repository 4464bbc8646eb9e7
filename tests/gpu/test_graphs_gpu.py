"""Collectives of dfccl's own API captured in CUDA graphs
(cuStreamBeginCapture / EndCapture / GraphInstantiate / GraphLaunch through
cuda-python) on one GPU: two ranks of one process share it
(Communicator.for_devices([0, 0])), each with its stream and its graph.
Replays in divergent orders across the ranks, many replays bit-identical to
eager collectives, a failed replay raised by the next call, the graph's
destruction giving back what the capture held, all-to-all with its counts
fixed at capture, a captured barrier, and submissions through the C API
(docs/architecture.md, "CUDA graphs")."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

import dfccl
from dfccl.bench import arrays
from dfccl_support.cuda_graphs import Stream, capture, close_all

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]

TIMEOUT = 30.0


@pytest.fixture()
def pair():
    """Two ranks on GPU 0, a stream each."""
    comms = dfccl.Communicator.for_devices([0, 0], backend="cuda")
    streams = [Stream(), Stream()]
    graphs: list = []
    yield comms, streams, graphs
    close_all(graphs, streams, comms)


def _capture_ranks(comms, streams, graphs, issue):
    """Captures ``issue(rank, stream_handle)`` (a list of Works) on each
    rank's stream, then the stream's wait for each of them."""
    for r in range(2):
        def body(r=r):
            works = issue(r, streams[r].handle)
            for w in works:
                w.wait(streams[r].handle)
            return works
        g, works = capture(streams[r], body)
        assert all(w.captured for w in works)
        graphs.append(g)


def test_replays_in_divergent_orders_across_ranks(pair):
    comms, streams, graphs = pair
    a = [arrays.empty("cuda", 0, 1000, np.float32) for _ in range(2)]
    b = [arrays.empty("cuda", 0, 300_000, np.float32) for _ in range(2)]   # above one-shot: two phases
    order = ["ab", "ba"]
    _capture_ranks(comms, streams, graphs, lambda r, s: [
        comms[r].all_reduce(a[r] if n == "a" else b[r], tag=n, stream=s) for n in order[r]])
    for k in range(1, 101):
        for r in range(2):
            a[r].upload(np.full(1000, r + k, np.float32))
            b[r].upload(np.arange(300_000, dtype=np.float32) * (r + 1) + k)
        for r in range(2):
            graphs[r].launch(streams[r])
        for s in streams:
            s.synchronize()
        for r in range(2):
            assert (a[r].download() == 2 * k + 1).all(), (k, r)
            assert np.array_equal(b[r].download(), np.arange(300_000, dtype=np.float32) * 3 + 2 * k), (k, r)


def test_replays_are_bit_identical_to_eager(pair):
    comms, streams, graphs = pair
    rng = np.random.default_rng(44)
    n = 1 << 16
    x = [arrays.empty("cuda", 0, n, np.float32) for _ in range(2)]
    _capture_ranks(comms, streams, graphs, lambda r, s: [comms[r].all_reduce(x[r], stream=s)])
    for _ in range(20):
        inputs = [rng.standard_normal(n).astype(np.float32) for _ in range(2)]
        eager = [arrays.from_numpy("cuda", 0, inputs[r]) for r in range(2)]
        for w in [comms[r].all_reduce(eager[r], tag="eager") for r in range(2)]:
            w.synchronize(timeout=TIMEOUT)
        for r in range(2):
            x[r].upload(inputs[r])
        for r in (1, 0):
            graphs[r].launch(streams[r])
        for s in streams:
            s.synchronize()
        want = eager[0].download().tobytes()
        assert all(x[r].download().tobytes() == want for r in range(2))


def test_a_failed_replay_is_raised_by_the_next_call(pair):
    comms, streams, graphs = pair
    x = [arrays.empty("cuda", 0, 64 if r == 0 else 32, np.float32, fill=1.0) for r in range(2)]
    _capture_ranks(comms, streams, graphs, lambda r, s: [comms[r].all_reduce(x[r], tag="m", stream=s)])
    for r in range(2):
        graphs[r].launch(streams[r])
    for s in streams:
        s.synchronize()                       # a failed replay releases its stream
    for r in range(2):
        with pytest.raises(dfccl.MismatchError, match="replay 1 of a captured collective failed"):
            comms[r].all_reduce(arrays.empty("cuda", 0, 4, np.float32, fill=1.0), tag="after")


def test_destroying_the_graph_gives_back_what_it_held(pair):
    comms, streams, graphs = pair
    daemon = comms[0]._daemon
    free_before = daemon.free_slots
    x = [arrays.empty("cuda", 0, 16, np.float32, fill=1.0) for _ in range(2)]
    _capture_ranks(comms, streams, graphs, lambda r, s: [comms[r].all_reduce(x[r], tag="d", stream=s)])
    assert daemon.free_slots == free_before - 2 and len(daemon.captured) == 2
    for r in range(2):
        graphs[r].launch(streams[r])
    for g in graphs:
        g.close()                             # CUDA releases them after the launches
    graphs.clear()
    for s in streams:
        s.synchronize()
    deadline = time.monotonic() + 5.0
    while daemon.captured and time.monotonic() < deadline:
        time.sleep(0.01)
    assert daemon.captured == [] and daemon.free_slots == free_before
    assert all((x[r].download() == 2).all() for r in range(2))



def test_all_to_all_replays_with_the_counts_fixed_at_capture(pair):
    """all_to_all_single with uneven splits (a zero among them) and an
    all-reduce, captured in opposite orders: every replay moves the
    replay's fresh inputs with the split table bound at capture."""
    comms, streams, graphs = pair
    counts = [[3, 0], [70_000, 9]]                      # counts[r][p]: rank r sends rank p
    recv_counts = [[counts[0][p], counts[1][p]] for p in range(2)]
    send = [arrays.empty("cuda", 0, sum(counts[r]), np.float32) for r in range(2)]
    recv = [arrays.empty("cuda", 0, sum(recv_counts[r]), np.float32) for r in range(2)]
    x = [arrays.empty("cuda", 0, 4096, np.float32) for _ in range(2)]

    def issue(r, s):
        a2a = lambda: comms[r].all_to_all_single(send[r], recv[r], send_splits=counts[r],  # noqa: E731
                                                 recv_splits=recv_counts[r], tag="a2a", stream=s)
        ar = lambda: comms[r].all_reduce(x[r], tag="ar", stream=s)  # noqa: E731
        return [a2a(), ar()] if r == 0 else [ar(), a2a()]
    _capture_ranks(comms, streams, graphs, issue)
    rng = np.random.default_rng(47)
    for k in range(1, 31):
        hosts = [rng.standard_normal(sum(counts[r])).astype(np.float32) for r in range(2)]
        for r in range(2):
            send[r].upload(hosts[r])
            x[r].upload(np.full(4096, r + k, np.float32))
        for r in (1, 0):
            graphs[r].launch(streams[r])
        for s in streams:
            s.synchronize()
        for p in range(2):
            offsets = [sum(counts[r][:p]) for r in range(2)]
            want = np.concatenate([hosts[r][offsets[r]:offsets[r] + counts[r][p]] for r in range(2)])
            assert recv[p].download().tobytes() == want.tobytes(), (k, p)
            assert (x[p].download() == 2 * k + 1).all(), (k, p)


def test_a_captured_barrier_runs_at_each_replay(pair):
    """dfccl's barrier captured between two all-reduces on each rank: each
    replay completes, and what follows the barrier sees the replay's data."""
    comms, streams, graphs = pair
    x = [arrays.empty("cuda", 0, 1024, np.float32) for _ in range(2)]
    y = [arrays.empty("cuda", 0, 1024, np.float32) for _ in range(2)]
    _capture_ranks(comms, streams, graphs, lambda r, s: [comms[r].all_reduce(x[r], tag="x", stream=s),
                                                         comms[r].barrier(stream=s),
                                                         comms[r].all_reduce(y[r], tag="y", stream=s)])
    for k in range(1, 21):
        for r in range(2):
            x[r].upload(np.full(1024, r + k, np.float32))
            y[r].upload(np.full(1024, 10 * r + k, np.float32))
        for r in range(2):
            graphs[r].launch(streams[r])
        for s in streams:
            s.synchronize()
        assert all((x[r].download() == 2 * k + 1).all() and (y[r].download() == 2 * k + 10).all()
                   for r in range(2)), k


def test_c_api_submissions_are_captured(pair, tmp_path):
    """The C example's capture (examples/c_api/submit.c): each rank's
    all-reduce submitted from C on its capturing stream, with the stream's
    wait, then replayed with fresh inputs."""
    import importlib.util
    import shutil
    from pathlib import Path

    if shutil.which("cc") is None and not os.environ.get("CC"):
        pytest.skip("no C compiler (cc) to build the C API example")
    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("c_api_example", root / "examples" / "c_api" / "run.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    lib = example.load(example.build(str(tmp_path)))
    comms, streams, graphs = pair
    n = 1 << 15
    x = [arrays.empty("cuda", 0, n, np.float32) for _ in range(2)]
    plans = [comms[r].prepare_all_reduce(n, "float32", tag="from C").bind(x[r]) for r in range(2)]
    for r in range(2):
        g, _ = capture(streams[r], lambda r=r: example.capture(lib, plans[r], x[r].ptr, streams[r].handle))
        graphs.append(g)
    assert len(comms[0]._daemon.captured) == 2          # the two ranks share GPU 0's daemon
    for k in range(1, 21):
        for r in range(2):
            x[r].upload(np.arange(n, dtype=np.float32) * (r + 1) + k)
        for r in range(2):
            graphs[r].launch(streams[r])
        for s in streams:
            s.synchronize()
        want = np.arange(n, dtype=np.float32) * 3 + 2 * k
        assert all(np.array_equal(x[r].download(), want) for r in range(2)), k
