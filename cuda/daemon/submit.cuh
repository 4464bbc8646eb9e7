// Submit (device side): a block pulls the submission-queue entries published
// since its last pull into its own active list, from the device ring the host
// link fills (link.cuh).  Each block keeps its own head, so blocks never wait
// for one another here.
#pragma once

#include "graph.cuh"
#include "link.cuh"
#include "reduce.cuh"

namespace dfccl {

// The leader, at pull time: the instances of one tag must run one after the
// other on each channel (they share the tag's record there).  The bucket's
// owner words (dfccl_owner_bucket.chain) name the latest instance of the tag
// pulled on this channel; if it is still pending here, the new one is chained behind it and
// stays off the active list until it completes (run_one promotes it in
// place).  So the active list holds one task per tag at most, and a burst of
// instances of one tag costs nothing per scheduler pass.  Returns true if
// chained.  Every instance of a tag runs a channel on the same block
// (first_block), so only this block's leader touches these words while the
// tag holds the bucket, and plain accesses suffice.  A bucket changes tags
// only when no instance of the old tag is pending, so words another block
// wrote for an old tag (or a stale copy of them) name an instance that is
// over; the previous context is checked by token, since its slot may have
// been reused since, and by state.
DFCCL_DEV bool chain_behind_pending(const BlockEnv &env, const dfccl_task_desc *d, uint32_t chan,
                                     const dfccl_endpoint *ep) {
  const dfccl_daemon_args *a = env.args;
  dfccl_owner_chain *mine = &owner_bucket(ep, d->bucket)->chain[chan];
  const uint64_t last_token = load_own(&mine->token);
  const uint64_t last_slot = load_own(&mine->slot);
  mine->token = instance_token(d->tag_key, d->instance);
  mine->slot = (uint64_t)d->slot + 1;
  if (last_token == 0 || last_slot == 0 || last_slot > a->nslots) return false;
  dfccl_task_ctx *prev = ctx_at(a, (uint32_t)last_slot - 1, env.block);
  if (prev->state == DFCCL_CTX_DONE || prev->state == DFCCL_CTX_FREE) return false;
  if (instance_token(prev->desc.tag_key, prev->desc.instance) != last_token) return false;
  prev->successor = d->slot + 1;
  return true;
}

// The leader, at pull time, for the first channel of a task the host marked
// DFCCL_TASK_KEY_BUCKET (no instance in its bucket has retired yet, so the
// bucket may never have held a tag): a bucket whose key is 0 takes this
// tag's key now, not only at the first publish.  Peers find a record by
// probing from the tag's home bucket and stop at a key of 0 (block_env.cuh,
// probe_record); a bucket the host has claimed for a tag that has not
// published yet (its stream has not reached it, say) must not end the probe
// for a later tag the host placed past it, else that tag's peers could not
// meet it until the first one runs: a wait on an unrelated collective, a
// deadlock when that one waits for this one.  A bucket that holds another
// tag's key keeps it until the publish (the LL handover reads it).  A
// compare-and-swap whose result is not waited for, and only for a bucket's
// first instances, so the steady state pays nothing.
DFCCL_DEV void claim_fresh_bucket(uint64_t rec, uint64_t tag_key) {
  (void)cas_relaxed(&ptr<dfccl_record_header>(rec)->key, 0ull, tag_key);
}

// The leader, at pull time: whether a descriptor can be run at all.  Every
// field that indexes device memory or divides is checked, so a corrupt or
// hostile descriptor is rejected (DFCCL_STATUS_BAD_TASK), never run.  Every
// block decides the same way from the same bytes.
DFCCL_DEV bool valid_task(const dfccl_daemon_args *a, const dfccl_task_desc *d) {
  if (d->slot >= a->nslots) return false;
  if (d->kind >= DFCCL_NUM_KINDS || d->dtype >= DFCCL_NUM_DTYPES || d->op >= DFCCL_NUM_OPS ||
      d->path >= DFCCL_NUM_PATHS)
    return false;
  if (d->nchannels == 0 || d->nchannels > a->nblocks || d->first_block >= a->nblocks) return false;
  if (d->endpoint >= a->max_endpoints || d->instance == 0 || (d->after >> 32) > a->nslots) return false;
  // The endpoint's words tested at once, so that their loads share a round
  // trip (tested one by one, each load waited for the test before it).
  const dfccl_endpoint *ep = &a->endpoints[d->endpoint];
  const uint32_t nranks = ep->nranks, rank = ep->rank, capacity = ep->table_capacity;
  const bool ep_ok = (nranks - 1u < DFCCL_MAX_RANKS) & (rank < nranks) & (d->bucket < capacity) & (d->root < nranks);
  if (!ep_ok) return false;
  if (nranks > 1 && d->path == DFCCL_PATH_RING) {
    const uint32_t esize = dtype_size(d->dtype);
    if (d->slice_bytes < esize || d->slice_bytes % esize != 0 || d->fifo_slots == 0) return false;
  }
  return true;
}

// Block 0's leader completes a rejected descriptor at once (no channel ever
// runs it); one whose slot is out of range cannot be reported there and is
// only counted.
DFCCL_DEV void reject_task(const dfccl_daemon_args *a, const dfccl_task_desc *d) {
  atomic_add(&a->state->bad_tasks, 1ull);
  if (d->slot >= a->nslots) return;
  graph_retire(a, d);
  publish_result(a, d->slot, d->gen, empty_result(DFCCL_STATUS_BAD_TASK, 0));
  graph_flag_failure(a, d, DFCCL_STATUS_BAD_TASK);
}

// The leader: device-ring entry `i`, every word in flight at once
// (load_pack_early).
DFCCL_DEV void load_entry(const dfccl_daemon_args *a, uint64_t i, pack16 *words) {
  const pack16 *sqe = ptr<const pack16>((uint64_t)&a->dev_ring[i & (a->ring_size - 1)]);
#pragma unroll
  for (int w = 0; w < kDescWords; ++w) words[w] = load_pack_early(sqe + w);
}

constexpr uint32_t kNoSlot = 0xffffffffu;

// The leader: takes a pulled entry (`words`) into this block's list if one
// of its channels runs here.  `ready`: see pull_submissions.
DFCCL_DEV void take_entry(const BlockEnv &env, const pack16 *words, uint64_t pulled_ns, bool was_empty, uint32_t *active,
                          uint32_t &active_len, uint32_t &ready) {
  const dfccl_daemon_args *a = env.args;
  const dfccl_task_desc *d = reinterpret_cast<const dfccl_task_desc *>(words);
  // Another block's task: nothing to look up (the channel needs only the
  // descriptor; a bad one is block 0's to report).
  const uint32_t chan = channel_of(d, env.block, a->nblocks);
  if (env.block != 0 && chan >= d->nchannels) return;
  if (!valid_task(a, d)) {
    if (env.block == 0) reject_task(a, d);
    return;
  }
  if (chan >= d->nchannels) return;
  const dfccl_endpoint *ep = &a->endpoints[d->endpoint];
  const uint64_t rec = record_at(ep, ep->rank, d->bucket);
  if (chan == 0 && (d->flags & DFCCL_TASK_KEY_BUCKET)) claim_fresh_bucket(rec, d->tag_key);
  const bool chained = chain_behind_pending(env, d, chan, ep);
  dfccl_task_ctx *ctx = ctx_at(a, d->slot, env.block);
  ctx->desc = *d;
  ctx->channel = chan;
  ctx->state = (d->flags & DFCCL_TASK_ARMED) ? DFCCL_CTX_ARMED : DFCCL_CTX_PULLED;
  ctx->step = 0;
  ctx->fails = 0;
  ctx->sticky = 0;
  for (int i = 0; i < 4; ++i) ctx->pos[i] = 0;
  ctx->pulled_ns = pulled_ns;
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
  ctx->successor = 0;
  for (int i = 0; i < DFCCL_PEER_CACHE; ++i) ctx->peer_rec[i] = 0;
  if (chained) return;
  if (was_empty && active_len == 0 && (d->flags & DFCCL_TASK_ARMED) && d->after == 0) ready = d->slot;
  active[active_len++] = d->slot;
}

// The leader.  `head`: this block's consumed count, kept in a register by the
// caller and stored to device memory (where the host link reads it) when it
// moves.  Returns how many entries were consumed.  The pull time (a task's
// "queued" starts there) is read here, not at the start of the pass: the host
// link's round trips earlier in the same pass are the pickup, not queueing.
// `ready`: the slot of the task now at active[0] when the list was empty and
// that task may run at once (host-armed, no `after`), else kNoSlot; the
// scheduler then runs it without a pick, which would only read back what
// the pull just wrote.
//
// Every dependent round trip here delays the task's first run
// (docs/performance-log.md, section 13).  An entry costs one (its words, all
// in flight at once; the first two entries share it), an entry for other
// blocks nothing more (block 0 still checks every entry, to reject bad
// ones), and a task of this block four more (endpoint, own record's
// address, chain words in device memory, the chained-on context).
DFCCL_DEV uint32_t pull_submissions(const BlockEnv &env, uint32_t *active, uint32_t &active_len, uint64_t &head,
                                    uint32_t &ready) {
  const dfccl_daemon_args *a = env.args;
  dfccl_daemon_state *st = a->state;
  ready = kNoSlot;
  const uint64_t tail = load_acquire_gpu(&st->sq_avail);
  if (head == tail) return 0;
  const uint64_t t0 = now_ns();
  const bool was_empty = active_len == 0;
  const uint32_t len_before = active_len;
  // The first two entries in flight together (in a loop that loaded the next
  // entry ahead, ptxas moved the current one out of the registers the next
  // one was loaded into, and so waited for it first); later ones of a burst
  // one at a time.  On the GPU the second is loaded even when there is
  // none: a ring entry past the tail is ring memory, read and ignored, and
  // an unconditional load needs nothing kept for the case without it (the
  // simulator reads only published entries: there, a read racing the
  // link's copy would be a data race).
  pack16 first[kDescWords], second[kDescWords];
  load_entry(a, head, first);
  if (DFCCL_GPU || head + 1 < tail) load_entry(a, head + 1, second);
  take_entry(env, first, t0, was_empty, active, active_len, ready);
  if (head + 1 < tail) {
    take_entry(env, second, t0, was_empty, active, active_len, ready);
    for (uint64_t i = head + 2; i < tail; ++i) {
      load_entry(a, i, first);
      take_entry(env, first, t0, was_empty, active, active_len, ready);
    }
  }
  const uint32_t pulled = (uint32_t)(tail - head);
  head = tail;
  store_gpu(&st->sq_head[env.block], head);
  if (active_len != len_before) store_gpu(&st->active_len[env.block], active_len);  // for block 0's empty quit
  return pulled;
}

// The leader: takes the graph replays armed since `seen` (graph.cuh) into
// this block's list, as pull_submissions takes ring entries.  Runs only when
// graph_seq moved: then it scans the mask of armed replays, a word per 32
// slots, and takes each replay this block's context of the slot does not
// name yet (a replay it took before, or one of another block's channels, is
// passed over; a replay still being written is taken at the scan its
// graph_seq bump brings).  Returns how many it took.
DFCCL_DEV uint32_t pull_graph_replays(const BlockEnv &env, uint32_t *active, uint32_t &active_len, uint64_t &seen,
                                      uint32_t &ready) {
  const dfccl_daemon_args *a = env.args;
  ready = kNoSlot;
  const uint64_t seq = load_acquire_gpu(&a->state->graph_seq);
  if (seq == seen) return 0;
  seen = seq;
  const uint64_t t0 = now_ns();
  const bool was_empty = active_len == 0;
  const uint32_t len_before = active_len;
  uint32_t taken = 0;
  for (uint32_t w = 0; w < (a->nslots + 31u) / 32u; ++w) {
    uint32_t bits = load_gpu(&a->graph_mask[w]);
    while (bits != 0) {
      uint32_t b = 0;
      while (!(bits & (1u << b))) ++b;
      bits &= bits - 1u;
      const uint32_t slot = w * 32u + b;
      pack16 words[kDescWords];
      if (!graph_read(a, slot, words)) continue;
      const dfccl_task_desc *d = reinterpret_cast<const dfccl_task_desc *>(words);
      const dfccl_task_ctx *ctx = ctx_at(a, slot, env.block);
      if (ctx->desc.gen == d->gen && ctx->desc.tag_key == d->tag_key && ctx->desc.instance == d->instance) continue;
      const uint32_t before = active_len;
      take_entry(env, words, t0, was_empty && taken == 0, active, active_len, ready);
      taken += active_len != before ? 1u : 0u;
    }
  }
  if (active_len != len_before) store_gpu(&a->state->active_len[env.block], active_len);
  return taken;
}

}  // namespace dfccl
