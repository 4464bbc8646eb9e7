"""The hardware floor under a collective, measured by ``dfccl bench``: a
resident kernel (one block, launched once) answering a doorbell on the
bench's GPU, without dfccl.

- host doorbell (the floor of one collective waited for, ``-z 1``): the host
  stores a fresh sequence number into pinned, device-mapped host memory; the
  kernel sees it and stores it back into another pinned word (system-scope
  release); the host spins until it sees the answer.  Time per round trip.
- stream doorbell (the floor of back-to-back collectives, ``-z 0``): per
  operation the host enqueues a ``cuStreamWriteValue32`` of a fresh sequence
  number into a device-memory doorbell and a ``cuStreamWaitValue32`` (>=) on a
  device-memory answer the kernel writes (GPU scope); ``iters`` operations
  back to back, from the first enqueue until the stream has drained, divided
  by ``iters``.

Each is ``reps`` repetitions of ``iters`` after a warm-up; the median and the
spread (min, max) over the repetitions are reported.  The kernel leaves when
the host sets its stop word, and on its own after ``idle_timeout_s`` without a
doorbell; the host gives up after ``timeout_s`` instead of hanging.  The
kernel is compiled with NVRTC for the device's compute capability once per
process and device.

The formatting helpers at the end (the line above the table, the ratio of a
dfccl time to the floor) need no GPU.
"""

from __future__ import annotations

import ctypes
import statistics
import threading
import time
from dataclasses import dataclass

from dfccl.errors import BackendError

__all__ = ["DEFAULT_ITERS", "DEFAULT_REPS", "FLOOR_SIMULATOR", "FLOOR_SKIPPED", "DoorbellTiming", "Floor",
           "measure_floor", "floor_doc", "floor_for_timing", "floor_ratio", "format_floor_line", "format_ratio"]

DEFAULT_ITERS = 1000
DEFAULT_REPS = 5

# One thread of one block answers.  The doorbell is polled with acquire loads
# (system scope in host memory, GPU scope in device memory) and answered with
# a release store of the same scope, as the daemon does.  The stop word (host
# memory) and the deadline are looked at every 256 polls: the hot loop reads
# the doorbell alone.  report[0] is the state, report[1] the doorbells seen.
KERNEL_SOURCE = r"""
enum : unsigned int { kRunning = 1, kStopped = 2, kTimedOut = 3 };

__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
template <bool kSystem> __device__ __forceinline__ unsigned int load_acquire(const unsigned int *p) {
  unsigned int v;
  if (kSystem) asm volatile("ld.acquire.sys.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  else asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
template <bool kSystem> __device__ __forceinline__ void store_release(unsigned int *p, unsigned int v) {
  if (kSystem) asm volatile("st.release.sys.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
  else asm volatile("st.release.gpu.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

template <bool kSystem>
__device__ void echo(const unsigned int *doorbell, unsigned int *answer, const unsigned int *stop,
                     unsigned int *report, unsigned long long idle_ns) {
  if (threadIdx.x != 0) return;
  store_release<true>(&report[0], kRunning);
  unsigned int last = 0, seen = 0;  // the host starts its sequence at 1
  bool active = false;
  unsigned long long deadline = now_ns() + idle_ns;
  unsigned int state = kStopped;
  for (unsigned int polls = 1;; ++polls) {
    const unsigned int v = load_acquire<kSystem>(doorbell);
    if (v != last) {
      last = v;
      ++seen;
      store_release<kSystem>(answer, v);
      active = true;
      continue;
    }
    if ((polls & 255u) != 0) continue;
    if (load_acquire<true>(stop) != 0) break;
    const unsigned long long t = now_ns();
    if (active) {
      deadline = t + idle_ns;
      active = false;
    } else if (t > deadline) {
      state = kTimedOut;
      break;
    }
  }
  report[1] = seen;
  store_release<true>(&report[0], state);
}

extern "C" __global__ void dfccl_floor_host(const unsigned int *doorbell, unsigned int *answer,
                                            const unsigned int *stop, unsigned int *report,
                                            unsigned long long idle_ns) {
  echo<true>(doorbell, answer, stop, report, idle_ns);
}

extern "C" __global__ void dfccl_floor_device(const unsigned int *doorbell, unsigned int *answer,
                                              const unsigned int *stop, unsigned int *report,
                                              unsigned long long idle_ns) {
  echo<false>(doorbell, answer, stop, report, idle_ns);
}
"""

_RUNNING, _STOPPED, _TIMED_OUT = 1, 2, 3  # the kernel's kRunning, kStopped, kTimedOut
_STATES = {0: "not started", _RUNNING: "running", _STOPPED: "stopped", _TIMED_OUT: "timed out"}
_LINE = 128  # bytes between words written by different sides: no shared cache line
# Words of the pinned control page, in 32-bit words.
_HOST_DOORBELL, _HOST_ANSWER, _STOP, _REPORT = (i * _LINE // 4 for i in range(4))
_PAGE = 4 * _LINE
_START_TIMEOUT_S = 10.0  # a first launch may load the module and wait for other work on the GPU


@dataclass(frozen=True)
class DoorbellTiming:
    """One doorbell's time per operation over ``reps`` repetitions (us), and
    how its kernel ended: ``kernel_exit`` "stopped" (its stop word) and
    ``answered`` the doorbells it saw (warm-up included)."""

    median_us: float
    min_us: float
    max_us: float
    reps_us: tuple[float, ...]
    answered: int
    kernel_exit: str
    enqueue_us: float | None = None  # stream: the host's time to enqueue one operation (median)


@dataclass(frozen=True)
class Floor:
    """Both doorbells on one device."""

    device: int
    iters: int
    reps: int
    host: DoorbellTiming
    stream: DoorbellTiming


# -- the kernel module, once per process and device --------------------------------------------------
class _Module:
    __slots__ = ("primary_context", "module", "host_fn", "device_fn")


_modules: dict[int, _Module] = {}
_modules_lock = threading.Lock()


def _module(device: int) -> _Module:
    """The floor kernels loaded into ``device``'s primary context.  The
    context stays retained for the life of the process: the cached module
    lives in it."""
    from cuda.bindings import driver

    from dfccl.runtime import compute_capability, driver_ok, nvrtc_cubin

    with _modules_lock:
        mod = _modules.get(device)
        if mod is not None:
            return mod
        driver_ok(driver.cuInit(0), "cuInit")
        cubin = nvrtc_cubin(KERNEL_SOURCE.encode(), "bench_floor.cu", compute_capability(device), [])
        dev = driver_ok(driver.cuDeviceGet(device), "cuDeviceGet")
        mod = _Module()
        mod.primary_context = driver_ok(driver.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        driver_ok(driver.cuCtxPushCurrent(mod.primary_context), "cuCtxPushCurrent")
        try:
            mod.module = driver_ok(driver.cuModuleLoadData(cubin), "cuModuleLoadData(bench floor)")
            mod.host_fn = driver_ok(driver.cuModuleGetFunction(mod.module, b"dfccl_floor_host"),
                                    "cuModuleGetFunction(dfccl_floor_host)")
            mod.device_fn = driver_ok(driver.cuModuleGetFunction(mod.module, b"dfccl_floor_device"),
                                      "cuModuleGetFunction(dfccl_floor_device)")
        finally:
            driver_ok(driver.cuCtxPopCurrent(), "cuCtxPopCurrent")
        _modules[device] = mod
        return mod


def _word(address: int) -> ctypes.c_uint32:
    """A 32-bit word of pinned memory; every ``.value`` is a fresh load or store."""
    return ctypes.c_uint32.from_address(address)


def _await_stream(stream, deadline: float, what: str) -> bool:
    """Spins on cuStreamQuery until ``stream`` has drained (True) or
    ``deadline`` (perf_counter) passes (False)."""
    from cuda.bindings import driver

    from dfccl.runtime import driver_ok

    not_ready = driver.CUresult.CUDA_ERROR_NOT_READY
    while True:
        result = driver.cuStreamQuery(stream)
        if result[0] != not_ready:
            driver_ok(result, f"cuStreamQuery({what})")
            return True
        if time.perf_counter() > deadline:
            return False


class _Resident:
    """One resident echo kernel on its own stream, with the pinned control
    page (stop word, report) and, for the host doorbell, the doorbell and
    answer words in that page.  ``start`` launches it and waits until it
    runs; ``stop`` sets the stop word and waits until it has left."""

    def __init__(self, device: int, system: bool, idle_timeout_s: float, timeout_s: float):
        self.device = device
        self.system = system
        self.idle_timeout_s = idle_timeout_s
        self.timeout_s = timeout_s
        self.mod = _module(device)
        self.stream = None
        self.page = 0        # host address of the control page
        self.page_dev = 0    # its device address
        self.device_words = None  # device-memory doorbell and answer (stream doorbell)
        self.launched = False

    # Addresses the kernel uses.
    def doorbell_dev(self) -> int:
        return int(self.device_words) if not self.system else self.page_dev + 4 * _HOST_DOORBELL

    def answer_dev(self) -> int:
        return int(self.device_words) + _LINE if not self.system else self.page_dev + 4 * _HOST_ANSWER

    def word(self, index: int) -> ctypes.c_uint32:
        return _word(self.page + 4 * index)

    def state(self) -> str:
        return _STATES.get(self.word(_REPORT).value, f"state {self.word(_REPORT).value}")

    def start(self) -> None:
        from cuda.bindings import driver

        from dfccl.runtime import driver_ok

        self.page = int(driver_ok(driver.cuMemHostAlloc(_PAGE, driver.CU_MEMHOSTALLOC_DEVICEMAP), "cuMemHostAlloc"))
        ctypes.memset(self.page, 0, _PAGE)
        self.page_dev = int(driver_ok(driver.cuMemHostGetDevicePointer(self.page, 0), "cuMemHostGetDevicePointer"))
        self.stream = driver_ok(driver.cuStreamCreate(driver.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        if not self.system:
            self.device_words = driver_ok(driver.cuMemAlloc(2 * _LINE), "cuMemAlloc")
            # Zeroed on the kernel's stream, so before it runs.
            driver_ok(driver.cuMemsetD32Async(self.device_words, 0, 2 * _LINE // 4, self.stream), "cuMemsetD32Async")
        fn = self.mod.host_fn if self.system else self.mod.device_fn
        params = ((self.doorbell_dev(), self.answer_dev(), self.page_dev + 4 * _STOP, self.page_dev + 4 * _REPORT,
                   int(self.idle_timeout_s * 1e9)),
                  (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64))
        driver_ok(driver.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, self.stream, params, 0),
                  "cuLaunchKernel(bench floor)")
        self.launched = True
        deadline = time.perf_counter() + _START_TIMEOUT_S
        report = self.word(_REPORT)
        while report.value == 0:
            if time.perf_counter() > deadline:
                raise BackendError(f"the floor kernel on cuda:{self.device} did not start within "
                                   f"{_START_TIMEOUT_S:.0f} s")
            time.sleep(50e-6)

    def await_exit(self, timeout_s: float) -> bool:
        """Whether the kernel has left within ``timeout_s``."""
        if _await_stream(self.stream, time.perf_counter() + timeout_s, "floor kernel"):
            self.launched = False
        return not self.launched

    def answered(self) -> int:
        """Doorbells the kernel saw, once it has left."""
        return self.word(_REPORT + 1).value

    def stop(self) -> tuple[str, int]:
        """(how the kernel ended, doorbells it saw)."""
        self.word(_STOP).value = 1
        # The kernel looks at the stop word every 256 polls; it leaves by
        # itself idle_timeout_s after the last doorbell in any case.
        if not self.await_exit(self.idle_timeout_s + self.timeout_s):
            raise BackendError(f"the floor kernel on cuda:{self.device} did not leave after its stop word "
                               f"(kernel {self.state()})")
        return self.state(), self.answered()

    def close(self) -> None:
        """Stops the kernel if it still runs, then frees what ``start`` made.
        Where the kernel does not leave, its memory is left to the process:
        freeing it under a running kernel would fault it."""
        from cuda.bindings import driver

        from dfccl.runtime import driver_ok

        if self.launched:
            self.stop()
        if self.device_words is not None:
            driver_ok(driver.cuMemFree(self.device_words), "cuMemFree")
            self.device_words = None
        if self.stream is not None:
            driver_ok(driver.cuStreamDestroy(self.stream), "cuStreamDestroy")
            self.stream = None
        if self.page:
            driver_ok(driver.cuMemFreeHost(self.page), "cuMemFreeHost")
            self.page = 0

    def no_answer(self, seq: int) -> BackendError:
        return BackendError(f"the floor kernel on cuda:{self.device} did not answer doorbell {seq} within "
                            f"{self.timeout_s:.1f} s (kernel {self.state()})")


# -- the two doorbells -------------------------------------------------------------------------------
def _summary(per_op_us: list[float], answered: int, exit_state: str,
             enqueue_us: list[float] | None = None) -> DoorbellTiming:
    return DoorbellTiming(median_us=statistics.median(per_op_us), min_us=min(per_op_us), max_us=max(per_op_us),
                          reps_us=tuple(per_op_us), answered=answered, kernel_exit=exit_state,
                          enqueue_us=statistics.median(enqueue_us) if enqueue_us else None)


def _checked_exit(kernel: _Resident, rings: int, what: str) -> tuple[str, int]:
    """Stops the kernel; BackendError unless it left through its stop word
    having seen exactly the ``rings`` doorbells rung."""
    state, answered = kernel.stop()
    if state != "stopped" or answered != rings:
        raise BackendError(f"the floor kernel ({what}) on cuda:{kernel.device} ended {state!r} after "
                           f"{answered} doorbells, not 'stopped' after {rings}")
    return state, answered


def _host_doorbell(device: int, iters: int, reps: int, warmup: int, idle_timeout_s: float,
                   timeout_s: float) -> DoorbellTiming:
    from cuda.bindings import driver

    from dfccl.runtime import driver_ok

    mod = _module(device)
    driver_ok(driver.cuCtxPushCurrent(mod.primary_context), "cuCtxPushCurrent")
    kernel = _Resident(device, True, idle_timeout_s, timeout_s)
    try:
        kernel.start()
        doorbell, answer = kernel.word(_HOST_DOORBELL), kernel.word(_HOST_ANSWER)
        now = time.perf_counter
        seq = 0
        per_op_us = []
        for rep in range(reps + 1):  # repetition 0 is the warm-up
            count = warmup if rep == 0 else iters
            deadline = now() + timeout_s
            t0 = now()
            for _ in range(count):
                seq += 1
                doorbell.value = seq
                while answer.value != seq:
                    if now() > deadline:
                        raise kernel.no_answer(seq)
            if rep:
                per_op_us.append((now() - t0) / count * 1e6)
        state, answered = _checked_exit(kernel, seq, "host doorbell")
        return _summary(per_op_us, answered, state)
    finally:
        try:
            kernel.close()
        finally:
            driver_ok(driver.cuCtxPopCurrent(), "cuCtxPopCurrent")


def _stream_doorbell(device: int, iters: int, reps: int, warmup: int, idle_timeout_s: float,
                     timeout_s: float) -> DoorbellTiming:
    from cuda.bindings import driver

    from dfccl.runtime import driver_ok

    mod = _module(device)
    driver_ok(driver.cuCtxPushCurrent(mod.primary_context), "cuCtxPushCurrent")
    kernel = _Resident(device, False, idle_timeout_s, timeout_s)
    queue = None
    try:
        kernel.start()
        # The operations' own stream: the kernel's stream is busy with the kernel.
        queue = driver_ok(driver.cuStreamCreate(driver.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        doorbell = driver.CUdeviceptr(kernel.doorbell_dev())
        answer = driver.CUdeviceptr(kernel.answer_dev())
        write, wait = driver.cuStreamWriteValue32, driver.cuStreamWaitValue32
        write_flags = driver.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT
        wait_geq = driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
        now = time.perf_counter
        seq = 0
        per_op_us, enqueue_us = [], []
        for rep in range(reps + 1):  # repetition 0 is the warm-up
            count = warmup if rep == 0 else iters
            t0 = now()
            for _ in range(count):
                seq += 1
                driver_ok(write(queue, doorbell, seq, write_flags), "cuStreamWriteValue32")
                driver_ok(wait(queue, answer, seq, wait_geq), "cuStreamWaitValue32")
            enqueued = now()
            if not _await_stream(queue, enqueued + timeout_s, "stream doorbell"):
                raise kernel.no_answer(seq)
            if rep:
                per_op_us.append((now() - t0) / count * 1e6)
                enqueue_us.append((enqueued - t0) / count * 1e6)
        state, answered = _checked_exit(kernel, seq, "stream doorbell")
        return _summary(per_op_us, answered, state, enqueue_us)
    finally:
        try:
            if queue is not None:
                # Drained while the kernel still answers; where it does not,
                # the answer word is set past every sequence number so that no
                # wait is left blocking the stream.
                if not _await_stream(queue, time.perf_counter() + timeout_s, "stream doorbell"):
                    driver_ok(driver.cuMemsetD32(kernel.answer_dev(), 0xFFFFFFFF, 1), "cuMemsetD32")
                    _await_stream(queue, time.perf_counter() + timeout_s, "stream doorbell")
                driver_ok(driver.cuStreamDestroy(queue), "cuStreamDestroy")
        finally:
            try:
                kernel.close()
            finally:
                driver_ok(driver.cuCtxPopCurrent(), "cuCtxPopCurrent")


def measure_floor(device: int, iters: int = DEFAULT_ITERS, reps: int = DEFAULT_REPS, warmup: int = 100,
                  idle_timeout_s: float = 2.0, timeout_s: float = 5.0) -> Floor:
    """Both doorbells on CUDA device ``device``: ``reps`` repetitions of
    ``iters`` operations after ``warmup`` untimed ones.  BackendError when a
    driver call fails, the kernel does not answer within ``timeout_s`` or does
    not leave cleanly."""
    if iters < 1 or reps < 1 or warmup < 0:
        raise ValueError("iters and reps must be >= 1 and warmup >= 0")
    host = _host_doorbell(device, iters, reps, warmup, idle_timeout_s, timeout_s)
    stream = _stream_doorbell(device, iters, reps, warmup, idle_timeout_s, timeout_s)
    return Floor(device=device, iters=iters, reps=reps, host=host, stream=stream)


# -- in the bench's output (no GPU needed) -------------------------------------------------------------
FLOOR_SIMULATOR = "n/a (simulator)"
FLOOR_SKIPPED = "skipped (--no-floor)"


def floor_doc(floor: Floor) -> dict:
    """The JSON form of a measured floor (``"status": "measured"``)."""

    def timing(t: DoorbellTiming) -> dict:
        out = {"median_us": t.median_us, "min_us": t.min_us, "max_us": t.max_us, "reps_us": list(t.reps_us),
               "answered": t.answered, "kernel_exit": t.kernel_exit}
        if t.enqueue_us is not None:
            out["enqueue_us"] = t.enqueue_us
        return out

    return {"status": "measured", "method": "resident kernel", "device": floor.device, "iters": floor.iters,
            "reps": floor.reps, "host_doorbell": timing(floor.host), "stream_doorbell": timing(floor.stream)}


def floor_for_timing(doc: dict | None, blocking: bool) -> float | None:
    """The floor a row is compared with: the host doorbell for one
    collective waited for (``-z 1``), the stream doorbell for back-to-back
    collectives; None where no floor was measured."""
    if not doc or doc.get("status") != "measured":
        return None
    return float(doc["host_doorbell" if blocking else "stream_doorbell"]["median_us"])


def floor_ratio(time_us: float, floor_us: float | None) -> float | None:
    """dfccl's time over the floor (1: at the floor); None without a floor."""
    if floor_us is None or floor_us <= 0:
        return None
    return time_us / floor_us


def format_ratio(ratio: float | None) -> str:
    if ratio is None:
        return "n/a"
    return f"{ratio:.2f}" if ratio < 100 else f"{ratio:.0f}"


def format_floor_line(doc: dict | None) -> str:
    """The line above the table: both floors (median and spread over the
    repetitions), or why there is none."""
    if not doc:
        return "floor: not measured"
    if doc.get("status") != "measured":
        return f"floor: {doc.get('status', 'not measured')}"

    def one(name: str, t: dict) -> str:
        return f"{name} {t['median_us']:.2f} us ({t['min_us']:.2f}-{t['max_us']:.2f})"

    return (f"floor on cuda:{doc['device']} ({doc.get('method', 'resident kernel')}): "
            f"{one('host doorbell', doc['host_doorbell'])}, {one('stream doorbell', doc['stream_doorbell'])}; "
            f"median (min-max) of {doc['reps']} x {doc['iters']}")
