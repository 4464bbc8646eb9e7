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
static inline uint64_t dfccl_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

#endif
