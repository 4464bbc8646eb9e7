// The LL protocol's line: 16 bytes {data 4 B, flag 4 B, data 4 B, flag 4 B}
// written by one vector store, so a reader that sees both flags sees both
// data words; and the byte moves around it.  Used by the control warp
// (transfer_ll.cuh: push, poll) and the movers (move.cuh: FINISH).
#pragma once

#include "arch.cuh"

namespace dfccl {

// ---- lanes of the control warp ------------------------------------------------
#if DFCCL_GPU
DFCCL_DEV uint32_t lane_index() { return threadIdx.x; }
DFCCL_DEV uint32_t lane_count() { return 32u; }
DFCCL_DEV bool warp_all(bool p) { return __all_sync(0xffffffffu, p) != 0; }
DFCCL_DEV bool warp_any(bool p) { return __any_sync(0xffffffffu, p) != 0; }
#else
DFCCL_DEV uint32_t lane_index() { return 0; }
DFCCL_DEV uint32_t lane_count() { return 1; }
DFCCL_DEV bool warp_all(bool p) { return p; }
DFCCL_DEV bool warp_any(bool p) { return p; }
#endif

// ---- one line ------------------------------------------------------------------
struct LLLine {
  uint32_t d1, f1, d2, f2;
};

#if DFCCL_GPU
// One 16-byte store; each 8-byte half {data, flag} lands whole, so a reader
// that sees both flags sees both data words.
DFCCL_DEV void ll_store(uint64_t addr, uint64_t data, uint32_t flag) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(addr), "r"((uint32_t)data), "r"(flag),
               "r"((uint32_t)(data >> 32)), "r"(flag)
               : "memory");
}
DFCCL_DEV LLLine ll_load(uint64_t addr) {
  LLLine l;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(l.d1), "=r"(l.f1), "=r"(l.d2), "=r"(l.f2)
               : "l"(addr)
               : "memory");
  return l;
}
#else
DFCCL_DEV void ll_store(uint64_t addr, uint64_t data, uint32_t flag) {
  uint64_t *w = ptr<uint64_t>(addr);
  __atomic_store_n(w, (data & 0xffffffffull) | ((uint64_t)flag << 32), __ATOMIC_RELAXED);
  __atomic_store_n(w + 1, (data >> 32) | ((uint64_t)flag << 32), __ATOMIC_RELAXED);
}
DFCCL_DEV LLLine ll_load(uint64_t addr) {
  const uint64_t *w = ptr<const uint64_t>(addr);
  const uint64_t a = __atomic_load_n(w, __ATOMIC_RELAXED);
  const uint64_t b = __atomic_load_n(w + 1, __ATOMIC_RELAXED);
  return LLLine{(uint32_t)a, (uint32_t)(a >> 32), (uint32_t)b, (uint32_t)(b >> 32)};
}
#endif

DFCCL_DEV bool ll_valid(const LLLine &l, uint32_t flag) { return l.f1 == flag && l.f2 == flag; }
DFCCL_DEV uint64_t ll_data(const LLLine &l) { return (uint64_t)l.d1 | ((uint64_t)l.d2 << 32); }

// Up to 8 bytes at addr (fewer at the end of a buffer), any alignment.
DFCCL_DEV uint64_t load_bytes8(uint64_t addr, uint32_t n) {
  if (n == 8 && (addr & 7u) == 0) return load_elem(ptr<const uint64_t>(addr));
  uint64_t v = 0;
  for (uint32_t i = 0; i < n; ++i) v |= (uint64_t)load_elem(ptr<const uint8_t>(addr + i)) << (8 * i);
  return v;
}
DFCCL_DEV void store_bytes8(uint64_t addr, uint64_t v, uint32_t n) {
  if (n == 8 && (addr & 7u) == 0) {
    *ptr<uint64_t>(addr) = v;
    return;
  }
  for (uint32_t i = 0; i < n; ++i) ptr<uint8_t>(addr)[i] = (uint8_t)(v >> (8 * i));
}

}  // namespace dfccl
