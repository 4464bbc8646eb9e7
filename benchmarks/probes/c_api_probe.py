"""Host time per submission of one small all-reduce, three ways: from C
through the C API (cuda/include/dfccl/dfccl_api.h; a loop in
examples/c_api/submit.c), a bound plan called from Python, and a plain
``comm.all_reduce(x)`` (x: numpy on the simulator; CuPy, torch and a bare
``__cuda_array_interface__`` object on GPUs).  Two ranks in one process; each repetition submits
``--n`` rounds back to back (one instance per rank a round, all
outstanding), times the submissions alone, then waits for them all.

    python benchmarks/c_api_probe.py --backend sim
    python benchmarks/c_api_probe.py --backend cuda --devices 0,0

Reports, per way, the median over ``--reps`` repetitions of the mean time
per submission, with the fastest and slowest repetition, in microseconds:
wall time, and the submitting thread's CPU time (which a loaded host
leaves alone).
On the simulator the figures are host cost only (its daemon shares the
CPU).  The C library is built with the system C compiler (``cc``, or $CC)
unless ``--lib`` names one built from submit.c."""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import tempfile
import time

import dfccl
from dfccl import runtime
from dfccl.bench import arrays

EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "examples", "c_api", "run.py")


def _example():
    spec = importlib.util.spec_from_file_location("c_api_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _python_loop(submit_round, n: int) -> tuple[float, float]:
    """(wall, thread CPU) seconds of ``n`` rounds of Python submissions
    (then waited for, untimed)."""
    works = []
    c0 = time.thread_time_ns()
    t0 = time.perf_counter_ns()
    for _ in range(n):
        submit_round(works)
    t1 = time.perf_counter_ns()
    c1 = time.thread_time_ns()
    for w in works:
        w.synchronize(60)
    return (t1 - t0) / 1e9, (c1 - c0) / 1e9


def _plain_pairs(backend: str, comms, devices, xs, count: int):
    """(name, [(comm, array)]) per array type the plain call takes here:
    numpy on the simulator; on GPUs CuPy and torch where installed, and
    a bare ``__cuda_array_interface__`` object."""
    if backend == "sim":
        return [("numpy", list(zip(comms, xs)))]
    out = []
    try:
        import cupy
        made = []
        for d in devices:
            with cupy.cuda.Device(d):
                made.append(cupy.zeros(count, cupy.float32))
        out.append(("cupy", list(zip(comms, made))))
    except ImportError:
        pass
    try:
        import torch
        out.append(("torch", [(c, torch.zeros(count, dtype=torch.float32, device=f"cuda:{d}"))
                              for c, d in zip(comms, devices)]))
    except ImportError:
        pass
    out.append(("__cuda_array_interface__", list(zip(comms, xs))))
    return out


def _summary(us: list[float]) -> str:
    return f"{statistics.median(us):7.3f}  [{min(us):.3f}, {max(us):.3f}]"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=("cuda", "sim"), default=None, help="default: cuda if a GPU is visible")
    p.add_argument("--devices", default=None, help="one device per rank (default: 0,0 on cuda, 7400,7401 on sim)")
    p.add_argument("--count", type=int, default=256, help="float32 elements per all-reduce")
    p.add_argument("--n", type=int, default=1000, help="rounds per repetition (both ranks' submissions outstanding)")
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--lib", help="a library built from examples/c_api/submit.c")
    args = p.parse_args(argv)
    backend = args.backend or ("cuda" if runtime.cuda_device_count() > 0 else "sim")
    devices = [int(d) for d in (args.devices or ("0,0" if backend == "cuda" else "7400,7401")).split(",")]
    example = _example()
    with tempfile.TemporaryDirectory() as tmp:
        lib = example.load(args.lib or example.build(tmp))
        comms = dfccl.Communicator.for_devices(devices, backend=backend)
        try:
            xs = [arrays.empty(backend, d, args.count, "float32", fill=0.0) for d in devices]
            plans = [c.prepare_all_reduce(args.count, "float32", tag="probe").bind(x) for c, x in zip(comms, xs)]

            def bound_round(works):
                for plan in plans:
                    works.append(plan())

            def plain_round_of(pairs):
                def plain_round(works):
                    for c, x in pairs:
                        works.append(c.all_reduce(x))
                return plain_round

            ways = {
                "C API, a loop in C": lambda: example.submit_loop(lib, plans, args.n)[:2],
                "bound plan, from Python": lambda: _python_loop(bound_round, args.n),
            }
            # The plain call on every type of array a user may pass here.
            for name, pairs in _plain_pairs(backend, comms, devices, xs, args.count):
                ways[f"comm.all_reduce(x), {name}"] = (lambda r: lambda: _python_loop(r, args.n))(
                    plain_round_of(pairs))
            per = args.n * len(comms)
            wall = {name: [] for name in ways}
            cpu = {name: [] for name in ways}
            for name, way in ways.items():   # warm-up: tags bound, descriptors kept, daemon up
                way()
            for _ in range(args.reps):       # interleaved, so that drift hits every way alike
                for name, way in ways.items():
                    w, c = way()
                    wall[name].append(w / per * 1e6)
                    cpu[name].append(c / per * 1e6)
            print(f"{backend} {devices}, {args.count} x float32, {args.n} rounds of {len(comms)} submissions, "
                  f"{args.reps} repetitions: us per submission, median [fastest, slowest]; wall time, and the "
                  "submitting thread's CPU time")
            for name in ways:
                print(f"  {name:>50}: {_summary(wall[name])}   cpu {_summary(cpu[name])}")
        finally:
            for c in comms:
                c.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
