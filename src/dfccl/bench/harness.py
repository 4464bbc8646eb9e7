"""How ``dfccl bench`` measures: device memory for the cases, and the timed
loops (back to back, and blocking) that every contender goes through."""

from __future__ import annotations

import collections
import time
from typing import Callable

import numpy as np

from dfccl.bench.config import BenchConfig, numpy_dtype

__all__ = ["Memory", "Submitter", "TIMEOUT_S", "measure", "merge_ranks"]
TIMEOUT_S = 600.0


# -- memory of a backend ---------------------------------------------------------------------
class Memory:
    """Arrays of one library: numpy on the simulator; on GPUs torch if
    importable, else CuPy, else dfccl.bench.arrays.DeviceArray.  Transfers go
    through raw bytes so that every dtype (bfloat16 included) moves alike."""

    def __init__(self, backend: str):
        self.backend = backend
        self.lib = "numpy"
        if backend == "cuda":
            self.lib = "dfccl"
            for name in ("torch", "cupy"):
                try:
                    __import__(name)
                except ImportError:
                    continue
                self.lib = name
                break

    def empty(self, device: int, count: int, dtype: str):
        dt = numpy_dtype(dtype)
        if self.lib == "numpy":
            return np.empty(count, dtype=dt)
        if self.lib == "torch":
            import torch

            return torch.empty(count, dtype=getattr(torch, dtype), device=f"cuda:{device}")
        if self.lib == "cupy":
            import cupy

            if dtype == "bfloat16":
                raise ValueError("CuPy has no bfloat16 arrays: install torch, or use another dtype")
            with cupy.cuda.Device(device):
                return cupy.empty(count, dtype=dt)
        from dfccl.bench import arrays

        return arrays.DeviceArray(device, count, dt)

    def upload(self, arr, host: np.ndarray) -> None:
        host = np.ascontiguousarray(host)
        if self.lib == "numpy":
            arr[...] = host
        elif self.lib == "torch":
            import torch

            arr.view(torch.uint8).copy_(torch.from_numpy(host.view(np.uint8)))
        elif self.lib == "cupy":
            arr.set(host)
        else:
            arr.upload(host)

    def download(self, arr, dtype: str) -> np.ndarray:
        if self.lib == "numpy":
            return arr.copy()
        if self.lib == "torch":
            import torch

            return arr.view(torch.uint8).cpu().numpy().view(numpy_dtype(dtype))
        if self.lib == "cupy":
            return arr.get()
        return arr.download()

    def view(self, arr, start: int, stop: int):
        return arr[start:stop]

    def ptr(self, arr) -> int:
        if self.lib == "numpy":
            return arr.ctypes.data
        if self.lib == "torch":
            return arr.data_ptr()
        if self.lib == "cupy":
            return arr.data.ptr
        return arr.ptr

    def synchronize(self, device: int) -> None:
        """Uploads from pageable memory may still be in flight when the call returns."""
        if self.lib == "torch":
            import torch

            torch.cuda.synchronize(device)
        elif self.lib == "cupy":
            import cupy

            cupy.cuda.Device(device).synchronize()


# -- timing ------------------------------------------------------------------------------------
class Submitter:
    """Back-to-back submissions of bound plans; when the daemon runs out of
    slots or staging memory (ResourceError), the oldest pending collective is
    waited for and the submission retried."""

    def __init__(self, plans: list):
        self.plans = plans
        self.pending: collections.deque = collections.deque()

    def submit(self) -> None:
        from dfccl.errors import ResourceError

        for plan in self.plans:
            while True:
                try:
                    work = plan()
                    break
                except ResourceError:
                    if not self.pending:
                        raise
                    self.pending.popleft().synchronize(timeout=TIMEOUT_S)
            self.pending.append(work)

    def finish(self) -> None:
        while self.pending:
            self.pending.popleft().synchronize(timeout=TIMEOUT_S)


def _time_loop(submit: Callable[[], None], finish: Callable[[], None], iters: int, warmup: int,
               barrier: Callable[[], None] | None = None) -> float:
    """Seconds per operation, nccl-tests style: warm-up, then ``iters``
    back-to-back submissions and one synchronisation at the end."""
    for _ in range(warmup):
        submit()
    finish()
    if barrier is not None:
        barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        submit()
    finish()
    seconds = (time.perf_counter() - t0) / iters
    if barrier is not None:
        barrier()
    return seconds


def _time_blocking(submit: Callable[[], None], finish: Callable[[], None], iters: int, warmup: int,
                   barrier: Callable[[], None] | None = None) -> list[float]:
    """Seconds of each of ``iters`` operations waited for one at a time
    (nccl-tests' ``-z 1``): submit, wait for completion, repeat."""
    for _ in range(warmup):
        submit()
        finish()
    if barrier is not None:
        barrier()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        submit()
        finish()
        times.append(time.perf_counter() - t0)
    if barrier is not None:
        barrier()
    return times


def measure(submit: Callable[[], None], finish: Callable[[], None], cfg: BenchConfig,
             barrier: Callable[[], None] | None = None) -> dict:
    """{"time_us"} back to back; {"time_us" (median), "p90_us"} blocking."""
    if not cfg.blocking:
        return {"time_us": _time_loop(submit, finish, cfg.iters, cfg.warmup, barrier) * 1e6}
    times_us = np.array(_time_blocking(submit, finish, cfg.iters, cfg.warmup, barrier)) * 1e6
    return {"time_us": float(np.median(times_us)), "p90_us": float(np.percentile(times_us, 90))}


def merge_ranks(results: list[dict]) -> dict:
    """Max time (and p90, when blocking) over ranks; wrong elements summed
    (None when unchecked)."""
    wrongs = [r["wrong"] for r in results]
    merged = {"time_us": max(r["time_us"] for r in results)}
    if "p90_us" in results[0]:
        merged["p90_us"] = max(r["p90_us"] for r in results)
    return {**merged, "wrong": None if any(w is None for w in wrongs) else sum(wrongs)}
