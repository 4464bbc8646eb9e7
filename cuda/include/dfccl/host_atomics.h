/* Host-side atomics and timing for the Cython runtime (the device side of the
 * same protocol is in cuda/daemon/arch.cuh). */
#ifndef DFCCL_HOST_ATOMICS_H
#define DFCCL_HOST_ATOMICS_H

#include <sched.h>
#include <stdint.h>
#include <time.h>

static inline uint64_t dfccl_load_acquire_u64(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static inline uint32_t dfccl_load_acquire_u32(const uint32_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static inline void dfccl_store_release_u64(uint64_t *p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
static inline void dfccl_store_release_u32(uint32_t *p, uint32_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
static inline uint32_t dfccl_exchange_u32(uint32_t *p, uint32_t v) { return __atomic_exchange_n(p, v, __ATOMIC_ACQ_REL); }
/* Reference counts of host structures shared between threads: returns the new value. */
static inline uint32_t dfccl_add_fetch_u32(uint32_t *p, int32_t v) { return __atomic_add_fetch(p, (uint32_t)v, __ATOMIC_ACQ_REL); }
static inline void dfccl_fence_seq_cst(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
static inline void dfccl_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}
static inline void dfccl_sleep_ns(uint64_t ns) {
  struct timespec ts;
  ts.tv_sec = (time_t)(ns / 1000000000ull);
  ts.tv_nsec = (long)(ns % 1000000000ull);
  nanosleep(&ts, 0);
}
static inline void dfccl_yield(void) { sched_yield(); }

/* A host wait for a completion word pauses between polls by how long it
 * has waited: not at all for the first DFCCL_WAIT_SPIN_NS (a small
 * collective completes in microseconds, and a timed sleep overshoots by
 * tens of them), then a yield, and past DFCCL_WAIT_YIELD_NS a sleep of 1% of
 * the time waited, at most 1 ms.  A long wait then leaves the CPU to the
 * process's other threads (peer liveness, the network proxy, a simulated
 * daemon) for about 1% of its length; a waiter that only yields keeps a
 * core busy, and two of them starved those threads of a 2-core host for
 * seconds. */
#define DFCCL_WAIT_SPIN_NS 50000ull
#define DFCCL_WAIT_YIELD_NS 10000000ull
static inline void dfccl_wait_pause(uint64_t waited_ns) {
  if (waited_ns < DFCCL_WAIT_SPIN_NS) return;
  if (waited_ns < DFCCL_WAIT_YIELD_NS) {
    sched_yield();
    return;
  }
  const uint64_t ns = waited_ns / 100u;
  dfccl_sleep_ns(ns < 1000000u ? ns : 1000000u);
}
static inline uint64_t dfccl_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

#endif
