/*
 * The layout formulas the host runtime and the daemon must compute alike:
 * an element's size, the LL region of an arena, the all-to-all split table.
 * Defined once here for the daemon (nvcc, NVRTC), the simulator and the
 * Cython runtime (dfccl._native.layout), the way hash.h defines the hashes.
 */
#ifndef DFCCL_LAYOUT_H
#define DFCCL_LAYOUT_H

#include "dfccl/abi.h"

#if defined(__CUDACC__)
#define DFCCL_LAYOUT_HD __host__ __device__ __forceinline__
#else
#define DFCCL_LAYOUT_HD static inline
#endif

/* The allocation unit of an arena's staging: FIFOs, staged copies and the
 * all-to-all send copy start on it. */
#define DFCCL_STAGE_ALIGN 256u

/* LL (cuda/daemon/transfer_ll.cuh): lines of an area before its payload
 * (token line, signature line), each line 16 bytes carrying 8 payload bytes. */
#define DFCCL_LL_HEADER_LINES 2u
#define DFCCL_LL_LINE_BYTES 16u
#define DFCCL_LL_LINE_PAYLOAD 8u
/* Most ranks LL serves: a receiver finds its peers' buckets in its record
 * header's cache (DFCCL_PEER_CACHE). */
#define DFCCL_LL_MAX_RANKS DFCCL_PEER_CACHE
/* The largest per-rank piece a communicator gives LL by itself
 * (ll_max_bytes's default, where the LL region fits): the network proxy
 * carries such a piece's lines inside one message. */
#define DFCCL_LL_DEFAULT_MAX_BYTES 4096u

/* Bytes of one element of a dfccl_dtype. */
DFCCL_LAYOUT_HD uint32_t dfccl_dtype_size(int dtype) {
  switch (dtype) {
    case DFCCL_INT8: case DFCCL_UINT8: return 1;
    case DFCCL_FLOAT16: case DFCCL_BFLOAT16: return 2;
    case DFCCL_INT32: case DFCCL_UINT32: case DFCCL_FLOAT32: return 4;
    default: return 8;
  }
}

DFCCL_LAYOUT_HD uint64_t dfccl_round_up(uint64_t a, uint64_t b) { return (a + b - 1) / b * b; }

/* One LL area: the header lines, then a line per 8 payload bytes (a macro
 * too, for constant expressions). */
#define DFCCL_LL_AREA_BYTES(ll_max_bytes)          \
  ((uint64_t)DFCCL_LL_LINE_BYTES *                 \
   (DFCCL_LL_HEADER_LINES + ((uint64_t)(ll_max_bytes) + DFCCL_LL_LINE_PAYLOAD - 1) / DFCCL_LL_LINE_PAYLOAD))
DFCCL_LAYOUT_HD uint64_t dfccl_ll_area_bytes(uint64_t ll_max_bytes) { return DFCCL_LL_AREA_BYTES(ll_max_bytes); }

/* The receive areas of one arena's LL region: [bucket][sender][parity]. */
DFCCL_LAYOUT_HD uint64_t dfccl_ll_areas_bytes(uint32_t capacity, uint32_t nranks, uint64_t ll_max_bytes) {
  return (uint64_t)capacity * nranks * 2ull * dfccl_ll_area_bytes(ll_max_bytes);
}

/* The whole LL region of one arena: the areas, then the acks
 * [bucket][receiver] of 8 bytes, rounded to the staging unit; none without LL. */
DFCCL_LAYOUT_HD uint64_t dfccl_ll_region_bytes(uint32_t capacity, uint32_t nranks, uint64_t ll_max_bytes) {
  if (ll_max_bytes == 0) return 0;
  return dfccl_ll_areas_bytes(capacity, nranks, ll_max_bytes) +
         dfccl_round_up((uint64_t)capacity * nranks * 8ull, DFCCL_STAGE_ALIGN);
}

/* The all-to-all split table (abi.h, "arena: all-to-all split table"). */
DFCCL_LAYOUT_HD uint64_t dfccl_a2a_words(uint32_t nranks, uint32_t nchannels) {
  return DFCCL_A2A_WORDS(nranks, nchannels);
}
DFCCL_LAYOUT_HD uint64_t dfccl_a2a_copy_offset(uint32_t nranks, uint32_t nchannels) {
  return DFCCL_A2A_COPY_OFFSET(nranks, nchannels);
}

#endif /* DFCCL_LAYOUT_H */
