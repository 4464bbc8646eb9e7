/*
 * The hashes the host runtime and the daemon must compute bit for bit alike:
 * where a tag's record lives (home bucket), what names one instance of it
 * (token), which daemon block runs its first channel, and the check word of
 * a submission-ring entry.  Defined once here
 * for the daemon (nvcc, NVRTC), the simulator and the Cython runtime.
 */
#ifndef DFCCL_HASH_H
#define DFCCL_HASH_H

#include "dfccl/abi.h"

#if defined(__CUDACC__)
#define DFCCL_HD __host__ __device__ __forceinline__
#else
#define DFCCL_HD static inline
#endif

/* splitmix64's finaliser. */
DFCCL_HD uint64_t dfccl_mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

/* Names one instance of one tag in flags that peers compare for equality;
 * never zero, so a zeroed record matches nothing. */
DFCCL_HD uint64_t dfccl_instance_token(uint64_t key, uint64_t instance) {
  return dfccl_mix64(key + instance * 0x9e3779b97f4a7c15ull) | 1ull;
}

/* Where linear probing for a tag's record starts, in every rank's table. */
DFCCL_HD uint32_t dfccl_home_bucket(uint64_t key, uint32_t capacity) {
  return (uint32_t)(dfccl_mix64(key) % capacity);
}

/* The daemon block that runs channel 0 of a tag's instances on a rank
 * (dfccl_task_desc.first_block): spread by tag, and the ranks of one
 * communicator that share a daemon `offset` apart (the host gives them
 * disjoint runs of blocks), so that small collectives of different tags, and
 * the channels of ranks that must run at the same time, do not queue on one
 * block. */
DFCCL_HD uint32_t dfccl_first_block(uint64_t key, uint32_t offset, uint32_t nblocks) {
  return (uint32_t)((dfccl_mix64(key ^ 0x6a09e667f3bcc909ull) + offset) % nblocks);
}

/* The check word of a submission-ring entry (dfccl_sqe): a hash of the
 * descriptor's fourteen words and seq, never equal to a zeroed entry's. */
DFCCL_HD uint64_t dfccl_sqe_check(const uint64_t *desc_words, uint64_t seq) {
  uint64_t h = dfccl_mix64(seq ^ 0x3c6ef372fe94f82bull);
  for (int i = 0; i < (int)(sizeof(dfccl_task_desc) / 8); ++i) h = dfccl_mix64(h ^ desc_words[i]);
  return h | 1ull;
}

/* The tag of the n-th capture (from 0) of tag `key` on a rank: a collective
 * captured in a CUDA graph runs on a tag of its own, whose instances are
 * its graph's replays (docs/architecture.md, "CUDA graphs").  Never zero. */
DFCCL_HD uint64_t dfccl_graph_key(uint64_t key, uint64_t n) {
  return dfccl_mix64(key ^ dfccl_mix64(n + 0x510e527fade682d1ull)) | 1ull;
}

#endif /* DFCCL_HASH_H */
