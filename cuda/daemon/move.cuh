// Data moves: the control warp describes a move in shared memory and the mover
// warps carry it out between two named barriers.  The movers' loop holds
// almost no state, so the out-of-line copy/reduce loops get the registers.
// In the simulator the one thread of a block runs the move itself.
#pragma once

#include "block_env.cuh"
#include "ll_line.cuh"
#include "reduce.cuh"

namespace dfccl {

#if DFCCL_GPU
DFCCL_DEV void named_barrier(uint32_t id) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(blockDim.x) : "memory");
}
#endif

constexpr uint32_t kBarMoveStart = 1;
constexpr uint32_t kBarMoveDone = 2;

// ---- LL FINISH on the movers --------------------------------------------------
// Rank p's piece of an LL collective, word i: this rank's from its input (any
// alignment; the last word may be short), a peer's from its line i.
DFCCL_DEV uint64_t ll_piece_word(const BlockShared *sm, uint32_t p, uint64_t i, uint32_t nb) {
  const uint64_t src = sm->srcs[p];
  return p == sm->move.own ? load_bytes8(src + 8 * i, nb) : ll_data(ll_load(src + 16 * i));
}

DFCCL_DEV uint32_t word_bytes(uint64_t bytes, uint64_t off) { return bytes - off < 8 ? (uint32_t)(bytes - off) : 8u; }

// Element k of type T packed in an 8-byte word, and back, in registers
// (integers and the 16-bit float storage convert; float and double reinterpret).
template <class T>
DFCCL_DEV T from_bits(typename unsigned_of<sizeof(T)>::type b) { return (T)b; }
template <class T>
DFCCL_DEV typename unsigned_of<sizeof(T)>::type to_bits(T v) { return (typename unsigned_of<sizeof(T)>::type)v; }
#if DFCCL_GPU
template <> DFCCL_DEV float from_bits<float>(uint32_t b) { return __uint_as_float(b); }
template <> DFCCL_DEV double from_bits<double>(uint64_t b) { return __longlong_as_double((long long)b); }
template <> DFCCL_DEV uint32_t to_bits<float>(float v) { return __float_as_uint(v); }
template <> DFCCL_DEV uint64_t to_bits<double>(double v) { return (uint64_t)__double_as_longlong(v); }
#else
template <> DFCCL_DEV float from_bits<float>(uint32_t b) { float v; memcpy(&v, &b, 4); return v; }
template <> DFCCL_DEV double from_bits<double>(uint64_t b) { double v; memcpy(&v, &b, 8); return v; }
template <> DFCCL_DEV uint32_t to_bits<float>(float v) { uint32_t b; memcpy(&b, &v, 4); return b; }
template <> DFCCL_DEV uint64_t to_bits<double>(double v) { uint64_t b; memcpy(&b, &v, 8); return b; }
#endif

template <class T>
DFCCL_DEV T word_elem(uint64_t w, int k) {
  return from_bits<T>((typename unsigned_of<sizeof(T)>::type)(w >> (8 * sizeof(T) * k)));
}
template <class T>
DFCCL_DEV uint64_t elem_bits(T v, int k) {
  return (uint64_t)to_bits<T>(v) << (8 * sizeof(T) * k);
}

// dsts[0] = op over the nsrcs ranks' pieces, word by word: each thread loads
// word i of every piece at once (all in flight), reduces them in rank order
// and stores the result.  The arithmetic of reduce_packs (accumulation in A
// across every source, one rounding, AVG divided last): the same bits.
template <class Tr, int OP>
DFCCL_DEV void ll_reduce_words(const BlockShared *sm) {
  using T = typename Tr::T;
  using A = typename Tr::A;
  constexpr int E = 8 / (int)sizeof(T);
  const MoveDesc &m = sm->move;
  const uint64_t bytes = m.nelem;
  const uint64_t dst = sm->dsts[0];
  for (uint64_t i = (uint64_t)mover_index(); 8 * i < bytes; i += (uint64_t)mover_count()) {
    const uint32_t nb = word_bytes(bytes, 8 * i);
    // This rank's word first (byte loads where unaligned), then every peer's
    // line, all in flight at once.
    const uint64_t mine = load_bytes8(sm->srcs[m.own] + 8 * i, nb);
    uint64_t v[DFCCL_PEER_CACHE];  // nsrcs <= DFCCL_PEER_CACHE (run_ll checks)
#pragma unroll
    for (uint32_t p = 0; p < DFCCL_PEER_CACHE; ++p)
      if (p < m.nsrcs) v[p] = p == m.own ? mine : ll_data(ll_load(sm->srcs[p] + 16 * i));
    uint64_t out = 0;
#pragma unroll
    for (int k = 0; k < E; ++k) {
      A x = Tr::load(word_elem<T>(v[0], k));
#pragma unroll
      for (uint32_t p = 1; p < DFCCL_PEER_CACHE; ++p)
        if (p < m.nsrcs) x = combine<Tr, OP>(x, Tr::load(word_elem<T>(v[p], k)));
      if (OP == DFCCL_AVG && m.postdiv > 1) x = Tr::div(x, m.postdiv);
      out |= elem_bits<T>(Tr::store(x), k);
    }
    store_bytes8(dst + 8 * i, out, nb);
  }
}

// Piece p of every rank into dsts[0] + p * bytes, word by word (this rank's
// own only when it is not in place already).
DFCCL_NOINLINE void ll_gather_words(const BlockShared *sm) {
  const MoveDesc &m = sm->move;
  const uint64_t bytes = m.nelem;
  const uint64_t words = (bytes + 7) / 8;
  const uint64_t dst = sm->dsts[0];
  for (uint64_t t = (uint64_t)mover_index(); t < words * m.nsrcs; t += (uint64_t)mover_count()) {
    const uint32_t p = (uint32_t)(t / words);
    const uint64_t i = t % words;
    const uint64_t out = dst + (uint64_t)p * bytes + 8 * i;
    if (p == m.own && sm->srcs[p] + 8 * i == out) continue;
    const uint32_t nb = word_bytes(bytes, 8 * i);
    store_bytes8(out, ll_piece_word(sm, p, i, nb), nb);
  }
}

template <class Tr, int OP>
struct LLReduceKernel {
  DFCCL_DEV static void run(const BlockShared *sm) { ll_reduce_words<Tr, OP>(sm); }
};

DFCCL_DEV void run_move(const BlockShared *sm) {
  const MoveDesc &m = sm->move;
  if (m.nelem == 0) return;
  if (m.kind == MOVE_LL_REDUCE) {
    dispatch_reduce<LLReduceKernel>(m.dtype, m.op, sm);
    return;
  }
  if (m.kind == MOVE_LL_GATHER) {
    ll_gather_words(sm);
    return;
  }
  ReduceCopyArgs a;
  a.srcs = sm->srcs;
  a.dsts = sm->dsts;
  a.nsrcs = m.nsrcs;
  a.ndsts = m.ndsts;
  a.nelem = m.nelem;
  a.postdiv = m.postdiv;
  reduce_copy(m.dtype, m.op, a);
}

// Control warp: the leader has filled sm->move / srcs / dsts.  start_move
// sets the movers going; the control warp may do work of its own that touches
// neither the move's sources nor its destinations, then wait_move.  On its
// return the movers' writes are visible to the control warp; a flag that
// publishes them still needs the leader's fence_system().  (The simulator's
// one thread moves inside start_move.)
DFCCL_DEV void start_move(BlockShared *sm) {
#if DFCCL_GPU
  named_barrier(kBarMoveStart);
#else
  run_move(sm);
#endif
}

DFCCL_DEV void wait_move(BlockShared *sm) {
#if DFCCL_GPU
  named_barrier(kBarMoveDone);
#else
  (void)sm;
#endif
}

DFCCL_DEV void execute_move(BlockShared *sm) {
  start_move(sm);
  wait_move(sm);
}

#if DFCCL_GPU
// Mover warps, until the control warp leaves.
DFCCL_DEV void mover_loop(BlockShared *sm) {
  for (;;) {
    named_barrier(kBarMoveStart);
    if (sm->move.quit) return;
    run_move(sm);
    named_barrier(kBarMoveDone);
  }
}
#endif

// Control warp: release the movers for good (the daemon is leaving).
DFCCL_DEV void dismiss_movers(BlockShared *sm) {
  if (is_leader()) sm->move.quit = 1;
  control_sync();
#if DFCCL_GPU
  named_barrier(kBarMoveStart);
#endif
}

}  // namespace dfccl
