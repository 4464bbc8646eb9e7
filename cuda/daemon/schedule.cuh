// Schedule: the loop every daemon block runs, on the GPU and in the simulator.
//
//   for (;;) {
//     pull new submissions into this block's active list      (submit.cuh)
//     leave if the daemon is quitting (idle, or the host asks)
//     pick the next runnable task, round robin over the list (oldest first)
//     run it from its saved step until done / failed / preempted (transfer.cuh)
//     save its context; on completion publish the result       (complete.cuh)
//   }
//
// Preemption policy (the one place it lives): see preemption_window().
#pragma once

#include "complete.cuh"
#include "submit.cuh"
#include "transfer.cuh"

namespace dfccl {

constexpr uint32_t kNoTask = 0xffffffffu;
constexpr uint32_t kPolicyRefreshPasses = 64;
constexpr uint32_t kMaxHandoffs = 4;  // chained successors run back to back before a full pass

// Per-block copy of the host-published policy words (refreshed periodically:
// they live in host memory, a PCIe round trip away).
struct PolicyCache {
  uint64_t base_window_ns, max_window_ns, idle_quit_ns;
  uint32_t passes;
};

// How long a run may go without progress before it is preempted.
//  - base: adapted by the host to the peer skew it observes (policy.py);
//  - the oldest task in the list gets twice the window, doubled again per
//    consecutive fruitless run (bounded): ranks converge on their oldest
//    collectives, and a peer's short visit finds them waiting.  The bound
//    grows with the list: a peer's block reaches the same collective once
//    per round of its own list, about `len` windows, and the oldest must be
//    able to outwait that round;
//  - once data has moved (the gang has formed) the run is sticky: 16 x base,
//    but only in a short list.  In a long one nearly every task has moved
//    data (a FIFO takes a few slices before the peer is there), so sticky
//    windows would make every visit of a round a long wait for a peer busy
//    with its own round, for a slice or two of progress each;
//  - every other task gets the base window: a collective whose peers are
//    absent costs one short window per pass.  In a long list the others
//    share kStickyListMax base windows per round (down to a single check
//    each), so that a round stays about as long as the oldest's window: the
//    peer's block, on its own round, then finds the oldest waiting most of
//    the time, instead of once in `len` windows (a queue of hundreds of
//    collectives through minimum FIFOs advanced a slice or two per round);
//  - never more than max_window_ns, so the daemon stays responsive.
// Deadlock freedom does not rest on these numbers: every step a run completes
// (publishing, sending a slice, signalling a phase) persists across
// preemptions, so any collective all ranks keep visiting completes.
constexpr uint32_t kStickyListMax = 8;     // longest list that still gets sticky windows
constexpr uint32_t kOldestDoublings = 6;   // fruitless-run doublings of the oldest in a short list

DFCCL_DEV uint64_t preemption_window(const PolicyCache &p, const dfccl_task_ctx *ctx, bool oldest, uint32_t len) {
  const uint64_t cap = p.max_window_ns;
  const uint64_t base = p.base_window_ns;
  if (base >= cap) return cap;
  // Saturating: no product below exceeds cap, so nothing overflows.
  uint64_t w = base;
  if (oldest) {
    // 2^doublings >= len: the window can reach a whole round of the list.
    uint32_t doublings = kOldestDoublings;
    while (doublings < 31 && (1u << doublings) < len) ++doublings;
    w = w > cap / 2 ? cap : 2 * w;
    for (uint32_t i = 0; i < ctx->fails && i < doublings && w < cap; ++i) w = w > cap / 2 ? cap : 2 * w;
  }
  if (ctx->sticky && len <= kStickyListMax && w < cap)
    w = base > cap / 16 ? cap : (w > 16 * base ? w : 16 * base);
  if (!oldest && len > kStickyListMax) w = base / len * kStickyListMax;   // zero: check once, move on
  return w < cap ? w : cap;
}

// The leader: may this task run now?  It must be armed (a stream-ordered
// submission is armed when its stream gets there), and past its `after`.
// Earlier instances of its tag on this channel are done: it entered the
// active list only then (chain_behind_pending in submit.cuh).  A task that
// follows a failed one (DFCCL_TASK_FOLLOWS) is doomed: it runs only to fail.
DFCCL_DEV bool runnable(const BlockEnv &env, dfccl_task_ctx *ctx) {
  if (ctx->state == DFCCL_CTX_PULLED) {
    // Device memory, written by the submitting stream's cuStreamWriteValue32.
    if (load_acquire(&env.args->armed[ctx->desc.slot]) != ctx->desc.gen) return false;
    ctx->state = DFCCL_CTX_ARMED;
  }
  if (ctx->desc.after != 0) {
    // An earlier instance of the tag lays the shared staging out differently:
    // it must be over on every channel first (its completion word carries its
    // generation or, once the slot was reused, a later one).  Host memory:
    // only such instances pay this read, until it passes.
    const uint32_t slot = (uint32_t)(ctx->desc.after >> 32) - 1u;
    const uint32_t gen = (uint32_t)ctx->desc.after;
    if ((int32_t)(load_acquire(&env.args->done[slot]) - gen) < 0) return false;
    // The host keeps a followed slot until its follower retired, so its
    // result is still the one it published before the word just read.
    if ((ctx->desc.flags & DFCCL_TASK_FOLLOWS) && load_relaxed(&env.args->results[slot].status) != DFCCL_STATUS_OK)
      ctx->state = DFCCL_CTX_DOOMED;
    ctx->desc.after = 0;
  }
  return true;
}

// The leader: the index of the next runnable task from `cursor` on, and its
// slot in `slot`.
DFCCL_DEV uint32_t pick_task(const BlockEnv &env, const uint32_t *active, uint32_t len, uint32_t cursor,
                             uint32_t &slot) {
  for (uint32_t i = 0; i < len; ++i) {
    uint32_t idx = (cursor + i) % len;
    slot = active[idx];
    if (runnable(env, ctx_at(env.args, slot, env.block))) return idx;
  }
  return kNoTask;
}

DFCCL_DEV uint64_t daemon_state_word(uint32_t epoch, uint32_t state) {
  return ((uint64_t)epoch << DFCCL_DAEMON_EPOCH_SHIFT) | state;
}

// The leader.  Block 0 decides when the whole daemon leaves: on the host's
// request, when no block has made progress for idle_quit_ns (work waits:
// peers absent, streams not there yet), or, sooner, for empty_quit_ns with
// every block's list empty (nothing to do: a resident daemon would only
// hold its SMs, make device-wide synchronisations and cuMemFree wait, and
// delay other kernels' first launches).  Before it
// commits to an idle quit it announces QUITTING and re-reads the submission
// tail and the count of collectives that streams wait for; the host writes
// those and then reads the state (the two halves of Dekker's protocol).  Its
// decision is then published as RUNNING (it stays: new work, or a stream
// waits) or LEAVING, and a host that saw QUITTING waits for it, so that no
// launch is queued behind a daemon that stays:
//   - a submission is never stranded: either the daemon sees it and stays,
//     or the host sees QUITTING, then LEAVING, and launches again;
//   - the daemon never leaves while a stream waits for one of its
//     collectives (a graph replay pending counts: graph.cuh).  Its relaunch could not be trusted to run: the launch may
//     be queued on the same hardware queue as the waiting stream, behind the
//     wait (CUDA_DEVICE_MAX_CONNECTIONS=1, or MPS), and then neither ever
//     runs.  Leaving would not help a device synchronisation either: it
//     waits for that stream.
//
// `q`: the words it reads first, loaded before the pull (quit_words), so that
// their round trip overlaps the pull's.  `pulled`: this pass pulled work,
// which is progress: no idle quit.
struct QuitWords {
  uint64_t epoch, request;
};

DFCCL_DEV QuitWords quit_words(const BlockEnv &env) {
  const dfccl_daemon_state *st = env.args->state;
  QuitWords q;
  q.epoch = load_early(&st->quit_epoch);
  q.request = env.block == 0 ? load_early(&st->quit_request) : 0;
  return q;
}

// Block 0's leader: every block has pulled what block 0 has, and has
// nothing in its list (each leader stores its length when it changes and
// its ring position when it pulls).  The loads go out eight blocks at a
// time, not one round trip per block.  An entry that block 0 has not pulled
// yet is caught by the handshake that follows (it re-reads the tail).
DFCCL_DEV bool nothing_left(const BlockEnv &env) {
  const dfccl_daemon_args *a = env.args;
  const dfccl_daemon_state *st = a->state;
  if (env.sm->active_len != 0) return false;
  const uint64_t head = load_gpu(&st->sq_head[0]);
  uint64_t differ = 0;
  // Eight blocks' words in flight at a time (registers are the daemon's scarcest resource).
  for (uint32_t b0 = 1; b0 < a->nblocks; b0 += 8) {
    uint32_t len[8];
    uint64_t pos[8];
#pragma unroll
    for (uint32_t i = 0; i < 8; ++i) {
      const bool in = b0 + i < a->nblocks;
      len[i] = in ? load_gpu(&st->active_len[b0 + i]) : 0;
      pos[i] = in ? load_gpu(&st->sq_head[b0 + i]) : head;
    }
#pragma unroll
    for (uint32_t i = 0; i < 8; ++i) differ |= (uint64_t)len[i] | (pos[i] ^ head);
  }
  return differ == 0;
}

DFCCL_DEV bool should_quit(const BlockEnv &env, const PolicyCache &p, uint64_t now, const QuitWords &q, bool pulled) {
  const dfccl_daemon_args *a = env.args;
  dfccl_daemon_state *st = a->state;
  if (q.epoch == a->epoch) return true;
  if (env.block != 0) return false;
  dfccl_control *ctrl = a->control;
  bool quit = q.request != 0;
  if (!quit) {
    if (pulled) return false;
    const uint64_t last = load_gpu(&st->last_progress_ns);
    if (now < last) return false;
    const uint64_t quiet = now - last;
    if (quiet < p.idle_quit_ns && (quiet < a->empty_quit_ns || !nothing_left(env))) return false;
    store_release(&ctrl->daemon_state, daemon_state_word(a->epoch, DFCCL_DAEMON_QUITTING));
    fence_seq_cst();
    // From host memory, not the link's copy: this read is the daemon's half
    // of the handshake.
    const uint64_t tail = load_acquire(&ctrl->sq_tail);
    const uint64_t stream_waits = load_acquire(&ctrl->stream_waits);
    // A graph replay pending is a stream waiting too (its graph's captured wait).
    const uint64_t graph_pending = load_gpu(&st->graph_pending);
    if (tail != st->sq_head[0] || stream_waits != 0 || graph_pending != 0) {
      // Staying for a stream restarts the idle clock: the next look is
      // idle_quit_ns away, not one pass.
      if (stream_waits != 0 || graph_pending != 0) atomic_max_local(&st->last_progress_ns, now);
      store_release(&ctrl->daemon_state, daemon_state_word(a->epoch, DFCCL_DAEMON_RUNNING));
      return false;
    }
    store_release(&ctrl->daemon_state, daemon_state_word(a->epoch, DFCCL_DAEMON_LEAVING));
  }
  store_release_gpu(&st->quit_epoch, (uint64_t)a->epoch);
  return true;
}

// Runs active[pick] once; the leader saves its context and, when it is over,
// completes it and takes it off the active list.  `picked_ns`: when the
// scheduler chose it (leader), for the block's profile (`prof`, the leader's
// register copy).  `handoffs`: how many runs this pass already handed the
// channel on without a scheduler pass.
DFCCL_DEV void run_one(BlockEnv &env, const PolicyCache &policy, dfccl_block_profile &prof, uint32_t *active,
                       uint32_t pick, uint64_t picked_ns, uint32_t handoffs) {
  const dfccl_daemon_args *a = env.args;
  BlockShared *sm = env.sm;
  if (is_leader()) sm->handoff = 0;
  // The slot from shared memory: active[pick] in device memory is a round
  // trip, and the leader knows it.
  dfccl_task_ctx *ctx = ctx_at(a, sm->slot, env.block);
  TaskRun run;
  run.ctx = ctx;
  run.d = &ctx->desc;
  run.ep = &a->endpoints[run.d->endpoint];
  run.chan = ctx->channel;
  run.mine = record_chan(record_at(run.ep, run.ep->rank, run.d->bucket), run.chan);
  run.token = instance_token(run.d->tag_key, run.d->instance);
  run.step = ctx->step;
  for (int i = 0; i < 4; ++i) run.pos[i] = ctx->pos[i];
  run.waiting_on = 0;
  run.status = DFCCL_STATUS_OK;
  run.detail = -1;
  run.relayed = false;
  run.progressed = false;
  run.net = env.net;
  run.window_ns = 0;
  run.deadline_ns = 0;
  run.max_wait_ns = 0;
  uint64_t start = 0;
  if (is_leader()) {
    start = now_ns();
    run.window_ns = preemption_window(policy, ctx, pick == 0, sm->active_len);
    run.deadline_ns = start + run.window_ns;
    if (ctx->first_run_ns == 0) ctx->first_run_ns = start;
    else ctx->resumes += 1;  // every later run follows a preemption
  }

  int rc;
  if (ctx->state == DFCCL_CTX_DOOMED) {
    // Gives the instance up before taking part: peers that wait for this
    // rank find the mark (push_abort) and fail as well.
    run.status = DFCCL_STATUS_PEER_ABORTED;
    run.detail = (int32_t)run.ep->rank;
    rc = RUN_FAILED;
  } else {
    rc = run_transfer(env, run);
  }
  if (rc == RUN_FAILED) {
    push_abort(env, run, run.d->path == DFCCL_PATH_DIRECT);
    if (is_leader()) record_failure(env, run);
  }

  if (is_leader()) {
    const uint64_t end = now_ns();
    env.net = run.net;
    ctx->step = run.step;
    for (int i = 0; i < 4; ++i) ctx->pos[i] = run.pos[i];
    ctx->running_ns += end - start;
    if (run.max_wait_ns > ctx->max_wait_ns) ctx->max_wait_ns = run.max_wait_ns;
    if (run.progressed) atomic_max_local(&a->state->last_progress_ns, end);
    if (rc == RUN_PREEMPTED) {
      ctx->preemptions += 1;
      ctx->fails = run.progressed ? 0 : ctx->fails + 1;
      ctx->sticky = run.progressed ? 1 : 0;
      ctx->waiting_on = run.waiting_on;
      store_relaxed(&a->slot_waiting[run.d->slot], run.waiting_on);  // live (host memory), for timeouts
      sm->cursor = pick + 1;
    } else {
      uint64_t t = end;
      complete_channel(env, run, end);
      step_mark(env, &dfccl_step_profile::complete_ns, t);
      // The next instance of its tag (if one is chained) takes its place;
      // otherwise it leaves the list.  Round robin goes on at `pick` either
      // way: going back to the oldest after every completion would re-walk
      // every stalled task per completion, quadratic with many pending.  The
      // oldest keeps its priority through its longer window.
      if (ctx->successor != 0) {
        const uint32_t next = ctx->successor - 1;
        active[pick] = next;
        // Hand the channel straight to the successor when it may run: the
        // scheduler pass in between (host link, pull, quit check, pick) has
        // nothing to add for it.  Bounded, so that pulls and the other
        // tasks wait at most kMaxHandoffs runs.
        if (handoffs < kMaxHandoffs && runnable(env, ctx_at(a, next, env.block))) {
          sm->handoff = 1;
          sm->pick = pick;
          sm->slot = next;
        }
      } else {
        for (uint32_t i = pick; i + 1 < sm->active_len; ++i) active[i] = active[i + 1];
        sm->active_len -= 1;
        store_gpu(&a->state->active_len[env.block], sm->active_len);  // for block 0's empty quit
      }
      sm->cursor = pick;
    }
    prof.runs += 1;
    prof.restore_ns += start - picked_ns;
    prof.run_ns += end - start;
    prof.save_ns += now_ns() - end;
  }
  control_sync();
}

// The block's profile lives in the leader's registers (a read-modify-write of
// device memory per counter cost ~0.3 us per pass) and is stored, not added,
// to device memory every kProfileFlushPasses busy passes, on every idle pass
// and on leaving; the host reads it from there (Daemon.daemon_profile).
constexpr uint32_t kProfileFlushPasses = 16;

DFCCL_DEV void flush_steps(dfccl_step_profile *dst, const dfccl_step_profile &p) {
  if (!kStepProfile) return;
  store_gpu(&dst->ll_runs, p.ll_runs);
  store_gpu(&dst->ll_credit_ns, p.ll_credit_ns);
  store_gpu(&dst->ll_push_ns, p.ll_push_ns);
  store_gpu(&dst->ll_recv_ns, p.ll_recv_ns);
  store_gpu(&dst->ll_finish_ns, p.ll_finish_ns);
  store_gpu(&dst->complete_ns, p.complete_ns);
  store_gpu(&dst->ll_publish_ns, p.ll_publish_ns);
  store_gpu(&dst->ll_move_ns, p.ll_move_ns);
}

DFCCL_DEV void flush_profile(dfccl_block_profile *dst, const dfccl_block_profile &p) {
  store_gpu(&dst->passes, p.passes);
  store_gpu(&dst->runs, p.runs);
  store_gpu(&dst->pull_ns, p.pull_ns);
  store_gpu(&dst->pick_ns, p.pick_ns);
  store_gpu(&dst->restore_ns, p.restore_ns);
  store_gpu(&dst->run_ns, p.run_ns);
  store_gpu(&dst->save_ns, p.save_ns);
  store_gpu(&dst->idle_ns, p.idle_ns);
}

// How often a busy block checks whether the daemon is leaving: each check is
// two or three dependent reads of device memory (~0.2 us each), and leaving
// may wait a few passes.  An idle block checks on every pass.
constexpr uint32_t kQuitCheckPasses = 16;

// The leader of a block leaving the launch: the last of them (the link
// block counted) publishes EXITED, after which the host may launch again.
DFCCL_NOINLINE void note_block_exit(const dfccl_daemon_args *args) {
  const uint64_t blocks = (uint64_t)args->nblocks + (args->link_block ? 1u : 0u);
  const uint64_t left = atomic_add(&args->state->blocks_exited, 1) + 1;
  if (left % blocks == 0) store_release(&args->control->daemon_state, daemon_state_word(args->epoch, DFCCL_DAEMON_EXITED));
}

// The control warp of one block (the whole block in the simulator).
DFCCL_NOINLINE void daemon_block(const dfccl_daemon_args *args, BlockShared *sm, uint32_t block) {
  BlockEnv env;
  env.args = args;
  env.sm = sm;
  env.block = block;
  env.wparity = 0;
  env.net.valid = false;
  dfccl_daemon_state *st = args->state;
  dfccl_control *ctrl = args->control;
  uint32_t *active = args->active + (uint64_t)block * args->nslots;
  PolicyCache policy;
  policy.passes = kPolicyRefreshPasses;
  if (is_leader()) {
    sm->active_len = st->active_len[block];
    sm->cursor = st->cursor[block];
    sm->ll_done_key = 0;  // shared memory starts undefined
    st->block_sm[block] = sm_number();  // where the hardware placed this block (Daemon.daemon_sms)
    if (block == 0) store_release(&ctrl->daemon_state, daemon_state_word(args->epoch, DFCCL_DAEMON_RUNNING));
    atomic_max_local(&st->last_progress_ns, now_ns());  // a launch counts as progress
  }
  // Leader-private copies, kept in registers across passes.
  dfccl_block_profile prof = st->profile[block];
  dfccl_step_profile steps = st->steps[block];
  env.steps = &steps;
  uint64_t sq_head = st->sq_head[block];
  uint64_t graph_seen = 0;  // graph_seq as last scanned: a launch scans once (graph.cuh)
  uint64_t link_seen_ns = 0;
  uint32_t quiet_passes = 0;
  uint64_t picked_ns = 0;
  bool busy = false;  // leader: this block ran a task in its last pass
  for (;;) {
    const uint64_t t0 = is_leader() ? now_ns() : 0;
    if (!args->link_block) poll_host_link(env, busy, t0, link_seen_ns);  // the whole control warp
    if (is_leader()) {
      if (++policy.passes >= kPolicyRefreshPasses) {
        policy.passes = 0;
        policy.base_window_ns = load_gpu(&st->base_window_ns);
        policy.max_window_ns = load_gpu(&st->max_window_ns);
        policy.idle_quit_ns = load_gpu(&st->idle_quit_ns);
      }
      const bool check_quit = !busy || ++quiet_passes >= kQuitCheckPasses;
      if (check_quit) quiet_passes = 0;
      QuitWords quit_seen = {0, 0};
      if (check_quit) quit_seen = quit_words(env);
      uint32_t ready, graph_ready;
      uint32_t pulled = pull_submissions(env, active, sm->active_len, sq_head, ready);
      pulled += pull_graph_replays(env, active, sm->active_len, graph_seen, graph_ready);
      if (ready == kNoSlot) ready = graph_ready;
      const uint64_t now = pulled != 0 ? now_ns() : t0;
      if (pulled != 0) atomic_max_local(&st->last_progress_ns, now);
      sm->quit = check_quit && should_quit(env, policy, now, quit_seen, pulled != 0) ? 1u : 0u;
      if (sm->quit) {
        sm->pick = kNoTask;
      } else if (ready != kNoSlot) {
        // The list was empty and the pull left a runnable task at its head
        // (an empty list has no round-robin position to keep).
        sm->pick = 0;
        sm->slot = ready;
      } else {
        uint32_t slot = 0;
        sm->pick = pick_task(env, active, sm->active_len, sm->cursor, slot);
        sm->slot = slot;
      }
      busy = sm->pick != kNoTask;
      picked_ns = now_ns();
      prof.passes += 1;
      prof.pull_ns += now - t0;
      prof.pick_ns += picked_ns - now;
      if (!busy || prof.passes % kProfileFlushPasses == 0) {
        flush_profile(&st->profile[block], prof);
        flush_steps(&st->steps[block], steps);
      }
    }
    control_sync();
    if (sm->quit) break;
    const uint32_t pick = sm->pick;
    if (pick == kNoTask) {
      if (is_leader()) {
        idle_pause();
        prof.idle_ns += now_ns() - picked_ns;
      }
      control_sync();
      continue;
    }
    run_one(env, policy, prof, active, pick, picked_ns, 0);
    for (uint32_t handoffs = 1; sm->handoff; ++handoffs) {
      if (is_leader()) picked_ns = now_ns();
      run_one(env, policy, prof, active, sm->pick, picked_ns, handoffs);
    }
  }
  dismiss_movers(sm);
  if (is_leader()) {
    flush_profile(&st->profile[block], prof);
    flush_steps(&st->steps[block], steps);
    store_gpu(&st->active_len[block], sm->active_len);
    st->cursor[block] = sm->cursor;
    fence_system();
    note_block_exit(args);
  }
}

// The link block (dfccl_daemon_args.link_block): the host link until the
// daemon leaves, then it counts itself out like a scheduler block.
DFCCL_NOINLINE void link_block(const dfccl_daemon_args *args, BlockShared *sm) {
  BlockEnv env;
  env.args = args;
  env.sm = sm;
  env.block = args->nblocks;
  env.wparity = 0;
  env.net.valid = false;
  env.steps = nullptr;
  host_link_block(env);
  if (is_leader()) {
    fence_system();
    note_block_exit(args);
  }
}

}  // namespace dfccl
