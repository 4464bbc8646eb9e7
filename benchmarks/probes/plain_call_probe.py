"""Where the host time of a plain call goes (``Communicator.all_reduce`` on an
array, as against a bound plan): each layer of the call timed alone in a
loop, then whole calls, two ranks on one device in one process.

    python benchmarks/plain_call_probe.py [--backend cuda|sim] [--iters 3000]

Medians in microseconds.  The layers are what ``all_reduce`` runs, in order:
the array's description (``as_buffer``: its ``__cuda_array_interface__``
and the driver's pointer query), the argument checks, the kept descriptor's
lookup, and the submission itself (``Daemon.submit_at``: tag instance, slot,
ring entry, the daemon's launch check)."""

from __future__ import annotations

import argparse
import time

import numpy as np

import dfccl
from dfccl import runtime
from dfccl._native.layout import KIND_ALL_REDUCE
from dfccl.arguments import check_overlap
from dfccl.buffers import as_buffer
from dfccl.bench import arrays


def median_us(fn, iters: int) -> float:
    now = time.perf_counter_ns
    ts = []
    for _ in range(iters):
        t0 = now()
        fn()
        ts.append(now() - t0)
    return float(np.median(ts)) / 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=("cuda", "sim"), default=None, help="default: cuda if a GPU is visible")
    p.add_argument("--iters", type=int, default=3000)
    args = p.parse_args()
    backend = args.backend or ("cuda" if runtime.cuda_device_count() > 0 else "sim")
    device = 0 if backend == "cuda" else 7200
    comms = dfccl.Communicator.for_devices([device, device], backend=backend)
    c = comms[0]
    rng = np.random.default_rng()
    bufs = [arrays.from_numpy(backend, device, rng.standard_normal(2).astype(np.float32)) for _ in comms]
    x = bufs[0]
    ptr = x.ptr if backend == "cuda" else x.ctypes.data
    s = as_buffer(x)
    sub = c._submitter   # the submission layer's steps, timed one by one
    op = sub.op("sum")
    rows = [
        ("__cuda_array_interface__ / __array_interface__",
         (lambda: x.__cuda_array_interface__) if backend == "cuda" else (lambda: x.__array_interface__)),
        ("x.dtype.name (no longer read for '<f4')", lambda: x.dtype.name),
        ("runtime.cuda_pointer_info (driver query)", lambda: runtime.cuda_pointer_info(ptr)),
        ("as_buffer", lambda: as_buffer(x)),
        ("Submitter.pair", lambda: sub.pair(x, None, "all_reduce")),
        ("check_tag + same_shape + op", lambda: (sub.check_tag(None, "all_reduce"),
                                                 sub.same_shape(s, s, s.count, "all_reduce"), sub.op("sum"))),
        ("check_open + check_overlap", lambda: (c._state.check_open(), check_overlap(KIND_ALL_REDUCE, s, s, s.count,
                                                                                     c.rank, c.world_size,
                                                                                     "all_reduce"))),
        ("Submitter.plain_task (kept descriptor)", lambda: sub.plain_task(KIND_ALL_REDUCE, s, s, s.count, op, 0)),
    ]
    print(f"{backend}:{device}, two ranks; medians over {args.iters} calls, us")
    for name, fn in rows:
        fn()
        print(f"  {name:>48}: {median_us(fn, args.iters):7.2f}")

    # Whole calls: both ranks submit, then wait; each submit timed.
    now = time.perf_counter_ns
    for label, call in (("all_reduce(array)", lambda comm, b: comm.all_reduce(b)),
                        ("all_reduce(array, tag='t')", lambda comm, b: comm.all_reduce(b, tag="t")),
                        ("all_reduce(array, tag=('t',))", lambda comm, b: comm.all_reduce(b, tag=("t",)))):
        sub, total = [], []
        for i in range(args.iters + 200):
            t0 = now()
            w0 = call(comms[0], bufs[0])
            t1 = now()
            w1 = call(comms[1], bufs[1])
            t2 = now()
            w0.synchronize(timeout=30)
            w1.synchronize(timeout=30)
            t3 = now()
            if i >= 200:
                sub.append((t1 - t0, t2 - t1))
                total.append(t3 - t0)
        a = np.array(sub) / 1000
        print(f"  {label:>48}: submit rank 0 {np.median(a[:, 0]):6.2f}, rank 1 {np.median(a[:, 1]):6.2f}, "
              f"submit + wait both {np.median(total) / 1000:6.2f}")
    for comm in comms:
        comm.close()
    runtime.shutdown()


if __name__ == "__main__":
    main()
