"""``dfccl bench``: collective speed against NCCL, following nccl-tests.

For every collective and size: one run on fresh random inputs with poisoned
outputs, checked element by element against numpy (``#wrong``); then
``warmup`` runs, then the timed runs.  Out of place and in place, then NCCL on
the same GPUs in the same invocation.  Two timings, as nccl-tests' ``-z``:

- back to back (``blocking=False``, ``-z 0``): ``iters`` submissions timed on
  the host around the loop and the final synchronisation, divided by
  ``iters`` (throughput of a stream of collectives);
- blocking (``blocking=True``, ``-z 1``): every iteration submits on every
  rank and waits for completion on every rank; the median over ``iters``
  (and the 90th percentile, in the JSON) of one collective waited for (what a
  step that synchronises after each collective sees).

- size: bytes of the buffer (all_gather: the gathered output; reduce_scatter:
  the scattered input), as in nccl-tests; count: elements of that buffer;
- algbw = size / time (GB/s, 1e9 bytes); busbw = algbw x 2(n-1)/n for
  all_reduce, x (n-1)/n for all_gather and reduce_scatter, x 1 for broadcast
  and reduce;
- ``--mode thread``: this process drives every GPU (Communicator.for_devices);
  NCCL runs one Python thread per GPU, each with its own communicator
  (ncclCommInitRank through CuPy);
- ``--mode process``: one worker process per GPU (multiprocessing spawn),
  sharing a dfccl UniqueId; NCCL through torch.distributed in the same
  workers.  Each rank times its own loop between two barriers; the reported
  time is the maximum over ranks.

NCCL is timed in place, the one form torch.distributed offers for all five
collectives; ``ratio`` = NCCL time / dfccl in-place time (above 1: dfccl
faster).

Before the table, on the first device of the run, the hardware floor
(dfccl.bench_floor: a resident kernel answering a doorbell, without dfccl);
every dfccl time is also given over it (``/floor``): the host doorbell for
``-z 1``, the stream doorbell for back to back.
"""

from __future__ import annotations

import collections
import datetime
import json
import os
import platform
import queue as queue_mod
import socket
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import numpy as np

from dfccl.bench_floor import (FLOOR_SIMULATOR, FLOOR_SKIPPED, floor_doc, floor_for_timing, floor_ratio,
                               format_floor_line, format_ratio, measure_floor)
from dfccl.errors import BackendError

__all__ = ["KINDS", "OPS", "DTYPES", "BenchConfig", "Case", "ReportError", "parse_size", "format_size",
           "bus_factor", "count_wrong", "case_sizes", "run_bench", "format_table_header", "format_row",
           "format_markdown", "timing_line", "plot_title"]

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce")
OPS = ("sum", "prod", "min", "max", "avg")
DTYPES = ("int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "bfloat16", "float32", "float64")
_REDUCING = ("all_reduce", "reduce_scatter", "reduce")
_ROOTED = ("broadcast", "reduce")
# NCCL's enum values (nccl.h), shared by CuPy's and torch's bindings.
_NCCL_DTYPE = {"int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5, "float16": 6,
               "float32": 7, "float64": 8, "bfloat16": 9}
_NCCL_OP = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}
_TIMEOUT_S = 600.0
NCCL_UNAVAILABLE_NO_GPU = "no GPU/torch"


def bus_factor(kind: str, n: int) -> float:
    """nccl-tests' busbw / algbw."""
    if kind == "all_reduce":
        return 2 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    return 1.0


def parse_size(text: str) -> int:
    """Bytes from "8", "64K", "1M", "2G" (powers of two; a trailing B is allowed)."""
    s = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    try:
        value = float(s[:-1]) * mult[s[-1]] if s and s[-1] in mult else float(s)
    except ValueError:
        raise ValueError(f"{text!r} is not a size (e.g. 8, 64K, 1M, 2G)") from None
    if value < 1 or value != int(value):
        raise ValueError(f"{text!r} is not a whole number of bytes >= 1")
    return int(value)


def format_size(n: int) -> str:
    for unit, m in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= m and n % m == 0:
            return f"{n // m}{unit}"
    return str(n)


def numpy_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise ValueError("bfloat16 needs the ml_dtypes package (pip install ml_dtypes)") from None
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


# -- configuration -------------------------------------------------------------------
@dataclass
class BenchConfig:
    kinds: list[str] = field(default_factory=lambda: ["all_reduce"])
    min_bytes: int = 32 << 20
    max_bytes: int = 32 << 20
    step_factor: int = 2
    iters: int = 20
    warmup: int = 5
    check: bool = True
    dtype: str = "float32"
    op: str = "sum"
    root: int = 0
    backend: str = "sim"
    devices: list[int] = field(default_factory=lambda: [0, 1])
    mode: str = "thread"
    path: str = "auto"
    out: str = "."
    nccl: bool = True
    plot: bool = True
    progress: bool = True
    seed: int | None = None
    blocking: bool = False
    floor: bool = True

    def validate(self) -> None:
        """ValueError with a one-line reason for anything the run would trip on."""
        for k in self.kinds:
            if k not in KINDS:
                raise ValueError(f"unknown collective {k!r} (one of {', '.join(KINDS)} or all)")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r} (one of {', '.join(DTYPES)})")
        numpy_dtype(self.dtype)
        if self.op not in OPS:
            raise ValueError(f"unknown op {self.op!r} (one of {', '.join(OPS)})")
        if self.min_bytes > self.max_bytes:
            raise ValueError(f"minbytes {self.min_bytes} is above maxbytes {self.max_bytes}")
        if self.step_factor < 2 and self.min_bytes != self.max_bytes:
            raise ValueError("stepfactor must be at least 2")
        if self.iters < 1 or self.warmup < 0:
            raise ValueError("iters must be >= 1 and warmup_iters >= 0")
        if len(self.devices) < 2:
            raise ValueError(f"needs at least two ranks, got devices {self.devices}")
        if not 0 <= self.root < len(self.devices):
            raise ValueError(f"root {self.root} is outside 0..{len(self.devices) - 1}")
        if self.mode not in ("thread", "process"):
            raise ValueError(f"mode must be thread or process, not {self.mode!r}")
        if self.mode == "process" and self.path == "direct":
            raise ValueError("path 'direct' needs every rank in one process: use --mode thread")


# -- one (collective, size) ----------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """Buffers and reference of one collective at one size on ``n`` ranks.
    ``count`` follows the Communicator.prepare_* convention (per rank for
    all_gather / reduce_scatter)."""

    kind: str
    dtype: str
    op: str
    root: int
    n: int
    count: int

    @classmethod
    def for_size(cls, kind: str, size: int, n: int, dtype: str, op: str, root: int) -> "Case":
        esize = numpy_dtype(dtype).itemsize
        per_rank = kind in ("all_gather", "reduce_scatter")
        count = max(1, size // esize // (n if per_rank else 1))
        return cls(kind, dtype, op if kind in _REDUCING else "sum", root if kind in _ROOTED else -1, n, count)

    @property
    def in_count(self) -> int:
        return self.count * (self.n if self.kind == "reduce_scatter" else 1)

    @property
    def out_count(self) -> int:
        return self.count * (self.n if self.kind == "all_gather" else 1)

    @property
    def total_count(self) -> int:
        """nccl-tests' count: elements of the larger buffer."""
        return max(self.in_count, self.out_count)

    @property
    def nbytes(self) -> int:
        return self.total_count * numpy_dtype(self.dtype).itemsize

    @property
    def redop(self) -> str:
        return self.op if self.kind in _REDUCING else "none"

    def inputs(self, seed) -> list[np.ndarray]:
        """Every rank's input, the same in every process that asks (seeded), never all zeros."""
        from dfccl.testing import scenarios as sc

        rng = np.random.default_rng(seed)
        if self.dtype == "bfloat16":
            src = "float32"
            return [sc.random_input(rng, src, self.in_count, self.op).astype(numpy_dtype("bfloat16"))
                    for _ in range(self.n)]
        return [sc.random_input(rng, self.dtype, self.in_count, self.op) for _ in range(self.n)]

    def expected(self, inputs: list[np.ndarray], rank: int) -> np.ndarray | None:
        """What rank's output must hold; None where nothing is checked (non-root of reduce)."""
        from dfccl.testing import scenarios as sc

        if self.kind == "all_gather":
            return np.concatenate(inputs)
        if self.kind == "broadcast":
            return inputs[self.root]
        if self.kind == "reduce" and rank != self.root:
            return None
        if self.dtype == "bfloat16":
            # dfccl and NCCL accumulate bfloat16 in float32.
            total = sc.reduce_reference([a.astype(np.float32) for a in inputs], self.op).astype(inputs[0].dtype)
        else:
            total = sc.reduce_reference(inputs, self.op)
        if self.kind == "reduce_scatter":
            return total[rank * self.count:(rank + 1) * self.count]
        return total

    def initial(self, inputs: list[np.ndarray], rank: int, in_place: bool,
                want: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
        """(send contents, recv contents) before the checked run.  Out of place,
        recv is poisoned: NaN for floats, the bitwise complement of the
        expected value for integers (so an unwritten element never passes).
        In place, the single buffer (all_gather: the output) is returned as
        send and recv is None."""
        x = inputs[rank]
        if not in_place:
            return x, self._poison(want, self.out_count)
        if self.kind == "all_gather":
            full = self._poison(want, self.out_count)
            full[rank * self.count:(rank + 1) * self.count] = x
            return full, None
        return x, None

    def _poison(self, want: np.ndarray | None, count: int) -> np.ndarray:
        dt = numpy_dtype(self.dtype)
        if dt.kind in "iu" and want is not None and want.size == count:
            return np.invert(want)
        if dt.kind in "iu":
            return np.full(count, np.iinfo(dt).max, dtype=dt)
        return np.full(count, np.nan, dtype=np.float32).astype(dt)

    def in_place_views(self, buf, rank: int, mem: "_Memory"):
        """(send, recv) views of one buffer in NCCL's in-place forms."""
        c = self.count
        if self.kind == "all_gather":
            return mem.view(buf, rank * c, (rank + 1) * c), buf
        if self.kind == "reduce_scatter":
            return buf, mem.view(buf, rank * c, (rank + 1) * c)
        return buf, buf


def count_wrong(got: np.ndarray, want: np.ndarray | None, dtype: str, op: str, n: int) -> int:
    """Elements off the reference: integers exactly, floats within the
    tolerance of dfccl's tests; NaN and infinities are always wrong."""
    if want is None:
        return 0
    from dfccl.testing import scenarios as sc

    if numpy_dtype(dtype).kind in "iu":
        return int(np.count_nonzero(got != want))
    tol = 2e-2 * max(1, n) if dtype == "bfloat16" else sc.tolerance(dtype, op, n)
    g = got.astype(np.float64)
    w = want.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        bad = ~np.isfinite(g) | (np.abs(g - w) / (np.abs(w) + 1.0) > tol)
    return int(np.count_nonzero(bad))


def case_sizes(cfg: BenchConfig, kind: str) -> list[Case]:
    """The sweep of one collective, without sizes that round to the same buffer."""
    cases: list[Case] = []
    size = cfg.min_bytes
    while size <= cfg.max_bytes:
        c = Case.for_size(kind, size, len(cfg.devices), cfg.dtype, cfg.op, cfg.root)
        if not cases or cases[-1].count != c.count:
            cases.append(c)
        if cfg.step_factor < 2:
            break
        size *= cfg.step_factor
    return cases


# -- memory of a backend ---------------------------------------------------------------------
class _Memory:
    """Arrays of one library: numpy on the simulator; on GPUs torch if
    importable, else CuPy, else dfccl.testing.arrays.DeviceArray.  Transfers go
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
        from dfccl.testing import arrays

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
class _Submitter:
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
                    self.pending.popleft().synchronize(timeout=_TIMEOUT_S)
            self.pending.append(work)

    def finish(self) -> None:
        while self.pending:
            self.pending.popleft().synchronize(timeout=_TIMEOUT_S)


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


def _measure(submit: Callable[[], None], finish: Callable[[], None], cfg: BenchConfig,
             barrier: Callable[[], None] | None = None) -> dict:
    """{"time_us"} back to back; {"time_us" (median), "p90_us"} blocking."""
    if not cfg.blocking:
        return {"time_us": _time_loop(submit, finish, cfg.iters, cfg.warmup, barrier) * 1e6}
    times_us = np.array(_time_blocking(submit, finish, cfg.iters, cfg.warmup, barrier)) * 1e6
    return {"time_us": float(np.median(times_us)), "p90_us": float(np.percentile(times_us, 90))}


def _seed(base: int, kind: str, case: Case, placement: str) -> np.random.SeedSequence:
    """The same in every worker process (str hashes are salted per process: not used)."""
    return np.random.SeedSequence([base, KINDS.index(kind), case.count, ("oop", "ip", "nccl").index(placement)])


# -- dfccl: every rank in this process ---------------------------------------------------------------
def _dfccl_thread_case(case: Case, comms: list, mem: _Memory, devices: list[int], cfg: BenchConfig,
                       base_seed: int) -> dict:
    out: dict[str, dict] = {}
    for placement in ("oop", "ip"):
        in_place = placement == "ip"
        bufs = []
        for r, dev in enumerate(devices):
            if in_place:
                one = mem.empty(dev, case.out_count if case.kind == "all_gather" else case.in_count, case.dtype)
                bufs.append((one, *case.in_place_views(one, r, mem)))
            else:
                s, rv = mem.empty(dev, case.in_count, case.dtype), mem.empty(dev, case.out_count, case.dtype)
                bufs.append((None, s, rv))
        tag = ("bench", case.kind, case.count, placement)
        plans = []
        for r, c in enumerate(comms):
            prep = getattr(c, f"prepare_{case.kind}")
            kw: dict[str, Any] = {"tag": tag}
            if case.kind in _REDUCING:
                kw["op"] = case.op
            if case.kind in _ROOTED:
                kw["root"] = case.root
            plans.append(prep(case.count, case.dtype, **kw).bind(bufs[r][1], bufs[r][2]))
        sub = _Submitter(plans)
        wrong = None
        if cfg.check:
            inputs = case.inputs(_seed(base_seed, case.kind, case, placement))
            wants = [case.expected(inputs, r) for r in range(case.n)]
            for r, (one, s, rv) in enumerate(bufs):
                send_host, recv_host = case.initial(inputs, r, in_place, wants[r])
                mem.upload(one if in_place else s, send_host)
                if recv_host is not None:
                    mem.upload(rv, recv_host)
            for dev in set(devices):
                mem.synchronize(dev)
            sub.submit()
            sub.finish()
            wrong = sum(count_wrong(mem.download(bufs[r][2], case.dtype), wants[r], case.dtype, case.op, case.n)
                        for r in range(case.n))
        out[placement] = {**_measure(sub.submit, sub.finish, cfg), "wrong": wrong}
    return out


# -- NCCL: one thread per GPU (CuPy) -------------------------------------------------------------------
class _CupyNccl:
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

    def run_case(self, case: Case, mem: _Memory, cfg: BenchConfig, base_seed: int) -> dict:
        """In place: every thread checks, then times its own loop between barriers."""
        import cupy

        barrier = threading.Barrier(self.n, timeout=_TIMEOUT_S)
        results: list[dict] = [{} for _ in range(self.n)]
        inputs = case.inputs(_seed(base_seed, case.kind, case, "nccl")) if cfg.check else None

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
            timing = _measure(lambda: self.enqueue(r, case, sp, rp), self.streams[r].synchronize, cfg, barrier.wait)
            results[r] = {**timing, "wrong": wrong}

        self._run_threads(rank_job)
        return _merge_ranks(results)

    def close(self) -> None:
        for c in self.comms:
            if c is not None:
                c.destroy()
        self.comms = []


def _merge_ranks(results: list[dict]) -> dict:
    """Max time (and p90, when blocking) over ranks; wrong elements summed
    (None when unchecked)."""
    wrongs = [r["wrong"] for r in results]
    merged = {"time_us": max(r["time_us"] for r in results)}
    if "p90_us" in results[0]:
        merged["p90_us"] = max(r["p90_us"] for r in results)
    return {**merged, "wrong": None if any(w is None for w in wrongs) else sum(wrongs)}


def _nccl_thread_status(cfg: BenchConfig) -> str | None:
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
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _set_nccl_env() -> None:
    # NVLink multicast (NVLS) stays off: it is unavailable on the machines this
    # project runs on and may not be enabled there.
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


def _torch_nccl_status() -> str | None:
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


def _worker(rank: int, cfg_dict: dict, uid, use_nccl: bool, torch_port: int, base_seed: int, barrier,
            results) -> None:
    """One rank of ``--mode process``: its dfccl communicator and, with
    ``use_nccl``, its torch.distributed NCCL process group."""
    try:
        _set_nccl_env()
        _worker_body(rank, BenchConfig(**cfg_dict), uid, use_nccl, torch_port, base_seed, barrier, results)
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))


def _worker_body(rank: int, cfg: BenchConfig, uid, use_nccl: bool, torch_port: int, base_seed: int, barrier,
                 results) -> None:
    import dfccl

    n, dev = len(cfg.devices), cfg.devices[rank]
    wait = lambda: barrier.wait(_TIMEOUT_S)  # noqa: E731
    mem = _Memory(cfg.backend)
    comm = dfccl.Communicator(uid, rank, n, device=dev, backend=cfg.backend,
                              options=dfccl.CommOptions(path=cfg.path))
    nccl_version = None
    if use_nccl:
        import torch
        import torch.distributed as dist

        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{torch_port}", rank=rank, world_size=n)
        nccl_version = ".".join(str(v) for v in torch.cuda.nccl.version())
    results.put(("ready", rank, {"path": comm.path, "channels": comm.channels, "nccl_version": nccl_version,
                                 "memory": mem.lib}))
    for kind in cfg.kinds:
        for case in case_sizes(cfg, kind):
            row: dict[str, Any] = {}
            for placement in ("oop", "ip"):
                row[placement] = _dfccl_rank_case(case, comm, rank, dev, mem, cfg, base_seed, placement, wait)
            if use_nccl:
                dfccl.device_synchronize(cfg.backend, dev)  # NCCL runs on a GPU the daemon has left
                row["nccl"] = _torch_rank_case(case, rank, dev, mem, cfg, base_seed, wait)
            results.put(("case", rank, (kind, case.count, row)))
    wait()
    comm.close()
    if use_nccl:
        import torch.distributed as dist

        dist.destroy_process_group()
    results.put(("done", rank, None))


def _dfccl_rank_case(case: Case, comm, rank: int, dev: int, mem: _Memory, cfg: BenchConfig, base_seed: int,
                     placement: str, wait) -> dict:
    in_place = placement == "ip"
    if in_place:
        one = mem.empty(dev, case.out_count if case.kind == "all_gather" else case.in_count, case.dtype)
        s, rv = case.in_place_views(one, rank, mem)
    else:
        one, s, rv = None, mem.empty(dev, case.in_count, case.dtype), mem.empty(dev, case.out_count, case.dtype)
    kw: dict[str, Any] = {"tag": ("bench", case.kind, case.count, placement)}
    if case.kind in _REDUCING:
        kw["op"] = case.op
    if case.kind in _ROOTED:
        kw["root"] = case.root
    sub = _Submitter([getattr(comm, f"prepare_{case.kind}")(case.count, case.dtype, **kw).bind(s, rv)])
    wrong = None
    if cfg.check:
        inputs = case.inputs(_seed(base_seed, case.kind, case, placement))
        want = case.expected(inputs, rank)
        send_host, recv_host = case.initial(inputs, rank, in_place, want)
        mem.upload(one if in_place else s, send_host)
        if recv_host is not None:
            mem.upload(rv, recv_host)
        mem.synchronize(dev)
        sub.submit()
        sub.finish()
        wrong = count_wrong(mem.download(rv, case.dtype), want, case.dtype, case.op, case.n)
    wait()
    return {**_measure(sub.submit, sub.finish, cfg, wait), "wrong": wrong}


def _torch_rank_case(case: Case, rank: int, dev: int, mem: _Memory, cfg: BenchConfig, base_seed: int,
                     wait) -> dict:
    import torch

    tmem = mem  # torch is importable here, so the arrays are torch tensors
    buf = torch.empty(case.out_count if case.kind == "all_gather" else case.in_count,
                      dtype=getattr(torch, case.dtype), device=f"cuda:{dev}")
    s, rv = case.in_place_views(buf, rank, tmem)
    wrong = None
    if cfg.check:
        inputs = case.inputs(_seed(base_seed, case.kind, case, "nccl"))
        want = case.expected(inputs, rank)
        tmem.upload(buf, case.initial(inputs, rank, True, want)[0])
        torch.cuda.synchronize(dev)
        _torch_collective(case, s, rv)
        torch.cuda.synchronize(dev)
        wrong = count_wrong(tmem.download(rv, case.dtype), want, case.dtype, case.op, case.n)
    wait()
    # Blocking: torch.cuda.synchronize after every collective waits for it on the device.
    timing = _measure(lambda: _torch_collective(case, s, rv), lambda: torch.cuda.synchronize(dev), cfg, wait)
    return {**timing, "wrong": wrong}


# -- output -------------------------------------------------------------------------------------------
_HEAD_COLS = f"{'size':>12} {'count':>12} {'type':>9} {'redop':>6} {'root':>5}"
_DF_COLS = f"{'time':>9} {'/floor':>7} {'algbw':>7} {'busbw':>7} {'#wrong':>7}"
_NCCL_COLS = f"{'time':>9} {'busbw':>7} {'#wrong':>7} {'ratio':>6}"


def timing_line(blocking: bool, iters: int) -> str:
    """What the time columns hold, for the table header."""
    if blocking:
        return (f"timing: blocking (-z 1): time = median of {iters} collectives, each submitted on every rank "
                "and waited for on every rank (p90 in the JSON); /floor = time / host doorbell floor")
    return (f"timing: back to back (-z 0): time = {iters} submissions and one wait at the end, "
            "divided by the iterations; /floor = time / stream doorbell floor")


def format_table_header(kind: str, nccl_line: str, timing: str | None = None) -> str:
    """The column header of one collective's table; ``timing`` (see
    :func:`timing_line`) says which timing the time columns hold."""
    width_head, width_df = len(_HEAD_COLS), len(_DF_COLS)
    groups = (f"#{'':{width_head - 1}}  {'out-of-place':^{width_df}}  {'in-place':^{width_df}}  "
              f"{'NCCL (in place)':^{len(_NCCL_COLS)}}")
    df_units = f"{'(us)':>9} {'':>7} {'(GB/s)':>7} {'(GB/s)':>7} {'':>7}"
    units = (f"#{'(B)':>11} {'(elements)':>12} {'':>9} {'':>6} {'':>5}  {df_units}  {df_units}  "
             f"{'(us)':>9} {'(GB/s)':>7}")
    lines = [f"# collective {kind}", f"# {nccl_line}"] + ([f"# {timing}"] if timing else [])
    return "\n".join(lines + [groups, f"#{_HEAD_COLS[1:]}  {_DF_COLS}  {_DF_COLS}  {_NCCL_COLS}", units])


def _fmt_wrong(w: int | None) -> str:
    return "N/A" if w is None else str(w)


def format_row(row: dict) -> str:
    def lib(d: dict) -> str:
        return (f"{d['time_us']:9.2f} {format_ratio(d.get('floor_ratio')):>7} {d['algbw']:7.2f} {d['busbw']:7.2f} "
                f"{_fmt_wrong(d['wrong']):>7}")

    line = (f"{row['size']:12d} {row['count']:12d} {row['type']:>9} {row['redop']:>6} {row['root']:5d}  "
            f"{lib(row['out_of_place'])}  {lib(row['in_place'])}  ")
    nccl = row.get("nccl")
    if nccl is None:
        return line + f"{'n/a':>9} {'n/a':>7} {'n/a':>7} {'n/a':>6}"
    return line + f"{nccl['time_us']:9.2f} {nccl['busbw']:7.2f} {_fmt_wrong(nccl['wrong']):>7} {row['ratio']:6.2f}"


class ReportError(ValueError):
    """A JSON document that is not a ``dfccl bench`` result."""


def _human_size(n: int) -> str:
    for unit, m in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= m and n % m == 0:
            return f"{n // m} {unit}"
    return f"{n} B"


def _capitalised(text: str) -> str:
    return text[:1].upper() + text[1:]


def format_markdown(doc: dict) -> str:
    """Markdown tables of a result JSON written by :func:`run_bench`: a line
    on the run, then one table per collective.  Blocking results show the
    median with the 90th percentile in parentheses.  ReportError when
    ``doc`` is not such a result."""
    try:
        return _markdown(doc)
    except (KeyError, TypeError, IndexError) as exc:
        raise ReportError(f"not a dfccl bench result (missing or malformed {exc})") from None


def _markdown(doc: dict) -> str:
    cfg, rows = doc["config"], doc["rows"]
    blocking = bool(doc.get("timing", {}).get("blocking", False))  # results from before -z have no "timing"
    versions = doc.get("versions", {})
    df, nccl_info = doc.get("dfccl", {}), doc.get("nccl", {})
    gpus = doc.get("gpus") or []
    status = nccl_info.get("status", "measured")
    nccl_state = (f"NCCL {versions.get('nccl', '?')}, {nccl_info.get('form', 'in place')}" if status == "measured"
                  else _nccl_unavailable_line(status))
    out = [f"## dfccl bench: {len(gpus)} x {gpus[0] if gpus else '?'}, {doc['mode']} mode, "
           f"{'blocking (-z 1)' if blocking else 'back to back (-z 0)'}", "",
           f"{doc.get('date', '?')} on {doc.get('host', '?')}; dfccl {versions.get('dfccl', '?')} "
           f"(path {df.get('path')}, {df.get('channels')} channels); {nccl_state}; {cfg['dtype']} {cfg['op']}; "
           f"{cfg['iters']} iterations after {cfg['warmup']} warm-up.",
           "Time: median of one collective waited for on every rank (90th percentile in parentheses)."
           if blocking else "Time: back-to-back collectives, loop time divided by the iterations.",
           f"{_capitalised(format_floor_line(doc.get('floor')))}.",
           f"/ floor: dfccl's time over the {'host' if blocking else 'stream'} doorbell floor (1: at the floor).",
           "NCCL / dfccl: NCCL time over dfccl's in-place time (above 1: dfccl faster).", ""]

    def cell(d: dict | None) -> str:
        if d is None:
            return "n/a"
        p90 = f" ({d['p90_us']:.1f})" if "p90_us" in d else ""
        return f"{d['time_us']:.1f}{p90}"

    def bw(d: dict | None) -> str:
        return "n/a" if d is None else f"{d['busbw']:.2f}"

    def over_floor(d: dict) -> str:
        return format_ratio(d.get("floor_ratio"))  # results from before the floor have none

    kinds = [k for k in KINDS if any(r["kind"] == k for r in rows)]
    kinds += sorted({r["kind"] for r in rows} - set(kinds))
    for kind in kinds:
        out += [f"### {kind}", "",
                "| size | count | type | redop | root | out of place (us) | / floor | busbw (GB/s) | in place (us) | "
                "/ floor | busbw (GB/s) | NCCL in place (us) | NCCL busbw (GB/s) | NCCL / dfccl | #wrong |",
                "|---:|---:|:--|:--|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            if r["kind"] != kind:
                continue
            parts = [r["out_of_place"], r["in_place"]] + ([r["nccl"]] if r.get("nccl") else [])
            wrongs = [p["wrong"] for p in parts]
            wrong = "N/A" if any(w is None for w in wrongs) else str(sum(wrongs))
            ratio = "n/a" if r.get("ratio") is None else f"{r['ratio']:.2f}"
            oop, ip = r["out_of_place"], r["in_place"]
            out.append(f"| {_human_size(r['size'])} | {r['count']} | {r['type']} | {r['redop']} | {r['root']} | "
                       f"{cell(oop)} | {over_floor(oop)} | {bw(oop)} | {cell(ip)} | {over_floor(ip)} | {bw(ip)} | "
                       f"{cell(r.get('nccl'))} | {bw(r.get('nccl'))} | {ratio} | {wrong} |")
        out.append("")
    return "\n".join(out)


def _finish_row(kind: str, case: Case, measured: dict, floor_us: float | None = None) -> dict:
    """A table row; ``floor_us`` (the floor of this timing, or None) gives
    each dfccl form its ``floor_ratio``."""
    def with_bw(d: dict) -> dict:
        algbw = case.nbytes / (d["time_us"] * 1e-6) / 1e9
        return {**d, "algbw": algbw, "busbw": algbw * bus_factor(kind, case.n)}

    def dfccl_form(d: dict) -> dict:
        return {**with_bw(d), "floor_ratio": floor_ratio(d["time_us"], floor_us)}

    row = {"kind": kind, "size": case.nbytes, "count": case.total_count, "type": case.dtype, "redop": case.redop,
           "root": case.root, "out_of_place": dfccl_form(measured["oop"]), "in_place": dfccl_form(measured["ip"]),
           "nccl": None, "ratio": None}
    if measured.get("nccl") is not None:
        row["nccl"] = with_bw(measured["nccl"])
        row["ratio"] = row["nccl"]["time_us"] / row["in_place"]["time_us"]
    return row


class _Progress:
    """tqdm over the sweep when it is installed and stderr is a terminal;
    otherwise the table rows are the progress."""

    def __init__(self, total: int, enabled: bool):
        self.bar = None
        if enabled and sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="size", leave=False, file=sys.stderr)
            except ImportError:
                pass

    def write(self, line: str, out) -> None:
        if self.bar is not None and out is sys.stdout:
            self.bar.write(line, file=out)
        else:
            print(line, file=out, flush=True)

    def step(self, what: str) -> None:
        if self.bar is not None:
            self.bar.set_description(what)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _versions() -> dict:
    from importlib import metadata

    import dfccl

    out = {"dfccl": dfccl.__version__, "python": platform.python_version(), "numpy": np.__version__}
    for dist_name in ("cuda-bindings", "torch", "cupy-cuda13x", "cupy-cuda12x"):
        try:
            out[dist_name] = metadata.version(dist_name)
        except metadata.PackageNotFoundError:
            pass
    return out


def _gpu_names(backend: str, devices: list[int]) -> list[str]:
    if backend != "cuda":
        return ["simulated GPU" for _ in devices]
    try:
        from cuda.bindings import driver

        driver.cuInit(0)
        names = []
        for d in devices:
            _, dev = driver.cuDeviceGet(d)
            _, raw = driver.cuDeviceGetName(64, dev)
            names.append(raw.split(b"\0", 1)[0].decode())
        return names
    except Exception:
        return [f"cuda:{d}" for d in devices]


def plot_title(rows: list[dict], *, ranks: int, gpu: str, mode: str, dtype: str, blocking: bool) -> str:
    """The plot's title, naming what ran: NCCL only where some size of it
    was measured."""
    ran = "dfccl vs NCCL" if any(r.get("nccl") for r in rows) else "dfccl"
    timing = "blocking: median of one collective waited for" if blocking else "back to back"
    return f"{ran}, {ranks} x {gpu} ({mode} mode, {dtype}, {timing})"


def _write_plot(path: str, rows: list[dict], title: str, floor_us: float | None = None) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig = _plot_figure(plt, rows, title)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _plot_figure(plt, rows: list[dict], title: str):
    kinds = [k for k in KINDS if any(r["kind"] == k for r in rows)]
    # Constrained layout makes room for the figure title above the panels
    # (tight_layout lets a tall figure's title run into its first row).
    fig, axes = plt.subplots(len(kinds), 2, figsize=(11, 3.6 * len(kinds)), squeeze=False, layout="constrained")
    for i, kind in enumerate(kinds):
        rs = [r for r in rows if r["kind"] == kind]
        sizes = [r["size"] for r in rs]
        series = [("dfccl out of place", "out_of_place", "-o"), ("dfccl in place", "in_place", "-s"),
                  ("NCCL (in place)", "nccl", "--^")]
        for label, key, style in series:
            pts = [(s, r[key]) for s, r in zip(sizes, rs) if r.get(key) is not None]
            if not pts:
                continue
            xs = [p[0] for p in pts]
            axes[i][0].plot(xs, [p[1]["time_us"] for p in pts], style, label=label, markersize=4)
            axes[i][1].plot(xs, [p[1]["busbw"] for p in pts], style, label=label, markersize=4)
        if floor_us is not None:
            axes[i][0].axhline(floor_us, color="gray", linestyle=":", label=f"floor ({floor_us:.1f} us)")
        for j, ylabel in enumerate(("latency (us)", "busbw (GB/s)")):
            ax = axes[i][j]
            ax.set_xscale("log", base=2)
            if j == 0:
                ax.set_yscale("log")
            ax.set_xlabel("size (bytes)")
            ax.set_ylabel(ylabel)
            ax.set_title(kind)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(title, wrap=True)
    return fig


# -- the run ------------------------------------------------------------------------------------------
def run_bench(cfg: BenchConfig, out=sys.stdout) -> dict:
    """Runs the sweep, prints the table, writes JSON (and PNG) under
    ``cfg.out``.  Returns the JSON document plus the paths written."""
    cfg.validate()
    _set_nccl_env()
    n = len(cfg.devices)
    base_seed = cfg.seed if cfg.seed is not None else int.from_bytes(os.urandom(4), "little")
    started = datetime.datetime.now()
    total = sum(len(case_sizes(cfg, k)) for k in cfg.kinds)
    print(f"# dfccl bench: {', '.join(cfg.kinds)}; {n} ranks on {cfg.backend} devices {cfg.devices}; "
          f"mode {cfg.mode}; {cfg.dtype} {cfg.op}; iters {cfg.iters}, warmup {cfg.warmup}, "
          f"check {int(cfg.check)}, blocking {int(cfg.blocking)}", file=out, flush=True)
    floor = _measure_floor(cfg)
    print(f"# {format_floor_line(floor)}", file=out, flush=True)
    floor_us = floor_for_timing(floor, cfg.blocking)
    if cfg.mode == "thread":
        rows, info = _run_thread_mode(cfg, base_seed, total, out, floor_us)
    else:
        rows, info = _run_process_mode(cfg, base_seed, total, out, floor_us)
    checked = [r for r in rows if r["out_of_place"]["wrong"] is not None]
    wrong = sum(r[k]["wrong"] or 0 for r in checked for k in ("out_of_place", "in_place"))
    wrong += sum((r["nccl"] or {}).get("wrong") or 0 for r in rows)
    busbw = [r["in_place"]["busbw"] for r in rows] + [r["out_of_place"]["busbw"] for r in rows]
    print(f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}", file=out)
    print(f"# Avg bus bandwidth    : {sum(busbw) / max(1, len(busbw)):.4f} GB/s (dfccl)", file=out)
    doc = {
        "date": started.isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "backend": cfg.backend,
        "mode": cfg.mode,
        "gpus": _gpu_names(cfg.backend, cfg.devices),
        "devices": cfg.devices,
        "versions": {**_versions(), **({"nccl": info["nccl_version"]} if info.get("nccl_version") else {})},
        "dfccl": {"path": info.get("path"), "channels": info.get("channels"), "memory": info.get("memory")},
        "nccl": {"status": info.get("nccl") or "measured", "form": "in place"},
        "timing": {"blocking": cfg.blocking,
                   "time_us": "median of one collective waited for" if cfg.blocking
                   else "back to back: loop time / iters",
                   **({"p90_us": "90th percentile of one collective waited for"} if cfg.blocking else {})},
        "config": {**{k: v for k, v in asdict(cfg).items() if k not in ("out", "progress")}, "seed": base_seed},
        "floor": floor,
        "wrong_total": wrong,
        "rows": rows,
    }
    os.makedirs(cfg.out, exist_ok=True)
    timing = "-blocking" if cfg.blocking else ""
    stem = os.path.join(cfg.out, f"dfccl-bench-{started:%Y%m%d-%H%M%S}-{cfg.backend}-{cfg.mode}-{n}ranks{timing}")
    with open(stem + ".json", "w") as f:
        json.dump(doc, f, indent=1)
    written = [stem + ".json"]
    if cfg.plot and rows:
        title = plot_title(rows, ranks=n, gpu=doc["gpus"][0], mode=cfg.mode, dtype=cfg.dtype, blocking=cfg.blocking)
        if _write_plot(stem + ".png", rows, title, floor_us):
            written.append(stem + ".png")
        else:
            print("# plot skipped: matplotlib is not installed (pip install 'dfccl[bench]')", file=out)
    for path in written:
        print(f"# wrote {path}", file=out)
    doc["written"] = written
    return doc


def _measure_floor(cfg: BenchConfig) -> dict:
    """The floor's JSON (dfccl.bench_floor) on the run's first device, before
    any daemon runs there; a failed measurement is reported, not fatal (the
    collectives' numbers stand without it)."""
    if cfg.backend != "cuda":
        return {"status": FLOOR_SIMULATOR}
    if not cfg.floor:
        return {"status": FLOOR_SKIPPED}
    try:
        return floor_doc(measure_floor(cfg.devices[0]))
    except BackendError as exc:
        return {"status": f"failed ({str(exc).splitlines()[0]})"}


def _nccl_unavailable_line(status: str) -> str:
    return f"NCCL: {status}" if status.startswith("disabled") else f"NCCL: not available ({status})"


def _run_thread_mode(cfg: BenchConfig, base_seed: int, total: int, out,
                     floor_us: float | None) -> tuple[list[dict], dict]:
    import dfccl

    mem = _Memory(cfg.backend)
    comms = dfccl.Communicator.for_devices(cfg.devices, backend=cfg.backend,
                                           options=dfccl.CommOptions(path=cfg.path))
    status = _nccl_thread_status(cfg)
    nccl = None
    version = None
    if status is None:
        nccl = _CupyNccl(cfg.devices)
        v = nccl.version
        version = f"{v // 10000}.{v // 100 % 100}.{v % 100}"
    info = {"path": comms[0].path, "channels": comms[0].channels, "nccl": status, "nccl_version": version,
            "memory": mem.lib}
    line = (f"NCCL {version}: one thread per GPU (CuPy, ncclCommInitRank), in place" if nccl is not None
            else _nccl_unavailable_line(status or ""))
    print(f"# dfccl: path {comms[0].path}, {comms[0].channels} channels, arrays: {mem.lib}", file=out)
    rows: list[dict] = []
    progress = _Progress(total, cfg.progress)
    try:
        for kind in cfg.kinds:
            progress.write(format_table_header(kind, line, timing_line(cfg.blocking, cfg.iters)), out)
            for case in case_sizes(cfg, kind):
                measured = _dfccl_thread_case(case, comms, mem, cfg.devices, cfg, base_seed)
                if nccl is not None:
                    # The daemons leave the GPUs when idle; NCCL runs on GPUs they have left.
                    for dev in sorted(set(cfg.devices)):
                        dfccl.device_synchronize(cfg.backend, dev)
                    measured["nccl"] = nccl.run_case(case, mem, cfg, base_seed)
                row = _finish_row(kind, case, measured, floor_us)
                rows.append(row)
                progress.write(format_row(row), out)
                progress.step(f"{kind} {format_size(case.nbytes)}")
    finally:
        progress.close()
        for c in comms:
            c.close()
        if nccl is not None:
            nccl.close()
    return rows, info


def _run_process_mode(cfg: BenchConfig, base_seed: int, total: int, out,
                      floor_us: float | None) -> tuple[list[dict], dict]:
    import multiprocessing

    import dfccl

    n = len(cfg.devices)
    ctx = multiprocessing.get_context("spawn")
    uid = dfccl.UniqueId.create()
    barrier = ctx.Barrier(n)
    results = ctx.Queue()
    # Decided once, here, so that every rank agrees on joining the process group.
    status = "disabled (--no-nccl)" if not cfg.nccl else (
        _torch_nccl_status() if cfg.backend == "cuda" else NCCL_UNAVAILABLE_NO_GPU)
    port = _free_port()
    cfg_dict = asdict(cfg)
    procs = [ctx.Process(target=_worker, args=(r, cfg_dict, uid, status is None, port, base_seed, barrier, results),
                         name=f"dfccl-bench-rank{r}", daemon=True) for r in range(n)]
    for p in procs:
        p.start()
    inbox = _Inbox(results, procs)
    rows: list[dict] = []
    progress = _Progress(total, cfg.progress)
    try:
        info = dict(inbox.take("ready"))
        for _ in range(n - 1):
            inbox.take("ready")
        info["nccl"] = status
        line = (f"NCCL {info['nccl_version']}: one process per GPU (torch.distributed), in place"
                if status is None else _nccl_unavailable_line(status))
        print(f"# dfccl: path {info['path']}, {info['channels']} channels, arrays: {info['memory']}; "
              f"{n} worker processes", file=out)
        shared = sorted({d for d in cfg.devices if cfg.devices.count(d) > 1})
        if cfg.backend == "cuda" and shared:
            # Kernels of different processes do not run side by side on one
            # GPU (without MPS the GPU time-slices between their contexts), so
            # every collective waits for the other daemons' time slices.
            print(f"# note: several processes share GPU {', '.join(map(str, shared))}: the GPU time-slices between "
                  "processes, so each collective takes milliseconds; these times say nothing about one process "
                  "per GPU", file=out)
        for kind in cfg.kinds:
            progress.write(format_table_header(kind, line, timing_line(cfg.blocking, cfg.iters)), out)
            for case in case_sizes(cfg, kind):
                parts = [inbox.take("case", (kind, case.count))[2] for _ in range(n)]
                measured = {key: _merge_ranks([p[key] for p in parts]) for key in parts[0]}
                row = _finish_row(kind, case, measured, floor_us)
                rows.append(row)
                progress.write(format_row(row), out)
                progress.step(f"{kind} {format_size(case.nbytes)}")
        for _ in range(n):
            inbox.take("done")
        for p in procs:
            p.join(timeout=60)
    finally:
        progress.close()
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
        uid.close()
    return rows, info


class WorkerError(RuntimeError):
    """A worker process of ``--mode process`` failed."""


class _Inbox:
    """Messages from the workers.  Ranks put independently, so messages of
    different ranks may arrive out of order: unexpected ones wait in a backlog."""

    def __init__(self, results, procs: list):
        self.results = results
        self.procs = procs
        self.backlog: list[tuple[str, int, Any]] = []

    def take(self, what: str, key: tuple | None = None):
        def matches(msg) -> bool:
            return msg[0] == what and (key is None or tuple(msg[2][:2]) == key)

        for i, msg in enumerate(self.backlog):
            if matches(msg):
                return self.backlog.pop(i)[2]
        deadline = time.monotonic() + _TIMEOUT_S
        while True:
            try:
                msg = self.results.get(timeout=1.0)
            except queue_mod.Empty:
                dead = [p for p in self.procs if not p.is_alive() and p.exitcode not in (0, None)]
                if dead:
                    raise WorkerError(f"worker {dead[0].name} exited with code {dead[0].exitcode}") from None
                if time.monotonic() > deadline:
                    raise WorkerError(f"no {what!r} message from the workers in {_TIMEOUT_S:.0f} s") from None
                continue
            if msg[0] == "error":
                raise WorkerError(f"rank {msg[1]} failed:\n{msg[2]}")
            if matches(msg):
                return msg[2]
            self.backlog.append(msg)
