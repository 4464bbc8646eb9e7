// What one daemon block carries while it runs: its arguments, its shared
// memory, and the state of the task run in progress.
#pragma once

#include "arch.cuh"
#include "dfccl/hash.h"
#include "dfccl/layout.h"

namespace dfccl {

// What a move does (move.cuh).
enum MoveKind : uint8_t {
  MOVE_REDUCE_COPY = 0,  // dsts = op(srcs), nelem elements (a copy for one source)
  MOVE_LL_REDUCE = 1,    // LL FINISH: dsts[0] = op over every rank's piece, from its lines
  MOVE_LL_GATHER = 2     // LL FINISH: every rank's piece, from its lines, into place at dsts[0]
};

// One data move, described by the control warp for the movers (move.cuh).
struct MoveDesc {
  uint64_t nelem;  // elements; LL moves: bytes of each rank's piece
  uint32_t nsrcs, ndsts, postdiv;
  uint8_t dtype, op, quit, kind;
  uint32_t own;    // LL moves: the source that is this rank's input (the others are LL lines)
};

// Shared by the threads of one block (GPU shared memory; a local in the
// simulator).  The leader decides, control_sync() publishes to the control
// warp, the move barriers publish to the movers.
struct BlockShared {
  uint32_t pick;           // scheduler decision for this pass
  uint32_t slot;           // active[pick]
  uint32_t quit;
  int32_t wait_result[2];  // double-buffered result of block_wait()
  MoveDesc move;
  uint64_t srcs[DFCCL_MAX_RANKS + 1];
  uint64_t dsts[2];
  uint32_t active_len;
  uint32_t cursor;
  uint32_t handoff;        // run active[pick] again at once (a chained successor)
  // The LL instance this block completed last without failure (transfer_ll.cuh,
  // ll_credit_all): the next instance of its tag needs no acknowledgement.
  uint64_t ll_done_key, ll_done_instance;
  uint32_t ll_done_endpoint, ll_done_bucket;
  // The host link (link.cuh): what the control warp read in one round trip
  // (control words, then entries), and the range left to copy.
  pack16 link_words[8 + 8 * DFCCL_LINK_AHEAD_MAX];
  uint64_t link_go, link_scan, link_avail, link_from, link_upto;
};

// Outcome of one wait, one step, one run.
enum WaitResult { WAIT_OK = 0, WAIT_EXPIRED = 1, WAIT_ABORT = 2 };
enum RunResult { RUN_DONE = 0, RUN_PREEMPTED = 1, RUN_FAILED = 2 };

// The leader's copy of its block's net queue cursors (net.cuh).  The block
// is the queue's only producer, so the copy outlives a run: the next run of
// the block takes it over (BlockEnv::net) where it names the same queue
// (the endpoint's queues and its communicator).
struct NetCursor {
  uint64_t queues, comm_key;
  uint64_t tail, head;
  bool valid;
};

struct BlockEnv {
  const dfccl_daemon_args *args;
  BlockShared *sm;
  dfccl_step_profile *steps;  // leader: this block's step profile (kStepProfile builds)
  uint32_t block;    // this block's index; it runs channel channel_of(d, block) of a task
  uint32_t wparity;  // which wait_result slot the next wait uses
  NetCursor net;     // leader: the net queue cursors the block's last run left
};

// The step profile (dfccl_step_profile): compiled in only with
// DFCCL_STEP_PROFILE=1, since each mark reads the clock on the hot path.
#ifndef DFCCL_STEP_PROFILE
#define DFCCL_STEP_PROFILE 0
#endif
constexpr bool kStepProfile = DFCCL_STEP_PROFILE != 0;

DFCCL_DEV uint64_t step_start() { return kStepProfile && is_leader() ? now_ns() : 0; }

// Leader: adds the time since `t` to `field` of this block's step profile
// and restarts `t` there.
DFCCL_DEV void step_mark(const BlockEnv &env, uint64_t dfccl_step_profile::*field, uint64_t &t) {
  if (kStepProfile && is_leader()) {
    const uint64_t now = now_ns();
    env.steps->*field += now - t;
    t = now;
  }
}


// State of one run of one task on one block.  Every lane of the control warp
// holds an identical copy: the algorithms are deterministic and every wait's
// result is broadcast, so all lanes walk the same steps.  Fields marked
// "leader" are meaningful in the leader only; it saves the run into the context.
struct TaskRun {
  dfccl_task_ctx *ctx;
  const dfccl_task_desc *d;   // = &ctx->desc
  const dfccl_endpoint *ep;
  uint32_t chan;              // the task's channel this run moves (channel_of)
  dfccl_chan_state *mine;     // this rank's record, this channel
  uint64_t token;             // token(key, instance)
  uint64_t deadline_ns;       // leader: preempt when a wait passes it
  uint64_t window_ns;         // leader
  uint64_t max_wait_ns;       // leader: longest successful wait of this run
  uint32_t step;
  uint64_t pos[4];
  uint32_t waiting_on;        // leader
  uint32_t status;            // leader
  int32_t detail;             // leader
  bool relayed;               // leader: the failure came from elsewhere; detail = its origin rank
  bool progressed;
  NetCursor net;              // leader
};

// ---- tags, tokens, signatures -----------------------------------------------
// (dfccl/hash.h: the hashes the host computes too)
DFCCL_DEV uint64_t mix64(uint64_t x) { return dfccl_mix64(x); }
DFCCL_DEV uint64_t instance_token(uint64_t key, uint64_t instance) { return dfccl_instance_token(key, instance); }

// A send and the recv it pairs with sign alike: kind SEND, no peer (the
// record's key already names the ordered pair).
DFCCL_DEV uint64_t task_signature(const dfccl_task_desc &d, uint32_t nranks) {
  const bool p2p = d.kind == DFCCL_SEND || d.kind == DFCCL_RECV;
  const uint64_t kind = p2p ? (uint64_t)DFCCL_SEND : (uint64_t)d.kind;
  const uint64_t root = p2p ? 0 : (uint64_t)d.root;
  return kind | ((uint64_t)d.dtype << 4) | ((uint64_t)d.op << 8) | ((uint64_t)d.path << 12) |
         (root << 16) | ((uint64_t)d.nchannels << 32) | ((uint64_t)nranks << 40) |
         ((uint64_t)(d.flags & (DFCCL_TASK_ONE_SHOT | DFCCL_TASK_STAGED | DFCCL_TASK_LL)) << 48);
}

// Counters of the ring protocol carry the instance in their high half so that
// values left from an earlier instance never satisfy a wait.
DFCCL_DEV uint64_t tagged_count(uint64_t instance, uint64_t n) { return (instance << 32) | (n & 0xffffffffull); }
DFCCL_DEV uint64_t count_for(uint64_t word, uint64_t instance) {
  return (word >> 32) == (instance & 0xffffffffull) ? (word & 0xffffffffull) : 0;
}

// ---- peers in the order of a run's peer cache -------------------------------------
// Cache index i (0 <= i < n - 1) is the i-th rank after this one.  Without a
// division: the paths of small collectives map ranks to indices in every step.
DFCCL_DEV uint32_t peer_at(uint32_t rank, uint32_t nranks, uint32_t index) {
  const uint32_t p = rank + 1 + index;
  return p >= nranks ? p - nranks : p;
}
DFCCL_DEV uint32_t peer_index(uint32_t rank, uint32_t nranks, uint32_t peer) {
  return peer > rank ? peer - rank - 1 : peer + nranks - rank - 1;
}

// ---- tag records ---------------------------------------------------------------
DFCCL_DEV uint32_t home_bucket(uint64_t key, uint32_t capacity) { return dfccl_home_bucket(key, capacity); }

DFCCL_DEV dfccl_chan_state *record_chan(uint64_t record, uint32_t channel) {
  return ptr<dfccl_chan_state>(record + DFCCL_RECORD_HEADER_BYTES + (uint64_t)channel * sizeof(dfccl_chan_state));
}

DFCCL_DEV uint64_t record_at(const dfccl_endpoint *ep, uint32_t rank, uint32_t bucket) {
  return ep->peer_table[rank] + (uint64_t)bucket * DFCCL_RECORD_BYTES;
}

// What only this daemon reads and writes of this rank's record in `bucket`
// (abi.h, dfccl_owner_bucket): in device memory, where the record may lie
// in host memory (peers on other hosts).
DFCCL_DEV dfccl_owner_bucket *owner_bucket(const dfccl_endpoint *ep, uint32_t bucket) {
  return ptr<dfccl_owner_bucket>(ep->owner_words + (uint64_t)bucket * sizeof(dfccl_owner_bucket));
}

// Finds rank's record of `key` by linear probing from the home bucket, the
// same sequence the owner's host used to place it, to the first bucket that
// never held a tag (key 0).  A tag's key can be in two buckets: one the tag
// held before, idle, was given to another tag keeps the old key until its
// new owner publishes there, while the tag's live record is further on.  So
// a record of the tag that names an instance older than `instance` on
// channel `chan` is passed over for a later one that names `instance` or a
// later one; without one, the first record of the tag is returned (the live
// one before its owner published, or the old one).  0: none there (yet).
DFCCL_DEV uint64_t probe_record(const dfccl_endpoint *ep, uint32_t rank, uint64_t key, uint32_t chan,
                                uint64_t instance) {
  const uint32_t cap = ep->table_capacity;
  uint32_t b = home_bucket(key, cap);
  uint64_t first = 0;
  for (uint32_t i = 0; i < cap; ++i) {
    uint64_t rec = record_at(ep, rank, b);
    uint64_t k = load_acquire(&ptr<dfccl_record_header>(rec)->key);
    if (k == 0) break;
    if (k == key) {
      if (load_relaxed(&record_chan(rec, chan)->instance) >= instance) return rec;
      if (first == 0) first = rec;
    }
    b = (b + 1 == cap) ? 0 : b + 1;
  }
  return first;
}

// A slot's result with nothing counted yet.
DFCCL_DEV dfccl_result empty_result(uint32_t status, uint32_t nchannels) {
  dfccl_result res;
  res.status = status;
  res.detail = -1;
  res.preemptions = 0;
  res.resumes = 0;
  res.queued_ns = 0;
  res.running_ns = 0;
  res.wall_ns = 0;
  res.waiting_on = 0;
  res.nchannels = nchannels;
  res.max_wait_ns = 0;
  res.reserved = 0;
  return res;
}

// Hands a slot's result to the host: the result, then its completion word
// (one system-scope release orders everything written before it).
DFCCL_DEV void publish_result(const dfccl_daemon_args *a, uint32_t slot, uint32_t gen, const dfccl_result &res) {
  a->results[slot] = res;
  store_release(&a->done[slot], gen);
}

DFCCL_DEV dfccl_task_ctx *ctx_at(const dfccl_daemon_args *a, uint32_t slot, uint32_t block) {
  return a->ctx + (uint64_t)slot * a->nblocks + block;
}

// Channels are dealt to blocks from the descriptor's first_block on: channel
// c of a task runs on block (first_block + c) % nblocks.  Which block runs a
// channel is this rank's own business (peers meet by channel, not block), so
// the host spreads tags, and ranks that share a device, over the blocks: two
// small collectives then run side by side instead of taking turns on block 0.
// Every instance of a tag on a rank gets the same first_block, so its
// instances still meet on one block per channel (chain_behind_pending).
DFCCL_DEV uint32_t channel_of(const dfccl_task_desc *d, uint32_t block, uint32_t nblocks) {
  return (block + nblocks - d->first_block) % nblocks;
}
DFCCL_DEV uint32_t block_of(const dfccl_task_desc *d, uint32_t channel, uint32_t nblocks) {
  return (d->first_block + channel) % nblocks;
}

}  // namespace dfccl
