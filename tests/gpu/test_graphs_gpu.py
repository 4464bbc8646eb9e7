"""Collectives of dfccl's own API captured in CUDA graphs
(cuStreamBeginCapture / EndCapture / GraphInstantiate / GraphLaunch through
cuda-python) on one GPU: two ranks of one process share it
(Communicator.for_devices([0, 0])), each with its stream and its graph.
Replays in divergent orders across the ranks, many replays bit-identical to
eager collectives, a failed replay raised by the next call, and the graph's
destruction giving back what the capture held (docs/architecture.md, "CUDA
graphs")."""

from __future__ import annotations

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

