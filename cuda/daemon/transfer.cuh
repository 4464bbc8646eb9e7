// Transfer: runs one task on one channel from its saved step until it is done,
// fails, or a wait passes its deadline.  The data path was chosen by the host
// (dfccl_task_desc.path); a communicator of one rank only copies.
#pragma once

#include "transfer_direct.cuh"
#include "transfer_ll.cuh"
#include "transfer_ring.cuh"
#include "transfer_p2p.cuh"

namespace dfccl {

DFCCL_DEV int run_single_rank(BlockEnv &env, TaskRun &run) {
  const dfccl_task_desc *d = run.d;
  if (d->send_addr != d->recv_addr) {
    const uint32_t esize = dtype_size(d->dtype);
    Range part = split(d->count, d->nchannels, run.chan, pack_elems(esize));
    if (is_leader()) {
      env.sm->srcs[0] = d->send_addr + part.off * esize;
      env.sm->dsts[0] = d->recv_addr + part.off * esize;
    }
    move_data(env, run, 1, 1, part.len, 1);
  }
  run.progressed = true;
  return RUN_DONE;
}

DFCCL_DEV int run_transfer(BlockEnv &env, TaskRun &run) {
  if (run.ep->nranks == 1) return run_single_rank(env, run);
  if (run.d->flags & DFCCL_TASK_LL) return run_ll(env, run);
  if (run.step == 0) {  // (LL checks this itself, with its credits)
    const int w = ll_handover(env, run);
    if (w != WAIT_OK) return stop_run(w);
  }
  if (run.d->kind == DFCCL_SEND || run.d->kind == DFCCL_RECV) return run_p2p(env, run);
  if (run.d->kind == DFCCL_ALL_TO_ALL) return run_all_to_all(env, run);
  if (run.d->path == DFCCL_PATH_DIRECT) {
    if (run.step < D_RING) {
      const int rc = run_direct(env, run);
      if (run.step < D_RING || rc != RUN_DONE) return rc;
    }
    return run_ring(env, run, D_RING);  // a staged collective fell back to the ring
  }
  return run_ring(env, run, 0);
}

}  // namespace dfccl
