"""What ``dfccl bench`` compares against: NCCL through CuPy (one thread per
GPU) and through torch.distributed (one process per GPU)."""

from __future__ import annotations

import os
import socket
import threading
from typing import Callable

from dfccl.bench.config import BenchConfig, Case, case_seed, count_wrong
from dfccl.bench.harness import TIMEOUT_S, Memory, measure, merge_ranks
from dfccl.bench.report import NCCL_UNAVAILABLE_NO_GPU

__all__ = ["CupyNccl", "free_port", "nccl_thread_status", "set_nccl_env", "torch_nccl_status", "torch_rank_case"]
# NCCL's enum values (nccl.h), shared by CuPy's and torch's bindings.
_NCCL_DTYPE = {"int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5, "float16": 6,
               "float32": 7, "float64": 8, "bfloat16": 9}
_NCCL_OP = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}


# -- NCCL: one thread per GPU (CuPy) -------------------------------------------------------------------
class CupyNccl:
    """One NCCL communicator per GPU, each created and driven by its own
    thread (ncclCommInitRank from one unique id): NCCL's normal mode, not the
    one-thread-drives-all mode (ncclCommInitAll + group calls)."""

    def __init__(self, devices: list[int]):
        from cupy.cuda import nccl

        self.nccl = nccl
        self.devices = devices
        self.n = len(devices)
        self.version = nccl.get_version()
        uid = nccl.get_unique_id()
        self.comms: list = [None] * self.n
        self.streams: list = [None] * self.n
        self._run_threads(lambda r: self._init_rank(r, uid))

    def _init_rank(self, rank: int, uid) -> None:
        import cupy

        cupy.cuda.Device(self.devices[rank]).use()
        self.streams[rank] = cupy.cuda.Stream(non_blocking=True)
        self.comms[rank] = self.nccl.NcclCommunicator(self.n, uid, rank)

    def _run_threads(self, fn: Callable[[int], None]) -> None:
        errors: list[BaseException] = []

        def body(rank: int) -> None:
            try:
                fn(rank)
            except BaseException as exc:  # re-raised in the caller's thread
                errors.append(exc)

        threads = [threading.Thread(target=body, args=(r,), name=f"nccl-rank{r}") for r in range(self.n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def enqueue(self, rank: int, case: Case, send: int, recv: int) -> None:
        comm, stream, dt = self.comms[rank], self.streams[rank].ptr, _NCCL_DTYPE[case.dtype]
        op = _NCCL_OP[case.op]
        if case.kind == "all_reduce":
            comm.allReduce(send, recv, case.count, dt, op, stream)
        elif case.kind == "all_gather":
            comm.allGather(send, recv, case.count, dt, stream)
        elif case.kind == "reduce_scatter":
            comm.reduceScatter(send, recv, case.count, dt, op, stream)
        elif case.kind == "broadcast":
            comm.broadcast(send, recv, case.count, dt, case.root, stream)
        else:
            comm.reduce(send, recv, case.count, dt, op, case.root, stream)

    def run_case(self, case: Case, mem: Memory, cfg: BenchConfig, base_seed: int) -> dict:
        """In place: every thread checks, then times its own loop between barriers."""
        import cupy

        barrier = threading.Barrier(self.n, timeout=TIMEOUT_S)
        results: list[dict] = [{} for _ in range(self.n)]
        inputs = case.inputs(case_seed(base_seed, case.kind, case, "nccl")) if cfg.check else None

        def rank_job(r: int) -> None:
            try:
                one_rank(r)
            except BaseException:
                barrier.abort()  # the other threads must not wait for this one
                raise

        def one_rank(r: int) -> None:
            dev = self.devices[r]
            cupy.cuda.Device(dev).use()
            buf = mem.empty(dev, case.out_count if case.kind == "all_gather" else case.in_count, case.dtype)
            s, rv = case.in_place_views(buf, r, mem)
            sp, rp = mem.ptr(s), mem.ptr(rv)
            wrong = None
            if inputs is not None:
                want = case.expected(inputs, r)
                mem.upload(buf, case.initial(inputs, r, True, want)[0])
                mem.synchronize(dev)
                barrier.wait()
                self.enqueue(r, case, sp, rp)
                self.streams[r].synchronize()
                wrong = count_wrong(mem.download(rv, case.dtype), want, case.dtype, case.op, case.n)
            # Blocking: this thread synchronises its own stream after every collective.
            timing = measure(lambda: self.enqueue(r, case, sp, rp), self.streams[r].synchronize, cfg, barrier.wait)
            results[r] = {**timing, "wrong": wrong}

        self._run_threads(rank_job)
        return merge_ranks(results)

    def close(self) -> None:
        for c in self.comms:
            if c is not None:
                c.destroy()
        self.comms = []


def nccl_thread_status(cfg: BenchConfig) -> str | None:
    """None when the thread-mode baseline can run, else why not."""
    if not cfg.nccl:
        return "disabled (--no-nccl)"
    if cfg.backend != "cuda":
        return NCCL_UNAVAILABLE_NO_GPU
    try:
        from cupy.cuda import nccl  # noqa: F401
    except Exception:
        return "CuPy with NCCL is needed for the thread-mode baseline (pip install cupy-cuda13x)"
    return None


# -- process mode ---------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def set_nccl_env() -> None:
    # NVLink multicast (NVLS) stays off: it is unavailable on the machines this
    # project runs on and may not be enabled there.
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


def torch_nccl_status() -> str | None:
    try:
        import torch
        import torch.distributed as dist
    except Exception:
        return NCCL_UNAVAILABLE_NO_GPU
    if not torch.cuda.is_available() or not dist.is_available() or not dist.is_nccl_available():
        return NCCL_UNAVAILABLE_NO_GPU
    return None


def _torch_op(op: str):
    import torch.distributed as dist

    return {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN,
            "max": dist.ReduceOp.MAX, "avg": dist.ReduceOp.AVG}[op]


def _torch_collective(case: Case, send, recv) -> None:
    import torch.distributed as dist

    if case.kind == "all_reduce":
        dist.all_reduce(recv, op=_torch_op(case.op))
    elif case.kind == "all_gather":
        dist.all_gather_into_tensor(recv, send)
    elif case.kind == "reduce_scatter":
        dist.reduce_scatter_tensor(recv, send, op=_torch_op(case.op))
    elif case.kind == "broadcast":
        dist.broadcast(recv, src=case.root)
    else:
        dist.reduce(recv, dst=case.root, op=_torch_op(case.op))


def torch_rank_case(case: Case, rank: int, dev: int, mem: Memory, cfg: BenchConfig, base_seed: int,
                     wait) -> dict:
    import torch

    tmem = mem  # torch is importable here, so the arrays are torch tensors
    buf = torch.empty(case.out_count if case.kind == "all_gather" else case.in_count,
                      dtype=getattr(torch, case.dtype), device=f"cuda:{dev}")
    s, rv = case.in_place_views(buf, rank, tmem)
    wrong = None
    if cfg.check:
        inputs = case.inputs(case_seed(base_seed, case.kind, case, "nccl"))
        want = case.expected(inputs, rank)
        tmem.upload(buf, case.initial(inputs, rank, True, want)[0])
        torch.cuda.synchronize(dev)
        _torch_collective(case, s, rv)
        torch.cuda.synchronize(dev)
        wrong = count_wrong(tmem.download(rv, case.dtype), want, case.dtype, case.op, case.n)
    wait()
    # Blocking: torch.cuda.synchronize after every collective waits for it on the device.
    timing = measure(lambda: _torch_collective(case, s, rv), lambda: torch.cuda.synchronize(dev), cfg, wait)
    return {**timing, "wrong": wrong}
