// The thin architecture layer under the daemon: the only place that knows
// whether the scheduler runs as a GPU block or as a simulator host thread.
// Everything above it (submit, schedule, transfer, complete) is written once.
//
// GPU:       a block of blockDim.x threads; flags are read/written with
//            system-scope acquire/release (peers are other GPUs or the host).
// Simulator: a block is one host thread (thread index 0 of 1); the same
//            operations map onto C++ atomics, the clock onto CLOCK_MONOTONIC,
//            and a spin yields the CPU so that many simulated GPUs share a few
//            cores.
#pragma once

#include "dfccl/abi.h"

#if defined(__CUDACC__)
#define DFCCL_GPU 1
#define DFCCL_DEV __device__ __forceinline__
#define DFCCL_NOINLINE __device__ __noinline__
#else
#define DFCCL_GPU 0
#define DFCCL_DEV inline
#define DFCCL_NOINLINE
#include <sched.h>
#include <string.h>
#include <time.h>
#include <stdint.h>
#endif

namespace dfccl {

// ---- identity -----------------------------------------------------------------
// A GPU block is one control warp (warp 0: scheduler, protocol, waits) and
// mover warps (all others: bulk copies and reductions).  Lane 0 of the control
// warp is the leader that polls flags and publishes decisions; the control warp
// keeps in step with __syncwarp.  Movers and control meet only at two named
// barriers around each data move (execute_move in schedule.cuh).
// In the simulator a block is one thread that plays every role.
#if DFCCL_GPU
constexpr int kControlThreads = 32;
DFCCL_DEV bool is_leader() { return threadIdx.x == 0; }
DFCCL_DEV void control_sync() { __syncwarp(); }
DFCCL_DEV int mover_index() { return (int)threadIdx.x - kControlThreads; }
DFCCL_DEV int mover_count() { return (int)blockDim.x - kControlThreads; }
// The leader's value of v, in every lane of the control warp.
DFCCL_DEV uint64_t from_leader(uint64_t v) { return __shfl_sync(0xffffffffu, (unsigned long long)v, 0); }
// Work dealt over the control warp: lane i takes items i, i + lanes, ...
DFCCL_DEV int control_lane() { return (int)threadIdx.x; }
DFCCL_DEV int control_lanes() { return kControlThreads; }
// The minimum of v over the control warp, in every lane.
DFCCL_DEV uint64_t control_min(uint64_t v) {
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) {
    const uint64_t o = __shfl_xor_sync(0xffffffffu, (unsigned long long)v, d);
    v = o < v ? o : v;
  }
  return v;
}
#else
DFCCL_DEV int control_lane() { return 0; }
DFCCL_DEV int control_lanes() { return 1; }
DFCCL_DEV bool is_leader() { return true; }
DFCCL_DEV void control_sync() {}
DFCCL_DEV uint64_t from_leader(uint64_t v) { return v; }
DFCCL_DEV uint64_t control_min(uint64_t v) { return v; }
DFCCL_DEV int mover_index() { return 0; }
DFCCL_DEV int mover_count() { return 1; }
#endif

// ---- clock -----------------------------------------------------------------
#if DFCCL_GPU
DFCCL_DEV uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
#else
DFCCL_DEV uint64_t now_ns() {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}
#endif

// 1 + the SM this thread runs on; 0 in the simulator, which has none.
#if DFCCL_GPU
DFCCL_DEV uint32_t sm_number() {
  uint32_t v;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(v));
  return v + 1u;
}
#else
DFCCL_DEV uint32_t sm_number() { return 0; }
#endif

// Called in every spin iteration, `spins` the polls of this wait so far.  On
// the GPU a poll is already a memory round trip (a flag in a peer's memory
// costs ~2 us over NVLink), so the leader polls back to back, as NCCL does;
// __nanosleep was measured to stretch each iteration far past its argument.
// In the simulator the CPU is handed over so that many simulated GPUs share a
// few cores: a yield for the first polls, then a short sleep, since a yield
// with nothing else runnable returns at once and a long wait would keep a
// core busy that the peer's threads (or the network proxy) need.
// link_pause(): the link block after a round trip that brought nothing.  On
// the GPU none: each poll is itself a host round trip, and the next one
// should leave at once.  In the simulator an idle block's pause, so that the
// link thread does not take a core from the simulated blocks.
#if DFCCL_GPU
DFCCL_DEV void spin_pause(uint32_t) {}
DFCCL_DEV void idle_pause() { __nanosleep(500); }
DFCCL_DEV void link_pause() {}
#else
constexpr uint32_t kSimYieldPolls = 32;  // polls of a wait that yield before it sleeps
DFCCL_DEV void spin_pause(uint32_t spins) {
  if (spins < kSimYieldPolls) {
    sched_yield();
    return;
  }
  struct timespec ts = {0, 5000};
  nanosleep(&ts, nullptr);
}
DFCCL_DEV void idle_pause() {
  struct timespec ts = {0, 20000};
  nanosleep(&ts, nullptr);
}
DFCCL_DEV void link_pause() { idle_pause(); }
#endif

// ---- flags: loads and stores that order memory across devices ---------------
#if DFCCL_GPU
DFCCL_DEV uint64_t load_acquire(const uint64_t *p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
DFCCL_DEV uint32_t load_acquire(const uint32_t *p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
DFCCL_DEV uint64_t load_relaxed(const uint64_t *p) {
  uint64_t v;
  asm volatile("ld.relaxed.sys.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
// A word only this thread writes: a plain (L1-cached) load, kept in place by
// the asm so that the compiler does not reuse an earlier value.
DFCCL_DEV uint64_t load_own(const uint64_t *p) {
  uint64_t v;
  asm volatile("ld.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
DFCCL_DEV uint32_t load_relaxed(const uint32_t *p) {
  uint32_t v;
  asm volatile("ld.relaxed.sys.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
DFCCL_DEV void store_release(uint64_t *p, uint64_t v) {
  asm volatile("st.release.sys.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
DFCCL_DEV void store_release(uint32_t *p, uint32_t v) {
  asm volatile("st.release.sys.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
DFCCL_DEV void store_relaxed(uint64_t *p, uint64_t v) {
  asm volatile("st.relaxed.sys.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
DFCCL_DEV void store_relaxed(uint32_t *p, uint32_t v) {
  asm volatile("st.relaxed.sys.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
DFCCL_DEV uint64_t atomic_add(uint64_t *p, uint64_t v) {
  uint64_t old;
  asm volatile("atom.add.release.sys.u64 %0, [%1], %2;" : "=l"(old) : "l"(p), "l"(v) : "memory");
  return old;
}
// Adds without waiting for the old value (a reduction: fire and forget).
// Relaxed: a release_fence() before it orders what it publishes.
DFCCL_DEV void red_add_relaxed(uint64_t *p, uint64_t v) {
  asm volatile("red.relaxed.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
DFCCL_DEV uint32_t atomic_add_local(uint32_t *p, uint32_t v) {
  uint32_t old;
  asm volatile("atom.add.acq_rel.gpu.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}
DFCCL_DEV uint32_t atomic_cas_local(uint32_t *p, uint32_t expect, uint32_t v) {
  return atomicCAS(p, expect, v);
}
// Replaces `expect` by `v` at system scope; returns the old value, which a
// caller that ignores it never waits for.
DFCCL_DEV uint64_t cas_relaxed(uint64_t *p, uint64_t expect, uint64_t v) {
  uint64_t old;
  asm volatile("atom.relaxed.sys.global.cas.b64 %0, [%1], %2, %3;" : "=l"(old) : "l"(p), "l"(expect), "l"(v) : "memory");
  return old;
}
// Raises a word of global memory (the daemon state) to v without waiting for
// the old value.  atomicMax on a generic pointer compiled to an atomic that
// also reports whether the address was shared memory, and a branch on that.
DFCCL_DEV void atomic_max_local(uint64_t *p, uint64_t v) {
  asm volatile("red.relaxed.gpu.global.max.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
// Sets / clears bits of a word only this GPU's blocks and its graph arm
// nodes share (graph.cuh's replay mask).
DFCCL_DEV void atomic_or_local(uint32_t *p, uint32_t v) { atomicOr(p, v); }
DFCCL_DEV void atomic_and_local(uint32_t *p, uint32_t v) { atomicAnd(p, v); }
// Words only this GPU's blocks share (daemon state, contexts): GPU scope, so
// nothing waits on traffic to the host or to peers.
DFCCL_DEV uint64_t load_gpu(const uint64_t *p) {
  uint64_t v;
  asm volatile("ld.relaxed.gpu.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
DFCCL_DEV uint32_t load_gpu(const uint32_t *p) {
  uint32_t v;
  asm volatile("ld.relaxed.gpu.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
DFCCL_DEV uint64_t load_acquire_gpu(const uint64_t *p) {
  uint64_t v;
  asm volatile("ld.acquire.gpu.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
DFCCL_DEV void store_gpu(uint64_t *p, uint64_t v) {
  asm volatile("st.relaxed.gpu.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
DFCCL_DEV void store_gpu(uint32_t *p, uint32_t v) {
  asm volatile("st.relaxed.gpu.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
DFCCL_DEV void store_release_gpu(uint64_t *p, uint64_t v) {
  asm volatile("st.release.gpu.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
DFCCL_DEV void store_release_gpu(uint32_t *p, uint32_t v) {
  asm volatile("st.release.gpu.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
// Takes a GPU-wide flag: true if it was 0 and is now 1 (acquire).
DFCCL_DEV bool try_lock_gpu(uint32_t *p) {
  uint32_t old;
  asm volatile("atom.cas.acquire.gpu.b32 %0, [%1], 0, 1;" : "=r"(old) : "l"(p) : "memory");
  return old == 0;
}
// 16 bytes of host memory, never from a cache (the host rewrites them).
DFCCL_DEV void load_host_words(const void *p, uint64_t &lo, uint64_t &hi) {
  asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];" : "=l"(lo), "=l"(hi) : "l"(p) : "memory");
}
// Loads issued where they are written.  ptxas moves a plain, relaxed or .cg
// load down to its first use, and when that use is behind a branch that
// waits for another load, the two round trips run one after the other (the
// pull read a descriptor in five of them, one per check).  It leaves a
// volatile load in place (seen in the SASS), so several are in flight
// together.  Strong, like .cg: never from L1.
DFCCL_DEV uint64_t load_early(const uint64_t *p) {
  uint64_t v;
  asm volatile("ld.volatile.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// Orders this block's earlier writes (made visible to thread 0 by a barrier)
// before thread 0's next flag store, for every observer in the system.
DFCCL_DEV void fence_system() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
DFCCL_DEV void fence_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
DFCCL_DEV void fence_seq_cst() { asm volatile("fence.sc.sys;" ::: "memory"); }
#else
DFCCL_DEV uint64_t load_acquire(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
DFCCL_DEV uint32_t load_acquire(const uint32_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
DFCCL_DEV uint64_t load_relaxed(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
DFCCL_DEV uint32_t load_relaxed(const uint32_t *p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
DFCCL_DEV uint64_t load_own(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
DFCCL_DEV void store_release(uint64_t *p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
DFCCL_DEV void store_release(uint32_t *p, uint32_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
DFCCL_DEV void store_relaxed(uint32_t *p, uint32_t v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
DFCCL_DEV void store_relaxed(uint64_t *p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
DFCCL_DEV uint64_t atomic_add(uint64_t *p, uint64_t v) { return __atomic_fetch_add(p, v, __ATOMIC_ACQ_REL); }
DFCCL_DEV void red_add_relaxed(uint64_t *p, uint64_t v) { __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
DFCCL_DEV uint32_t atomic_add_local(uint32_t *p, uint32_t v) { return __atomic_fetch_add(p, v, __ATOMIC_ACQ_REL); }
DFCCL_DEV uint32_t atomic_cas_local(uint32_t *p, uint32_t expect, uint32_t v) {
  __atomic_compare_exchange_n(p, &expect, v, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
  return expect;
}
DFCCL_DEV uint64_t cas_relaxed(uint64_t *p, uint64_t expect, uint64_t v) {
  __atomic_compare_exchange_n(p, &expect, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
  return expect;
}
DFCCL_DEV void atomic_max_local(uint64_t *p, uint64_t v) {
  uint64_t cur = __atomic_load_n(p, __ATOMIC_RELAXED);
  while (cur < v && !__atomic_compare_exchange_n(p, &cur, v, true, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) {
  }
}
DFCCL_DEV void atomic_or_local(uint32_t *p, uint32_t v) { __atomic_fetch_or(p, v, __ATOMIC_ACQ_REL); }
DFCCL_DEV void atomic_and_local(uint32_t *p, uint32_t v) { __atomic_fetch_and(p, v, __ATOMIC_ACQ_REL); }
DFCCL_DEV uint64_t load_gpu(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
DFCCL_DEV uint32_t load_gpu(const uint32_t *p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
DFCCL_DEV uint64_t load_acquire_gpu(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
DFCCL_DEV void store_gpu(uint64_t *p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
DFCCL_DEV void store_gpu(uint32_t *p, uint32_t v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
DFCCL_DEV void store_release_gpu(uint64_t *p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
DFCCL_DEV void store_release_gpu(uint32_t *p, uint32_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
DFCCL_DEV bool try_lock_gpu(uint32_t *p) {
  uint32_t expect = 0;
  return __atomic_compare_exchange_n(p, &expect, 1u, false, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED);
}
DFCCL_DEV void load_host_words(const void *p, uint64_t &lo, uint64_t &hi) {
  const uint64_t *q = (const uint64_t *)p;
  lo = __atomic_load_n(q, __ATOMIC_RELAXED);
  hi = __atomic_load_n(q + 1, __ATOMIC_RELAXED);
}
DFCCL_DEV uint64_t load_early(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
DFCCL_DEV void fence_system() { __atomic_thread_fence(__ATOMIC_ACQ_REL); }
DFCCL_DEV void fence_gpu() { __atomic_thread_fence(__ATOMIC_ACQ_REL); }
DFCCL_DEV void fence_seq_cst() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
#endif

// ---- bulk data: 16-byte packs ----------------------------------------------
// Data that another device or kernel may have written while the daemon runs is
// read past the (non-coherent) L1: ld.global.cg keeps it in L2 only.
struct alignas(16) pack16 {
  uint64_t lo, hi;
};

#if DFCCL_GPU
DFCCL_DEV pack16 load_pack(const void *p) {
  pack16 v;
  asm volatile("ld.global.cg.v2.u64 {%0, %1}, [%2];" : "=l"(v.lo), "=l"(v.hi) : "l"(p) : "memory");
  return v;
}
// load_pack, issued where it is written (load_early).
DFCCL_DEV pack16 load_pack_early(const void *p) {
  pack16 v;
  asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];" : "=l"(v.lo), "=l"(v.hi) : "l"(p) : "memory");
  return v;
}
DFCCL_DEV void store_pack(void *p, pack16 v) {
  asm volatile("st.global.v2.u64 [%0], {%1, %2};" ::"l"(p), "l"(v.lo), "l"(v.hi) : "memory");
}
template <typename T>
DFCCL_DEV T load_elem(const T *p) {
  // volatile: same reason as .cg above, for the unaligned tails.
  return *(const volatile T *)p;
}
#else
DFCCL_DEV pack16 load_pack(const void *p) {
  pack16 v;
  memcpy(&v, p, 16);
  return v;
}
DFCCL_DEV pack16 load_pack_early(const void *p) { return load_pack(p); }
DFCCL_DEV void store_pack(void *p, pack16 v) { memcpy(p, &v, 16); }
template <typename T>
DFCCL_DEV T load_elem(const T *p) { return *p; }
#endif

template <typename T>
DFCCL_DEV T *ptr(uint64_t addr) { return reinterpret_cast<T *>(addr); }

}  // namespace dfccl
