"""What the daemon's building blocks cost on this GPU: one thread, a dependent
chain of each operation (cuda/daemon/arch.cuh's own definitions, compiled
here with CuPy), timed with %globaltimer over many iterations.  These are the
bricks of a scheduler pass and of a run, so they say which ones are worth
removing from the per-collective path.

    python benchmarks/bench_primitives.py [--iters 20000]
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The benchmarks' shared helpers (dfccl_support) live in support/, beside the package.
sys.path.insert(0, os.path.join(ROOT, "support"))

from dfccl_support import suite  # noqa: E402

SOURCE = r"""
#include "daemon/arch.cuh"
using namespace dfccl;

// Every case chains each operation on the previous one's result, so the
// figure is a latency, not a throughput.
extern "C" __global__ void prim(int which, uint64_t iters, uint64_t *dev_word,
                                uint64_t *host_word, uint64_t *out) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  uint64_t acc = 0;
  uint32_t *dev32 = reinterpret_cast<uint32_t *>(dev_word + 16);
  const uint64_t t0 = now_ns();
  for (uint64_t i = 0; i < iters; ++i) {
    const uint64_t off = acc & 0;  // a dependency the compiler cannot drop
    switch (which) {
      case 0: acc += now_ns(); break;
      case 1: acc += load_gpu(dev_word + off); break;
      case 2: acc += load_acquire_gpu(dev_word + off); break;
      case 3: acc += load_acquire(dev_word + off); break;
      case 4: acc += load_own(dev_word + off); break;
      case 5: { uint64_t lo, hi; load_host_words(host_word + off, lo, hi); acc += lo + hi; } break;
      case 6: acc += load_acquire(host_word + off); break;
      case 7: acc += atomic_add_local(dev32 + off, 1u); break;
      case 8: acc += atomic_add(dev_word + 8 + off, (uint64_t)1); break;
      case 9: store_gpu(dev_word + 4 + off, acc); fence_system(); acc += 1; break;
      case 10: store_release(host_word + 4 + off, acc); acc += load_gpu(dev_word + off); break;
      case 11: store_gpu(dev_word + 4 + off, acc); fence_seq_cst(); acc += 1; break;
      case 12: acc += try_lock_gpu(dev32 + 4 + off); store_release_gpu(dev32 + 4 + off, 0u); break;
    }
  }
  const uint64_t t1 = now_ns();
  out[0] = t1 - t0;
  out[1] = acc;
}
"""

CASES = ["now_ns (%globaltimer)", "load_gpu (ld.relaxed.gpu)", "load_acquire_gpu (ld.acquire.gpu)",
         "load_acquire (ld.acquire.sys), device memory", "load_own (ld.global)",
         "load_host_words (16 B of host memory)", "load_acquire (ld.acquire.sys), host memory",
         "atomic_add_local (atom.add.acq_rel.gpu)", "atomic_add (atom.add.release.sys)",
         "store_gpu + fence_system (fence.acq_rel.sys)", "store_release to host memory + load_gpu",
         "store_gpu + fence_seq_cst (fence.sc.sys)", "try_lock_gpu + store_release_gpu"]


def main(argv=None) -> int:
    p = suite.parser(__doc__.splitlines()[0], iters=20000, placement=False)
    args = p.parse_args(argv)
    import cupy as cp

    inc = [f"-I{os.path.join(ROOT, 'cuda')}", f"-I{os.path.join(ROOT, 'cuda', 'include')}", "-std=c++17"]
    mod = cp.RawModule(code=SOURCE, options=tuple(inc), backend="nvcc")
    kern = mod.get_function("prim")
    dev = cp.zeros(64, dtype=cp.uint64)
    host_mem = cp.cuda.alloc_pinned_memory(64 * 8)
    host_ptr = host_mem.ptr  # unified addressing: the same pointer on the device
    out = cp.zeros(2, dtype=cp.uint64)
    rows = []
    for which, name in enumerate(CASES):
        iters = args.iters if which not in (5, 6, 10) else max(200, args.iters // 20)
        kern((1,), (32,), (cp.int32(which), cp.uint64(iters), dev, cp.uint64(host_ptr), out))  # warm-up
        kern((1,), (32,), (cp.int32(which), cp.uint64(iters), dev, cp.uint64(host_ptr), out))
        cp.cuda.runtime.deviceSynchronize()
        ns = int(out[0].get()) / iters
        rows.append({"operation": name, "ns": round(ns, 1), "iters": iters})
        print(f"{name:<48} {ns:8.1f} ns")
    print("wrote", suite.write(args.out, suite.record("primitives", args, "cuda", [0], rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
