// Preemptible waits: the only places where a daemon block waits for a peer.
//
// Every wait is bounded by the run's deadline (nanoseconds of the device clock,
// not spin counts).  A wait that succeeds moves the deadline out by one window:
// the window bounds the time *without progress*, so a collective whose gang has
// formed runs to the end, and one whose peers are absent is preempted.
#pragma once

#include "block_env.cuh"

namespace dfccl {

// A failure that reached this run from elsewhere: abort_info is
// (status << 32) | the rank where it started.
DFCCL_DEV void take_relayed(TaskRun &run, uint64_t info) {
  run.status = (uint32_t)(info >> 32);
  run.detail = (int32_t)(info & 0xffffffffu);
  run.relayed = true;
}

// Whether `abort_token`, read from a record's channel `pc`, is a give-up mark
// for this instance (push_abort's); then the run takes the reason `pc`
// carries.  The caller reads the token with the order its place needs (in a
// batch of independent loads, after a fence, or alone), so it is passed in.
DFCCL_DEV bool take_abort_mark(TaskRun &run, const dfccl_chan_state *pc, uint64_t abort_token) {
  if (abort_token != run.token) return false;
  take_relayed(run, load_relaxed(&pc->abort_info));
  return true;
}

// Whether `rank` has left the communicator (aborted or closed): then it will
// never publish or send again.  Read from the status its host keeps at the
// start of its arena.
DFCCL_DEV bool rank_left(const dfccl_endpoint *ep, uint32_t rank) {
  const dfccl_rank_status *s = ptr<const dfccl_rank_status>(ep->peer_arena[rank]);
  // Acquire: what the rank wrote into our record before it left is seen
  // after its leave (abort_pending reads the abort mark again).
  return load_acquire(&s->state) != DFCCL_RANK_LIVE;
}

// Whether `rank` left before taking part in this instance on this channel:
// then nothing it owes will ever come.  A rank that published the instance
// (or a later one of the tag) and then left owes nothing: it completed its
// part, or it gave the instance up and pushed that into the records of the
// peers it talks to, and a dead process is reported by the host (PEER_LOST).
// Only after a leave is seen, so the probe's remote reads stay off the
// normal path.
DFCCL_DEV bool left_before_taking_part(const TaskRun &run, uint32_t rank) {
  if (!rank_left(run.ep, rank)) return false;
  const uint64_t rec = probe_record(run.ep, rank, run.d->tag_key, run.chan, run.d->instance);
  if (rec == 0) return true;
  const dfccl_chan_state *pc = record_chan(rec, run.chan);
  return load_acquire(&pc->ready) == 0 || load_relaxed(&pc->instance) < run.d->instance;
}

// Why a run must stop early, checked on the slow path of every wait: another
// block of this task failed, a neighbour pushed an abort for this instance
// into our record, the host aborted the communicator or found a peer's
// process dead (as the host link copied it into device memory), or the rank
// this wait is for (`peer`; any peer when it is not a rank) left before it
// took part.
DFCCL_DEV bool abort_pending(const BlockEnv &env, TaskRun &run, uint32_t peer) {
  const dfccl_daemon_args *a = env.args;
  uint32_t err = load_gpu(&a->slot_error[run.d->slot]);
  if (err != 0) {
    run.status = err >> 16;
    run.relayed = (err & 0x8000u) != 0;
    run.detail = (int32_t)(err & 0x7fffu) - 1;
    return true;
  }
  // The host's word first: this rank's own abort is not a peer's.
  const uint32_t ep_word = load_gpu(&a->endpoint_abort_dev[run.d->endpoint]);
  if (ep_word >= DFCCL_EP_PEER_LOST) {
    take_relayed(run, ((uint64_t)DFCCL_STATUS_PEER_LOST << 32) | (ep_word - DFCCL_EP_PEER_LOST));
    return true;
  }
  if (ep_word != 0) {
    run.status = DFCCL_STATUS_ABORTED;
    run.detail = -1;
    return true;
  }
  if (take_abort_mark(run, run.mine, load_acquire(&run.mine->abort_token))) return true;
  const dfccl_endpoint *ep = run.ep;
  // The peer waited for gave this instance up and marked its own record
  // (push_abort), where a rank that met it before the mark looks only here:
  // its push into our record can miss us when it had not met us yet.
  if (peer < ep->nranks && peer != ep->rank) {
    const uint64_t rec = probe_record(ep, peer, run.d->tag_key, run.chan, run.d->instance);
    const dfccl_chan_state *pc = rec != 0 ? record_chan(rec, run.chan) : nullptr;
    if (pc != nullptr && take_abort_mark(run, pc, load_acquire(&pc->abort_token))) return true;
  }
  for (uint32_t p = peer < ep->nranks ? peer : 0; p < ep->nranks; ++p) {
    if (p != ep->rank && left_before_taking_part(run, p)) {
      // A rank that gave the instance up before publishing it (a mismatch
      // it saw in our record, say) marked our record before it completed
      // and left; the mark may have landed after the read above.  Read it
      // again now that the leave is seen: it says why.
      if (take_abort_mark(run, run.mine, load_acquire(&run.mine->abort_token))) return true;
      take_relayed(run, ((uint64_t)DFCCL_STATUS_PEER_ABORTED << 32) | p);
      return true;
    }
    if (peer < ep->nranks) break;
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
        spin_pause(spins);
        state = ready();
        if (state != 0) break;
        if ((++spins & 3u) == 0) {
          // Diagnostics: whom this collective waits for, visible to the host
          // while it waits (Work.synchronize timeouts name the rank).
          if (spins == 16) store_relaxed(&env.args->slot_waiting[run.d->slot], peer + 1);
          // The daemon is leaving: stop at this wait like at a deadline.
          const bool expired =
              now_ns() >= run.deadline_ns || load_gpu(&env.args->state->quit_epoch) == env.args->epoch;
          // Aborts are checked every 256 spins (one word is in host memory)
          // and whenever the run is about to be preempted.
          if (((spins & 255u) == 0 || expired) && abort_pending(env, run, peer)) {
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
