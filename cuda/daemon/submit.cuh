// Submit (device side): a block pulls the submission-queue entries the host
// published since its last pull into its own active list.  Each block keeps
// its own head, so blocks never wait for one another here.
#pragma once

#include "block_env.cuh"

namespace dfccl {

// Host-memory reads cross PCIe; with every idle block polling the tail back to
// back they queue up and slow every host access of the busy blocks.  So the
// tail is read from host memory at most once per kTailPollNs across the whole
// daemon, by whichever block comes first, and mirrored in device memory where
// the other blocks read it.
constexpr uint64_t kTailPollNs = 1000;

DFCCL_DEV uint64_t submission_tail(const dfccl_daemon_args *a, uint64_t head) {
  dfccl_daemon_state *st = a->state;
  uint64_t tail = load_acquire(&st->tail_mirror);
  if (tail != head) return tail;
  const uint64_t now = now_ns();
  const uint64_t last = load_relaxed(&st->tail_poll_ns);
  if (now - last < kTailPollNs && now >= last) return tail;
  store_relaxed(&st->tail_poll_ns, now);
  tail = load_acquire(&a->control->sq_tail);
  atomic_max_release(&st->tail_mirror, tail);
  return tail;
}

// The leader.  Returns how many entries were consumed.
DFCCL_DEV uint32_t pull_submissions(const BlockEnv &env, uint32_t *active, uint32_t &active_len) {
  const dfccl_daemon_args *a = env.args;
  uint64_t head = a->state->sq_head[env.block];
  const uint64_t tail = submission_tail(a, head);
  if (head == tail) return 0;
  const uint64_t t0 = now_ns();
  uint32_t pulled = 0;
  for (; head < tail; ++head, ++pulled) {
    const dfccl_task_desc *sqe = &a->ring[head & (a->ring_size - 1)];
    // The descriptor is in host memory: six independent 16-byte loads.
    pack16 words[sizeof(dfccl_task_desc) / 16];
#pragma unroll
    for (int i = 0; i < (int)(sizeof(dfccl_task_desc) / 16); ++i) words[i] = load_pack(ptr<const pack16>((uint64_t)sqe) + i);
    const dfccl_task_desc *d = reinterpret_cast<const dfccl_task_desc *>(words);
    if (env.block >= d->nchannels) continue;
    dfccl_task_ctx *ctx = ctx_at(a, d->slot, env.block);
    ctx->desc = *d;
    ctx->state = DFCCL_CTX_PULLED;
    ctx->step = 0;
    ctx->fails = 0;
    ctx->sticky = 0;
    for (int i = 0; i < 4; ++i) ctx->pos[i] = 0;
    ctx->pulled_ns = t0;
    ctx->first_run_ns = 0;
    ctx->running_ns = 0;
    ctx->finish_ns = 0;
    ctx->max_wait_ns = 0;
    ctx->preemptions = 0;
    ctx->resumes = 0;
    ctx->waiting_on = 0;
    ctx->status = DFCCL_STATUS_OK;
    ctx->detail = -1;
    ctx->nbr_slots = 0;
    ctx->nbr_fifo = 0;
    for (int i = 0; i < DFCCL_PEER_CACHE; ++i) ctx->peer_rec[i] = 0;
    active[active_len++] = d->slot;
  }
  a->state->sq_head[env.block] = head;
  store_relaxed(&a->control->sq_head[env.block], head);
  return pulled;
}

}  // namespace dfccl
