"""A small all-reduce captured in a CUDA graph and replayed back to back,
against the same all-reduce issued eagerly back to back.  Two ranks in one
process on one GPU (``--devices 0,0``), each with its stream.

Eager: each rank issues ``--n`` stream-ordered all-reduces on its stream
(``stream=``, each waited for on that stream with ``Work.wait``, as a
framework's stream-ordered call is), then the streams are synchronised.
Captured: each rank's graph holds ``--per-graph`` of them (captured once,
docs/architecture.md "CUDA graphs"); each rank launches its graph
``--n / --per-graph`` times back to back, then the streams are synchronised.
Reports, per way, the median over ``--reps`` repetitions of the wall time
per collective (first launch to last completion, divided by the
collectives per rank) in microseconds, with the fastest and slowest
repetition, and the submitting thread's time spent issuing them.

    python benchmarks/probes/graph_replay_probe.py --devices 0,0
    python benchmarks/probes/graph_replay_probe.py --devices 0,0 --bytes 8 --n 2000 --per-graph 1"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

import dfccl
from dfccl.bench import arrays

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "support"))
from dfccl_support.cuda_graphs import Stream, capture, close_all  # noqa: E402


def _eager(comms, xs, streams, n: int) -> tuple[float, float]:
    t0 = time.perf_counter_ns()
    for _ in range(n):
        for c, x, s in zip(comms, xs, streams):
            c.all_reduce(x, stream=s.handle).wait(s.handle)
    t1 = time.perf_counter_ns()
    for s in streams:
        s.synchronize()
    t2 = time.perf_counter_ns()
    return (t2 - t0) / 1e3 / n, (t1 - t0) / 1e3 / n


def _captured(graphs, streams, n: int, per_graph: int) -> tuple[float, float]:
    launches = max(1, n // per_graph)
    t0 = time.perf_counter_ns()
    for _ in range(launches):
        for g, s in zip(graphs, streams):
            g.launch(s)
    t1 = time.perf_counter_ns()
    for s in streams:
        s.synchronize()
    t2 = time.perf_counter_ns()
    done = launches * per_graph
    return (t2 - t0) / 1e3 / done, (t1 - t0) / 1e3 / done


def _summary(name: str, runs: list[tuple[float, float]]) -> str:
    wall = [w for w, _ in runs]
    issue = [i for _, i in runs]
    return (f"{name:>9}: {statistics.median(wall):8.2f} us per collective "
            f"(min {min(wall):.2f}, max {max(wall):.2f}); issuing {statistics.median(issue):.2f} us")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", default="0,0", help="the two ranks' GPUs (default 0,0: one GPU)")
    p.add_argument("--bytes", type=int, default=8, help="message size (float32 elements x 4)")
    p.add_argument("--n", type=int, default=2000, help="collectives per rank per repetition")
    p.add_argument("--per-graph", type=int, default=1, help="collectives captured in one graph")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--warmup", type=int, default=200)
    a = p.parse_args(argv)
    devices = [int(d) for d in a.devices.split(",")]
    count = max(1, a.bytes // 4)
    comms = dfccl.Communicator.for_devices(devices, backend="cuda")
    streams = [Stream() for _ in devices]
    xs = [arrays.empty("cuda", d, count, np.float32, fill=0.0) for d in devices]
    ys = [arrays.empty("cuda", d, count, np.float32, fill=0.0) for d in devices]
    graphs = []
    for r in range(len(devices)):
        def body(r=r):
            for _ in range(a.per_graph):
                comms[r].all_reduce(ys[r], tag="captured", stream=streams[r].handle).wait(streams[r].handle)
        graphs.append(capture(streams[r], body)[0])
    try:
        _eager(comms, xs, streams, a.warmup)
        _captured(graphs, streams, a.warmup, a.per_graph)
        eager, captured = [], []
        for _ in range(a.reps):
            eager.append(_eager(comms, xs, streams, a.n))
            captured.append(_captured(graphs, streams, a.n, a.per_graph))
        print(f"all_reduce {a.bytes} B, ranks on GPUs {devices}, {a.n} per rank, {a.per_graph} per graph")
        print(_summary("eager", eager))
        print(_summary("captured", captured))
    finally:
        close_all(graphs, streams, comms)
    return 0


if __name__ == "__main__":
    sys.exit(main())
