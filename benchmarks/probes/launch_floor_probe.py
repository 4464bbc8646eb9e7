"""What the GPU and driver themselves charge after a host gap, without dfccl:
the floor under the daemon's relaunch cost (benchmarks/probes/relaunch_gap_probe.py,
benchmarks/probes/host_timeline.py --gaps-us).

Three cases, each timed from the host (median, p90 over --iters, a host gap
spun between iterations):
  launch 1x32     launch a one-warp kernel that stores a word into pinned host
                  memory; spin until the host sees it;
  launch 32x512   the same kernel with the daemon's shape (32 blocks of 512
                  threads, one block per SM);
  resident        a kernel already running polls a pinned host word; the host
                  writes a number there and spins until the kernel echoes it
                  (the host-link round trip a resident daemon pays).

    python benchmarks/launch_floor_probe.py [--gaps-us 0,100,1000] [--iters 300]

Needs a GPU and CuPy (used only to compile and launch the probe kernels)."""

from __future__ import annotations

import argparse
import time

import numpy as np

from probe_snippets import spin

SOURCE = r"""
extern "C" __global__ void __launch_bounds__(512, 1) touch(unsigned long long flag, unsigned int v) {
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    *(volatile unsigned int *)flag = v;
    __threadfence_system();
  }
}

// Echoes every number the host writes into req[0] into resp[0] until it reads
// 0xffffffff, or until 60 s pass (never left running by a failed host).
extern "C" __global__ void echo(unsigned long long req, unsigned long long resp) {
  if (threadIdx.x != 0) return;
  unsigned long long start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  unsigned int last = 0;
  for (;;) {
    unsigned int v = *(volatile unsigned int *)req;
    if (v == 0xffffffffu) return;
    if (v != last) {
      last = v;
      *(volatile unsigned int *)resp = v;
      __threadfence_system();
    }
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    if (now - start > 60000000000ull) return;
  }
}
"""


def summary(times_ns: list[int]) -> str:
    a = np.array(times_ns) / 1000
    return f"median {np.median(a):6.2f} us  p90 {np.percentile(a, 90):6.2f} us"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gaps-us", default="0,100,1000")
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--warmup", type=int, default=20)
    args = p.parse_args()
    try:
        import cupy
    except ImportError:
        raise SystemExit("launch_floor_probe.py needs CuPy (pip install cupy-cuda13x)") from None
    gaps = [float(g) for g in args.gaps_us.split(",")]
    module = cupy.RawModule(code=SOURCE)
    touch = module.get_function("touch")
    echo = module.get_function("echo")
    pinned = cupy.cuda.alloc_pinned_memory(4096)  # mapped and UVA-addressed: the kernel uses the host pointer
    words = np.frombuffer(pinned, dtype=np.uint32, count=1024)
    words[:] = 0
    flag, req, resp = pinned.ptr, pinned.ptr + 128, pinned.ptr + 256
    stream = cupy.cuda.Stream(non_blocking=True)
    now = time.perf_counter_ns
    print(f"device 0: {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}, {args.iters} iterations per gap")

    value = 0
    for grid, block in ((1, 32), (32, 512)):
        for gap_us in gaps:
            times = []
            for i in range(args.iters + args.warmup):
                value += 1
                t0 = now()
                touch((grid,), (block,), (np.uint64(flag), np.uint32(value)), stream=stream)
                while words[0] != value:
                    pass
                t1 = now()
                if i >= args.warmup:
                    times.append(t1 - t0)
                stream.synchronize()
                spin(gap_us * 1e-6)
            print(f"launch {grid}x{block:<4} gap {gap_us:6.0f} us: {summary(times)}", flush=True)

    words[32] = 0
    words[64] = 0
    echo((1,), (32,), (np.uint64(req), np.uint64(resp)), stream=stream)
    try:
        for gap_us in gaps:
            times = []
            for i in range(args.iters + args.warmup):
                value += 1
                t0 = now()
                words[32] = value
                deadline = t0 + 5_000_000_000
                while words[64] != value:
                    if now() > deadline:
                        raise SystemExit("the resident echo kernel did not answer within 5 s")
                t1 = now()
                if i >= args.warmup:
                    times.append(t1 - t0)
                spin(gap_us * 1e-6)
            print(f"resident round trip gap {gap_us:6.0f} us: {summary(times)}", flush=True)
    finally:
        words[32] = 0xFFFFFFFF
        stream.synchronize()


if __name__ == "__main__":
    main()
