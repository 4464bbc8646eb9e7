"""What a host <-> device handoff costs on this machine.
1. in-kernel: latency of dependent reads of pinned host memory (one thread 8 B,
   a warp reading 1, 2, 4 lines), and of device memory;
2. ping-pong host -> device -> host (device answers into pinned host memory):
   a) host stores a flag into pinned memory, the device polls host memory;
   b) host cuStreamWriteValue64 into device memory (private stream), device polls device memory;
   c) host cuMemcpyHtoDAsync 128 B + cuStreamWriteValue64, device polls device memory;
   and the host cost of the driver calls alone.

    python benchmarks/host_handoff_probe.py      (needs CuPy and a GPU)

It decides how submissions should reach the daemon: the host link polls
pinned host memory (a), and pushing entries with stream memory operations
(b, c) was the alternative (docs/performance-log.md, section 11)."""
import ctypes
import time

import numpy as np
import cupy as cp

SRC = r'''
extern "C" __device__ unsigned long long gt() { unsigned long long t; asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t)); return t; }
extern "C" __global__ void rd(const unsigned long long* p, int lanes, int n, unsigned long long* out) {
  int l = threadIdx.x;
  unsigned long long off = 0, acc = 0;
  __syncwarp();
  unsigned long long t0 = gt();
  for (int i = 0; i < n; ++i) {
    unsigned long long v = 0;
    if (l < lanes) { const volatile unsigned long long* q = p + 2 * l + off; v = q[0] + q[1]; }
    v = __reduce_add_sync(0xffffffffu, (unsigned)v);
    off = v; acc += v;
  }
  unsigned long long t1 = gt();
  if (l == 0) { out[0] = t1 - t0; out[1] = acc; }
}
extern "C" __global__ void pong(const volatile unsigned long long* flag, volatile unsigned long long* reply, int n) {
  if (threadIdx.x) return;
  for (int i = 1; i <= n; ++i) {
    unsigned long long t0 = gt();
    while (flag[0] < (unsigned long long)i) { if (gt() - t0 > 2000000000ull) { reply[1] = 1; return; } }
    reply[0] = i;
    __threadfence_system();
  }
}
'''
mod = cp.RawModule(code=SRC, options=("-std=c++17",))
rd, pong = mod.get_function("rd"), mod.get_function("pong")
cuda = ctypes.CDLL("libcuda.so.1")
cuda.cuStreamWriteValue64_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint]
cuda.cuMemcpyHtoDAsync_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]

def host_buf(nbytes):
    ptr = cp.cuda.runtime.hostAlloc(nbytes, 2)  # mapped
    arr = np.ctypeslib.as_array((ctypes.c_uint64 * (nbytes // 8)).from_address(ptr))
    arr[:] = 0
    return ptr, arr, ptr  # UVA: a mapped allocation's device address is its host address

# 1. read latency
hp, harr, hdev = host_buf(1 << 16)
dmem = cp.zeros(1 << 13, dtype=cp.uint64)
out = cp.zeros(2, dtype=cp.uint64)
n = 2000
for where, ptr in (("host", hdev), ("device", dmem.data.ptr)):
    for lanes in (1, 8, 16, 32):
        rd((1,), (32,), (np.uint64(ptr), np.int32(lanes), np.int32(n), out))
        cp.cuda.runtime.deviceSynchronize()
        rd((1,), (32,), (np.uint64(ptr), np.int32(lanes), np.int32(n), out))
        cp.cuda.runtime.deviceSynchronize()
        print(f"read {where}: {lanes:2d} lanes ({max(1, lanes // 8)} line(s)): {out[0].get() / n:8.0f} ns per dependent read", flush=True)

# 2. ping-pong
s_kernel, s_push = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
fp, farr, fdev = host_buf(4096)
rp, rarr, rdev = host_buf(4096)
ep, earr, edev = host_buf(4096)
dflag = cp.zeros(64, dtype=cp.uint64)
dentry = cp.zeros(16, dtype=cp.uint64)
iters = 3000

def run(mode):
    farr[:] = 0; rarr[:] = 0; dflag.fill(0); cp.cuda.runtime.deviceSynchronize()
    flag = fdev if mode == "host flag" else dflag.data.ptr
    with s_kernel:
        pong((1,), (32,), (np.uint64(flag), np.uint64(rdev), np.int32(iters)))
    ts = np.empty(iters)
    calls = np.empty(iters)
    for i in range(1, iters + 1):
        t0 = time.perf_counter_ns()
        if mode == "host flag":
            farr[0] = i
        elif mode == "write value":
            assert cuda.cuStreamWriteValue64_v2(s_push.ptr, dflag.data.ptr, i, 0) == 0
        else:
            earr[:16] = i
            assert cuda.cuMemcpyHtoDAsync_v2(dentry.data.ptr, ep, 128, s_push.ptr) == 0
            assert cuda.cuStreamWriteValue64_v2(s_push.ptr, dflag.data.ptr, i, 0) == 0
        t1 = time.perf_counter_ns()
        deadline = t0 + 2_000_000_000
        while rarr[0] < i:
            if rarr[1] or time.perf_counter_ns() > deadline:
                print(mode, "STUCK at", i, flush=True); return
        ts[i - 1] = time.perf_counter_ns() - t0
        calls[i - 1] = t1 - t0
    cp.cuda.runtime.deviceSynchronize()
    ts, calls = ts[500:] / 1e3, calls[500:] / 1e3
    print(f"ping-pong {mode:>12}: round trip median {np.median(ts):6.2f} us (p10 {np.percentile(ts, 10):6.2f}, "
          f"p90 {np.percentile(ts, 90):6.2f}); host call {np.median(calls):5.2f} us", flush=True)

for mode in ("host flag", "write value", "copy + value", "host flag", "write value"):
    run(mode)
