// Complete: a block finishes its channel part of a task; the last part to
// finish writes the slot's result and then its completion word, which the host
// polls (Work.synchronize) and streams wait on (cuStreamWaitValue32).
#pragma once

#include "graph.cuh"

namespace dfccl {

// Records the first failure of a task so that its other channels stop too.
DFCCL_DEV void record_failure(const BlockEnv &env, const TaskRun &run) {
  // status | relayed (bit 15) | detail + 1 (ranks < DFCCL_MAX_RANKS)
  const uint32_t word = (run.status << 16) | (run.relayed ? 0x8000u : 0u) | ((uint32_t)(run.detail + 1) & 0x7fffu);
  atomic_cas_local(&env.args->slot_error[run.d->slot], 0u, word);
}

// The leader, for a task on one channel: its result is this block's context
// alone, so there is no slot counter to count on, no other context to read and
// no error word to collect (a failure of this run is in ctx->status; the word
// record_failure set is reset).  Saves an atomic and ~8 dependent reads of
// device memory per collective, the common case for small messages.
DFCCL_DEV void complete_single(const dfccl_daemon_args *a, const dfccl_task_ctx *ctx) {
  const uint32_t slot = ctx->desc.slot;
  dfccl_result res = empty_result(ctx->status, 1);
  res.detail = ctx->detail;
  res.preemptions = ctx->preemptions;
  res.resumes = ctx->resumes;
  res.queued_ns = ctx->first_run_ns > ctx->pulled_ns ? ctx->first_run_ns - ctx->pulled_ns : 0;
  res.running_ns = ctx->running_ns;
  res.wall_ns = ctx->finish_ns > ctx->first_run_ns ? ctx->finish_ns - ctx->first_run_ns : 0;
  res.waiting_on = ctx->waiting_on;
  res.max_wait_ns = ctx->max_wait_ns;
  if (res.status != DFCCL_STATUS_OK) store_gpu(&a->slot_error[slot], 0u);
  graph_retire(a, &ctx->desc);
  publish_result(a, slot, ctx->desc.gen, res);
  graph_flag_failure(a, &ctx->desc, res.status);
}

// The leader.  The other blocks' contexts are read with strong (GPU-scope)
// loads: this block may hold stale L1 lines of them from an earlier use of the
// slot.
DFCCL_DEV void complete_channel(const BlockEnv &env, const TaskRun &run, uint64_t now) {
  const dfccl_daemon_args *a = env.args;
  const dfccl_task_desc *d = run.d;
  dfccl_task_ctx *ctx = run.ctx;
  ctx->status = run.status;
  ctx->detail = run.detail;
  ctx->state = DFCCL_CTX_DONE;
  ctx->finish_ns = now;
  // acq_rel: this block's writes (its movers' data, gathered by the move
  // barrier, and the context above) are ordered before the count, and the
  // last block to count sees every block's; its release below publishes
  // them all to the host.
  const uint32_t slot = d->slot;
  if (d->nchannels == 1) {
    complete_single(a, ctx);
    return;
  }
  const uint32_t finished = atomic_add_local(&a->slot_counter[slot], 1u) + 1u;
  if (finished != d->nchannels) return;

  dfccl_result res = empty_result(DFCCL_STATUS_OK, d->nchannels);
  for (uint32_t c = 0; c < d->nchannels; ++c) {
    dfccl_task_ctx *cb = ctx_at(a, slot, block_of(d, c, a->nblocks));
    const uint64_t pulled = load_gpu(&cb->pulled_ns);
    const uint64_t first = load_gpu(&cb->first_run_ns);
    const uint64_t finish = load_gpu(&cb->finish_ns);
    const uint64_t waited = load_gpu(&cb->max_wait_ns);
    if (waited > res.max_wait_ns) res.max_wait_ns = waited;
    const uint64_t running = load_gpu(&cb->running_ns);
    res.preemptions += load_gpu(&cb->preemptions);
    res.resumes += load_gpu(&cb->resumes);
    if (first > pulled && first - pulled > res.queued_ns) res.queued_ns = first - pulled;
    if (running > res.running_ns) res.running_ns = running;
    if (finish > first && finish - first > res.wall_ns) res.wall_ns = finish - first;
    const uint32_t w = load_gpu(&cb->waiting_on);
    if (w != 0) res.waiting_on = w;
  }
  const uint32_t err = load_gpu(&a->slot_error[slot]);
  if (err != 0) {
    res.status = err >> 16;
    res.detail = (int32_t)(err & 0x7fffu) - 1;
  }
  // Reset the slot's device words before the host may reuse the slot.
  store_gpu(&a->slot_counter[slot], 0u);
  store_gpu(&a->slot_error[slot], 0u);
  graph_retire(a, d);
  // One system-scope release: the result and every block's data (gathered
  // by the slot counter) before the completion word.
  publish_result(a, slot, d->gen, res);
  graph_flag_failure(a, d, res.status);
}

}  // namespace dfccl
