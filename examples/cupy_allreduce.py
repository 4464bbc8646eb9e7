"""dfccl's own API with CuPy arrays: two ranks driven from one process, their
collectives issued in opposite orders (NCCL would hang), on CuPy streams.

    python examples/cupy_allreduce.py

The ranks use GPUs 0 and 1, or both GPU 0 on a machine with one.  Without
CuPy or a GPU it runs the same code on two simulated GPUs with numpy arrays.
"""

from __future__ import annotations

import numpy as np

import dfccl


def main() -> None:
    try:
        import cupy as cp
        gpus = cp.cuda.runtime.getDeviceCount() if dfccl.default_backend() == "cuda" else 0
    except Exception:  # no CuPy, or no driver
        cp, gpus = None, 0
    use_gpu = cp is not None and gpus >= 1
    backend = "cuda" if use_gpu else "sim"
    devices = [0, 1] if gpus >= 2 or not use_gpu else [0, 0]
    comms = dfccl.Communicator.for_devices(devices, backend=backend)

    n = 1 << 20
    arrays, streams = [], []
    for rank in range(2):
        if use_gpu:
            with cp.cuda.Device(devices[rank]):
                streams.append(cp.cuda.Stream(non_blocking=True))
                arrays.append((cp.full(n, rank + 1, dtype=cp.float32), cp.arange(8, dtype=cp.int64) * (rank + 1)))
        else:
            streams.append(None)
            arrays.append((np.full(n, rank + 1, dtype=np.float32), np.arange(8, dtype=np.int64) * (rank + 1)))

    # Rank 0 issues "grads" then "stats"; rank 1 the opposite.  Tags match them.
    works = []
    for rank, order in ((0, ("grads", "stats")), (1, ("stats", "grads"))):
        grads, stats = arrays[rank]
        for name in order:
            if name == "grads":
                works.append(comms[rank].all_reduce(grads, op="avg", tag="grads", stream=streams[rank]))
            else:
                works.append(comms[rank].all_reduce(stats, op="max", tag="stats", stream=streams[rank]))
    if use_gpu:
        for rank, w in ((0, works[0]), (0, works[1]), (1, works[2]), (1, works[3])):
            w.wait(streams[rank])          # the stream waits; the host does not
        for s in streams:
            s.synchronize()
    for w in works:
        w.synchronize(timeout=30)

    for rank in range(2):
        grads, stats = arrays[rank]
        g = cp.asnumpy(grads) if use_gpu else grads
        s = cp.asnumpy(stats) if use_gpu else stats
        assert (g == 1.5).all() and (s == np.arange(8) * 2).all(), "wrong result"
    print(f"{backend} {devices}: both orders completed; grads averaged to {float(g[0])}, stats max {s.tolist()}")
    print("stats of rank 0's first collective:", works[0].stats)
    for c in comms:
        c.close()


if __name__ == "__main__":
    main()
