// Preemptible waits: the only places where a daemon block waits for a peer.
//
// Every wait is bounded by the run's deadline (nanoseconds of the device clock,
// not spin counts).  A wait that succeeds moves the deadline out by one window:
// the window bounds the time *without progress*, so a collective whose gang has
// formed runs to the end, and one whose peers are absent is preempted.
#pragma once

#include "block_env.cuh"

namespace dfccl {

// Why a run must stop early, checked on the slow path of every wait: another
// block of this task failed, a neighbour pushed an abort for this instance
// into our record, or the host aborted the communicator (as the host link
// copied it into device memory).
DFCCL_DEV bool abort_pending(const BlockEnv &env, TaskRun &run) {
  const dfccl_daemon_args *a = env.args;
  uint32_t err = load_gpu(&a->slot_error[run.d->slot]);
  if (err != 0) {
    run.status = err >> 16;
    run.detail = (int32_t)(err & 0xffffu) - 1;
    return true;
  }
  if (load_acquire(&run.mine->abort_token) == run.token) {
    uint64_t info = load_acquire(&run.mine->abort_info);
    run.status = DFCCL_STATUS_PEER_ABORTED;
    run.detail = (int32_t)(info & 0xffffffffu);
    return true;
  }
  if (load_gpu(&a->endpoint_abort_dev[run.d->endpoint]) != 0) {
    run.status = DFCCL_STATUS_ABORTED;
    run.detail = -1;
    return true;
  }
  return false;
}

// The leader polls `ready()` until it holds, the deadline passes, or an abort
// arrives; the result reaches all threads through shared memory.  `ready()`
// returns 1 (go on), 0 (not yet) or -1 (failed; it has set run.status).
// `peer` names the rank waited for, reported to the host on preemption.
template <class Ready>
DFCCL_DEV int block_wait(BlockEnv &env, TaskRun &run, uint32_t peer, Ready ready) {
  const int slot = env.wparity;
  env.wparity ^= 1u;
  if (is_leader()) {
    int r = WAIT_OK;
    int state = ready();
    uint64_t start = 0;
    if (state == 0) {
      start = now_ns();
      uint32_t spins = 0;
      for (;;) {
        spin_pause();
        state = ready();
        if (state != 0) break;
        if ((++spins & 3u) == 0) {
          // Diagnostics: whom this collective waits for, visible to the host
          // while it waits (Work.synchronize timeouts name the rank).
          if (spins == 16) store_gpu(&env.args->slot_waiting[run.d->slot], peer + 1);
          // The daemon is leaving: stop at this wait like at a deadline.
          const bool expired =
              now_ns() >= run.deadline_ns || load_gpu(&env.args->state->quit_epoch) == env.args->epoch;
          // Aborts are checked every 256 spins (one word is in host memory)
          // and whenever the run is about to be preempted.
          if (((spins & 255u) == 0 || expired) && abort_pending(env, run)) {
            r = WAIT_ABORT;
            break;
          }
          if (expired) {
            r = WAIT_EXPIRED;
            run.waiting_on = peer + 1;
            break;
          }
        }
      }
    }
    if (state < 0) r = WAIT_ABORT;
    if (r == WAIT_OK) {
      const uint64_t now = now_ns();
      if (start != 0 && now - start > run.max_wait_ns) run.max_wait_ns = now - start;
      run.deadline_ns = now + run.window_ns;
    }
    env.sm->wait_result[slot] = r;
  }
  control_sync();
  // Double buffering: the next wait writes the other slot, so no second
  // barrier is needed before the leader reuses this one.
  return env.sm->wait_result[slot];
}

// Turns a wait result into the run's outcome (used as `if (r) return r;`).
DFCCL_DEV int stop_run(int wait_result) {
  return wait_result == WAIT_EXPIRED ? RUN_PREEMPTED : RUN_FAILED;
}

// The movers' writes of the last move (gathered at the control warp by the
// move barrier) are ordered before the leader's next flag store, for every
// observer in the system.
DFCCL_DEV void release_fence() {
  if (is_leader()) fence_system();
}

}  // namespace dfccl
