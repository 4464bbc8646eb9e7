// Data moves: the control warp describes a move in shared memory and the mover
// warps carry it out between two named barriers.  The movers' loop holds
// almost no state, so the out-of-line copy/reduce loops get the registers.
// In the simulator the one thread of a block runs the move itself.
#pragma once

#include "block_env.cuh"
#include "reduce.cuh"

namespace dfccl {

#if DFCCL_GPU
DFCCL_DEV void named_barrier(uint32_t id) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(blockDim.x) : "memory");
}
#endif

constexpr uint32_t kBarMoveStart = 1;
constexpr uint32_t kBarMoveDone = 2;

DFCCL_DEV void run_move(const BlockShared *sm) {
  const MoveDesc &m = sm->move;
  if (m.nelem == 0) return;
  ReduceCopyArgs a;
  a.srcs = sm->srcs;
  a.dsts = sm->dsts;
  a.nsrcs = m.nsrcs;
  a.ndsts = m.ndsts;
  a.nelem = m.nelem;
  a.postdiv = m.postdiv;
  reduce_copy(m.dtype, m.op, a);
}

// Control warp: the leader has filled sm->move / srcs / dsts.  On return the
// movers' writes are visible to the control warp; a flag that publishes them
// still needs the leader's fence_system().
DFCCL_DEV void execute_move(BlockShared *sm) {
#if DFCCL_GPU
  named_barrier(kBarMoveStart);
  named_barrier(kBarMoveDone);
#else
  run_move(sm);
#endif
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
