"""NCCL, called directly through ctypes: the baseline of the benchmarks (one
process drives every GPU: ncclCommInitAll and a group call per collective,
like nccl-tests with -g N), and the stream-ordered deadlock reference.  Every
NCCL and driver result is checked.  Needs libnccl (nvidia-nccl-cu13) and a
GPU; nothing in dfccl's own data path uses it."""

from __future__ import annotations

import ctypes
import glob
import os
import site

__all__ = ["Nccl", "find_libnccl", "stream_order_reference"]

_DTYPES = {"int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5, "float16": 6, "float32": 7,
           "float64": 8, "bfloat16": 9}
_OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}


def find_libnccl() -> str | None:
    """libnccl.so.2 from the nvidia-nccl wheel, else the system's."""
    env = os.environ.get("DFCCL_LIBNCCL")
    if env:
        return env
    roots = site.getsitepackages() + [site.getusersitepackages()]
    for root in roots:
        for path in glob.glob(os.path.join(root, "nvidia", "nccl", "lib", "libnccl.so*")):
            return path
    import ctypes.util
    return ctypes.util.find_library("nccl")


class Nccl:
    """One NCCL communicator over ``devices`` (rank i on devices[i]), with a
    stream per device (its own, or ``streams`` shared with another Nccl)."""

    def __init__(self, devices: list[int], streams: list | None = None):
        from cuda.bindings import driver

        path = find_libnccl()
        if path is None:
            raise RuntimeError("libnccl not found (install nvidia-nccl-cu13 or set DFCCL_LIBNCCL)")
        self.lib = ctypes.CDLL(path)
        self.devices = devices
        self._driver = driver
        v = ctypes.c_int()
        self._check(self.lib.ncclGetVersion(ctypes.byref(v)), "ncclGetVersion")
        self.version = v.value
        n = len(devices)
        self.comms = (ctypes.c_void_p * n)()
        devlist = (ctypes.c_int * n)(*devices)
        self._check(self.lib.ncclCommInitAll(self.comms, n, devlist), "ncclCommInitAll")
        self.contexts, self.streams = [], []
        for d in devices:
            err, dev = driver.cuDeviceGet(d)
            self._cu(err, "cuDeviceGet")
            err, ctx = driver.cuDevicePrimaryCtxRetain(dev)
            self._cu(err, "cuDevicePrimaryCtxRetain")
            self._cu(driver.cuCtxSetCurrent(ctx)[0], "cuCtxSetCurrent")
            if streams is None:
                err, stream = driver.cuStreamCreate(driver.CUstream_flags.CU_STREAM_NON_BLOCKING)
                self._cu(err, "cuStreamCreate")
            else:
                stream = streams[len(self.streams)]
            self.contexts.append(ctx)
            self.streams.append(stream)
        for name in ("ncclAllReduce", "ncclAllGather", "ncclReduceScatter", "ncclBroadcast", "ncclReduce"):
            getattr(self.lib, name).restype = ctypes.c_int

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            self.lib.ncclGetErrorString.restype = ctypes.c_char_p
            raise RuntimeError(f"{what} failed: {self.lib.ncclGetErrorString(rc).decode()}")

    def _cu(self, err, what: str) -> None:
        if err != self._driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"{what} failed: {err}")

    def enqueue(self, rank: int, kind: str, send: int, recv: int, count: int, dtype: str, op: str = "sum",
                root: int = 0) -> int:
        """One rank's part of a collective on its stream (no group call: for
        one thread per rank).  Returns the ncclResult_t."""
        lib, dt, rop = self.lib, _DTYPES[dtype], _OPS[op]
        s, d, c = ctypes.c_void_p(send), ctypes.c_void_p(recv), ctypes.c_size_t(count)
        comm, stream = ctypes.c_void_p(self.comms[rank]), ctypes.c_void_p(int(self.streams[rank]))
        if kind == "all_reduce":
            return lib.ncclAllReduce(s, d, c, dt, rop, comm, stream)
        if kind == "all_gather":
            return lib.ncclAllGather(s, d, c, dt, comm, stream)
        if kind == "reduce_scatter":
            return lib.ncclReduceScatter(s, d, c, dt, rop, comm, stream)
        if kind == "broadcast":
            return lib.ncclBroadcast(s, d, c, dt, root, comm, stream)
        return lib.ncclReduce(s, d, c, dt, rop, root, comm, stream)

    def collective(self, kind: str, sends: list[int], recvs: list[int], count: int, dtype: str, op: str = "sum",
                   root: int = 0) -> None:
        """One collective on every rank (a group call), enqueued on the streams.
        ``count`` follows dfccl.scenarios.Spec (per-rank for all_gather /
        reduce_scatter)."""
        self._check(self.lib.ncclGroupStart(), "ncclGroupStart")
        for r in range(len(self.devices)):
            self._check(self.enqueue(r, kind, sends[r], recvs[r], count, dtype, op, root), f"nccl {kind}")
        self._check(self.lib.ncclGroupEnd(), "ncclGroupEnd")

    def synchronize(self) -> None:
        for ctx, stream in zip(self.contexts, self.streams):
            self._cu(self._driver.cuCtxSetCurrent(ctx)[0], "cuCtxSetCurrent")
            self._cu(self._driver.cuStreamSynchronize(stream)[0], "cuStreamSynchronize")

    def close(self) -> None:
        for comm in self.comms:
            if comm:
                self.lib.ncclCommDestroy(ctypes.c_void_p(comm))
        self.comms = (ctypes.c_void_p * 0)()


_STREAM_ORDER_CHILD = r"""
import sys, threading, time
from cuda.bindings import driver
from dfccl.nccl_baseline import Nccl
from dfccl import arrays
import numpy as np
timeout = float(sys.argv[1])
devices = [0, 1]
a = Nccl(devices)
b = Nccl(devices, streams=a.streams)          # a second communicator on the same streams
n = 1 << 20
bufs = {(r, t): arrays.DeviceArray(d, n, "float32") for r, d in enumerate(devices) for t in "AB"}
for (r, t), buf in bufs.items():
    buf.upload(np.full(n, (r + 1) * (1 if t == "A" else 100), np.float32))
# Warm both communicators in the same order first: NCCL connects a
# communicator during its first collective, on the CPU, so opposite first
# calls would hang there; the hang shown here is the GPU-side one.
for comm in (a, b):
    comm.collective("all_reduce", [bufs[(r, "A")].ptr for r in (0, 1)], [bufs[(r, "A")].ptr for r in (0, 1)], 1,
                    "float32")
    comm.synchronize()
for (r, t), buf in bufs.items():
    buf.upload(np.full(n, (r + 1) * (1 if t == "A" else 100), np.float32))
order = {0: [("A", a), ("B", b)], 1: [("B", b), ("A", a)]}
def drive(r):
    driver.cuCtxSetCurrent(a.contexts[r])
    for t, comm in order[r]:
        rc = comm.enqueue(r, "all_reduce", bufs[(r, t)].ptr, bufs[(r, t)].ptr, n, "float32")
        assert rc == 0, rc
ts = [threading.Thread(target=drive, args=(r,)) for r in (0, 1)]
[t.start() for t in ts]; [t.join() for t in ts]
t0 = time.time()
while time.time() - t0 < timeout:
    pending = 0
    for ctx, s in zip(a.contexts, a.streams):
        driver.cuCtxSetCurrent(ctx)
        err, = driver.cuStreamQuery(s)
        pending += err == driver.CUresult.CUDA_ERROR_NOT_READY
    if not pending:
        ok = all(abs(float(bufs[(r, t)].download()[0]) - (3 if t == "A" else 300)) < 1e-3 for r in (0, 1) for t in "AB")
        print("OUTCOME", "completed" if ok else "wrong_result", round(time.time() - t0, 3), flush=True)
        sys.exit(0)
    time.sleep(0.01)
print("OUTCOME hung", timeout, flush=True)
import os; os._exit(0)   # the stuck kernels go with the process
"""


def stream_order_reference(timeout: float = 10.0) -> dict:
    """NCCL's canonical deadlock: two communicators whose collectives share one
    stream per GPU (as a framework's compute stream or a CUDA graph orders
    them), rank 0 enqueuing A then B and rank 1 B then A.  Runs in a
    subprocess (stuck kernels die with it); returns {"outcome", "seconds"}."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    try:
        out = subprocess.run([sys.executable, "-c", _STREAM_ORDER_CHILD, str(timeout)], capture_output=True,
                             text=True, timeout=timeout + 60, env=env)
    except subprocess.TimeoutExpired:
        return {"outcome": "hung", "seconds": timeout, "detail": "the process itself did not return"}
    for line in out.stdout.splitlines():
        if line.startswith("OUTCOME "):
            _, outcome, seconds = line.split()
            return {"outcome": outcome, "seconds": float(seconds), "detail": ""}
    return {"outcome": "error", "seconds": 0.0, "detail": (out.stdout + out.stderr)[-2000:]}
