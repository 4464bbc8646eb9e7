"""Runs the C example (submit.c, next to this file): two ranks of a
communicator, one all-reduce plan bound per rank, handed to C, which
submits, waits and checks every round itself; on the simulator, the same
plans then captured from C into (simulated) CUDA graphs and replayed.

    python examples/c_api/run.py --iterations 20 --count 1024
    python examples/c_api/run.py --backend cuda --devices 0,0

The library is built with the system C compiler (``cc``, or $CC) into a
temporary directory unless ``--lib`` names one already built."""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

import dfccl
from dfccl import capi

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "submit.c")


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc")


def build(out_dir: str, cc: str | None = None) -> str:
    """Compiles submit.c into a shared library in ``out_dir``; returns its path."""
    cc = cc or compiler()
    if cc is None:
        raise RuntimeError("no C compiler: install one (cc) or set $CC")
    lib = os.path.join(out_dir, "libdfccl_example.so")
    subprocess.check_call([cc, "-O2", "-std=c11", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC",
                           f"-I{capi.include_dir()}", SOURCE, "-o", lib])
    return lib


def load(path: str):
    """The library, its functions typed (ctypes.CDLL gives the GIL up for
    every call: the C code runs without it)."""
    lib = ctypes.CDLL(path)
    vp, u64p, err = ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64), ctypes.c_char_p
    lib.dfccl_example_all_reduce.argtypes = [vp, ctypes.POINTER(vp), ctypes.POINTER(vp), ctypes.c_int,
                                             ctypes.c_size_t, ctypes.c_int, err, ctypes.c_size_t]
    lib.dfccl_example_submit_loop.argtypes = [vp, ctypes.POINTER(vp), ctypes.c_int, ctypes.c_int, u64p, u64p, u64p,
                                              err, ctypes.c_size_t]
    lib.dfccl_example_capture.argtypes = [vp, vp, ctypes.c_uint64, ctypes.c_uint64, err, ctypes.c_size_t]
    return lib


def addresses(values) -> ctypes.Array:
    return (ctypes.c_void_p * len(values))(*values)


def all_reduce(lib, plans, buffers, iterations: int) -> None:
    """Rounds of all-reduces submitted, waited for and checked in C."""
    err = ctypes.create_string_buffer(512)
    rc = lib.dfccl_example_all_reduce(capi.table_address(), addresses([p.c_plan for p in plans]),
                                      addresses([b.ctypes.data for b in buffers]), len(plans), buffers[0].size,
                                      iterations, err, len(err))
    if rc != 0:
        raise RuntimeError(f"the C example failed ({rc}): {err.value.decode()}")


def submit_loop(lib, plans, n: int) -> tuple[float, float, float]:
    """(submit, its thread CPU time, wait) seconds of ``n`` back-to-back
    submissions per plan from C."""
    err = ctypes.create_string_buffer(512)
    submit_ns, cpu_ns, wait_ns = ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_uint64()
    rc = lib.dfccl_example_submit_loop(capi.table_address(), addresses([p.c_plan for p in plans]), len(plans), n,
                                       ctypes.byref(submit_ns), ctypes.byref(cpu_ns), ctypes.byref(wait_ns), err,
                                       len(err))
    if rc != 0:
        raise RuntimeError(f"the C submission loop failed ({rc}): {err.value.decode()}")
    return submit_ns.value / 1e9, cpu_ns.value / 1e9, wait_ns.value / 1e9


def capture(lib, plan, buffer_address: int, stream_handle: int) -> None:
    """Has C submit ``plan``'s in-place all-reduce of the buffer at
    ``buffer_address`` on a stream that captures a CUDA graph, and the
    stream's wait for it: every replay of the graph runs it."""
    err = ctypes.create_string_buffer(512)
    rc = lib.dfccl_example_capture(capi.table_address(), plan.c_plan, buffer_address, stream_handle, err, len(err))
    if rc != 0:
        raise RuntimeError(f"the C capture failed ({rc}): {err.value.decode()}")


def replay_graphs(lib, comms, plans, buffers, replays: int) -> None:
    """On the simulator: each rank's all-reduce captured from C into a graph
    of its stream, then ``replays`` replays with fresh inputs, checked."""
    from dfccl import runtime
    streams = [runtime.get_device("sim", c.device).create_stream() for c in comms]
    graphs = []
    try:
        for plan, b, s in zip(plans, buffers, streams):
            s.begin_capture()
            try:
                capture(lib, plan, b.ctypes.data, s.handle)
            finally:
                graphs.append(s.end_capture())
        n = len(comms)
        for k in range(1, replays + 1):
            for r, b in enumerate(buffers):
                b[:] = (r + 1) * k
            for g, s in zip(graphs, streams):
                g.launch(s)
            for s in streams:
                if not s.synchronize(timeout=30.0):
                    raise RuntimeError(f"replay {k} did not complete")
            for r, b in enumerate(buffers):
                if not np.all(b == k * n * (n + 1) / 2):
                    raise RuntimeError(f"replay {k}, rank {r}: {b[:4]}..., expected {k * n * (n + 1) / 2}")
    finally:
        for g in graphs:
            g.close()
        for s in streams:
            s.synchronize(timeout=30.0)
            s.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="sim")
    ap.add_argument("--devices", default="0,1", help="one device per rank, e.g. 0,1 (or 0,0 on one GPU)")
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--count", type=int, default=1024)
    ap.add_argument("--lib", help="a library already built from submit.c")
    args = ap.parse_args(argv)
    devices = [int(d) for d in args.devices.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        lib = load(args.lib or build(tmp))
        comms = dfccl.Communicator.for_devices(devices, backend=args.backend)
        try:
            if args.backend == "sim":
                buffers = [np.zeros(args.count, np.float32) for _ in comms]
                plans = [c.prepare_all_reduce(args.count, "float32").bind(b) for c, b in zip(comms, buffers)]
                all_reduce(lib, plans, buffers, args.iterations)
                print(f"{args.iterations} rounds of all-reduce on {len(comms)} ranks from C: results checked")
                replay_graphs(lib, comms, plans, buffers, args.iterations)
                print(f"{args.iterations} replays of graphs captured from C: results checked")
            else:
                # Device memory: C cannot write the inputs, so every rank starts
                # from ones and ends with nranks ** iterations.
                from dfccl.bench import arrays
                buffers = [arrays.empty(args.backend, d, args.count, "float32", fill=1.0) for d in devices]
                plans = [c.prepare_all_reduce(args.count, "float32").bind(b) for c, b in zip(comms, buffers)]
                submit_s, _, _ = submit_loop(lib, plans, args.iterations)
                want = float(len(comms)) ** args.iterations
                for r, b in enumerate(buffers):
                    got = arrays.to_numpy(b)
                    if not np.all(got == want):
                        raise RuntimeError(f"rank {r}: {got[:4]}..., expected {want}")
                print(f"{args.iterations} rounds of all-reduce on {len(comms)} ranks from C: results checked, "
                      f"{submit_s / (args.iterations * len(plans)) * 1e6:.2f} us per submission")
        finally:
            for c in comms:
                c.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
