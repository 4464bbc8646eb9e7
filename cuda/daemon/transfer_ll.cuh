// The eager low-latency (LL) protocol for small symmetric collectives
// (all-reduce, all-gather, reduce-scatter; one channel), and across hosts
// for small broadcasts.  Every rank stores its contribution straight into
// every peer's receive area, in 16-byte lines of {data 4 B, flag 4 B, data
// 4 B, flag 4 B} whose flags name the instance, and never waits for the
// receiver; the only wait on data is a poll of its own memory until every
// peer's lines for this instance are there.  A broadcast is the rooted
// case: only the root pushes (to every peer), only the others receive
// (from the root alone):
//
//   PUSH     credit from every peer (local words), then store the lines
//            into every peer's area, in one go
//   RECV     per peer: find its bucket (cached), poll the local area
//   FINISH   unpack, reduce in rank order (or gather), acknowledge
//
// This rank's record (for probing, and for peers on other paths) is
// published once per instance, where it costs least (ll_publish): before the
// first wait of RECV, or, when every peer's lines are already there, while
// the movers run FINISH.
//
// There is no final wait: the sender's buffer is free once its stores are
// issued, and a completed rank is done with its peers.
//
// Receive areas (docs/architecture.md, "LL"): in the receiver's arena, one per
// (sender, sender's tag bucket, parity of the instance).  The sender knows its
// bucket; the receiver knows it from the sender's record address, cached per
// tag in its bucket's owner words (found by probing once).  Overwrite safety: a
// sender writes instance k into the parity-(k & 1) area only after every
// receiver acknowledged the last instance it wrote there (the ack word
// receivers post into the sender's arena after unpacking); for the same tag
// that is instance k - 2, which the receiver consumed before it could send
// its part of k - 1, so the check passes at once.  When another tag takes the
// bucket over, its first push waits until every receiver acknowledged the old
// tag's last instance.  Flags carry (tag, instance): lines from another tag or
// instance are never accepted.
//
// Peers on other hosts (docs/multi-node.md, "LL across hosts"): a remote
// receiver's area is in this rank's mirror of its arena; the lines are
// stored there and the proxy carries them (NET_LINES), the acknowledgement
// and the record likewise.  The queue's room is part of the credit wait
// (the lines) and a wait of its own as RECV starts (the record and the
// acknowledgements); nothing else changes: flags, parities and credit are
// the same, so the sender still never waits for a receiver.
//
// Preemption: the credit wait and the polls are the only waits; the context
// keeps the step and which peers were polled (pos[1]).  A resumed run
// re-checks the lines of the peer it was polling; verified peers' lines stay
// in place until this rank acknowledges them (at FINISH), so FINISH, which
// has no wait, sees all of them.
#pragma once

#include "ll_line.cuh"
#include "transfer_common.cuh"
#include "transfer_direct.cuh"  // kAnyPeer

namespace dfccl {

enum LLStep { L_PUSH = 0, L_RECV = 1, L_FINISH = 2, L_DONE = 3 };

constexpr uint32_t kLLHeaderLines = DFCCL_LL_HEADER_LINES;  // token line, signature line (layout.h)
constexpr uint32_t kLLBatch = 4;        // lines a lane of the control warp loads before it pushes them
constexpr uint32_t kLLReprobePolls = 64;

// ---- names ---------------------------------------------------------------------
// Line flag of (tag, instance): instances two apart (which share an area)
// differ, so an area never holds lines that pass for the next instance that
// uses it; never zero, so a zeroed area matches nothing.  The token line also carries the 64-bit
// instance token, checked in full.
DFCCL_DEV uint32_t ll_flag(uint64_t key, uint64_t instance) {
  return ((uint32_t)(mix64(key) >> 32) + (uint32_t)instance) | 1u;
}
// What a receiver acknowledges: (tag, instance) in one word.
DFCCL_DEV uint64_t ll_ack_word(uint64_t key, uint64_t instance) {
  return (mix64(key) & 0xffffffff00000000ull) | (instance & 0xffffffffull);
}
// What must match between ranks (the record's signature check, in a line).
DFCCL_DEV uint64_t ll_check_word(const TaskRun &run) {
  return mix64(task_signature(*run.d, run.ep->nranks) ^ mix64(run.d->count + 0x51ed27u));
}

// ---- the LL region of an arena (dfccl/layout.h, dfccl_ll_region_bytes) ------------
//   areas:   [bucket][sender][parity] of ll_area_bytes
//   acks:    [bucket][receiver] of 8 bytes (in the sender's arena)
DFCCL_DEV uint64_t ll_area_bytes(const dfccl_endpoint *ep) { return dfccl_ll_area_bytes(ep->ll_max_bytes); }
DFCCL_DEV uint64_t ll_areas_bytes(const dfccl_endpoint *ep) {
  return dfccl_ll_areas_bytes(ep->table_capacity, ep->nranks, ep->ll_max_bytes);
}
DFCCL_DEV uint64_t ll_area(const dfccl_endpoint *ep, uint32_t receiver, uint32_t sender, uint32_t bucket,
                           uint64_t instance) {
  const uint64_t index = ((uint64_t)bucket * ep->nranks + sender) * 2ull + (instance & 1u);
  return ep->peer_arena[receiver] + ep->ll_offset + index * ll_area_bytes(ep);
}
DFCCL_DEV uint64_t *ll_ack(const dfccl_endpoint *ep, uint32_t sender, uint32_t bucket, uint32_t receiver) {
  return ptr<uint64_t>(ep->peer_arena[sender] + ep->ll_offset + ll_areas_bytes(ep) +
                       ((uint64_t)bucket * ep->nranks + receiver) * 8ull);
}

// Who pushes and whose lines a rank takes.  A broadcast's root pushes to
// every peer and takes nothing; every other rank pushes nothing and takes
// the root's lines; the symmetric kinds push to and take from every peer.
DFCCL_DEV bool ll_rooted(const TaskRun &run) { return run.d->kind == DFCCL_BROADCAST; }
DFCCL_DEV bool ll_pushes(const TaskRun &run) { return !ll_rooted(run) || run.ep->rank == run.d->root; }
DFCCL_DEV uint32_t ll_sources(const TaskRun &run) {
  return !ll_rooted(run) ? run.ep->nranks - 1 : run.ep->rank == run.d->root ? 0u : 1u;
}
// The peer index (peer_at order) of this rank's i-th source.
DFCCL_DEV uint32_t ll_source_index(const TaskRun &run, uint32_t i) {
  return !ll_rooted(run) ? i : peer_index(run.ep->rank, run.ep->nranks, run.d->root);
}

// Bytes each rank sends every peer (equal for the symmetric kinds: `count` is
// the per-rank piece; a broadcast's whole buffer) and where they start in
// the sender's input.
DFCCL_DEV uint64_t ll_bytes(const TaskRun &run) { return run.d->count * dtype_size(run.d->dtype); }
DFCCL_DEV uint64_t ll_source(const TaskRun &run, uint32_t receiver) {
  return run.d->send_addr + (run.d->kind == DFCCL_REDUCE_SCATTER ? (uint64_t)receiver * ll_bytes(run) : 0);
}

// The words a run's lines carry, hashed once per run (three 64-bit mixes:
// the push and every peer's poll would otherwise each hash them again).
struct LLNames {
  uint32_t flag;     // ll_flag of this instance
  uint64_t check;    // ll_check_word
  uint64_t lines;    // lines of an area this instance fills: header and payload
};
DFCCL_DEV LLNames ll_names(const TaskRun &run) {
  return LLNames{ll_flag(run.d->tag_key, run.d->instance), ll_check_word(run),
                 kLLHeaderLines + ceil_div(ll_bytes(run), 8)};
}

// ---- PUSH --------------------------------------------------------------------------
// The leader: whether this block completed the previous instance of this
// run's tag, in its bucket and endpoint, without failure (BlockShared's
// ll_done_*, kept by ll_note_done).
DFCCL_DEV bool ll_follows_own(const BlockEnv &env, const TaskRun &run) {
  const BlockShared *sm = env.sm;
  return sm->ll_done_key == run.d->tag_key && sm->ll_done_instance + 1 == run.d->instance &&
         sm->ll_done_bucket == run.d->bucket && sm->ll_done_endpoint == run.d->endpoint;
}

DFCCL_DEV void ll_note_done(const BlockEnv &env, const TaskRun &run) {
  BlockShared *sm = env.sm;
  sm->ll_done_key = run.d->tag_key;
  sm->ll_done_instance = run.d->instance;
  sm->ll_done_bucket = run.d->bucket;
  sm->ll_done_endpoint = run.d->endpoint;
}

// The leader: may this rank write instance k into its peers' parity areas of
// its bucket?  Yes once every receiver acknowledged the last instance written
// there: the same tag's (k - 2, normally long done), or, when the bucket
// changed tags, the old tag's last instance in either parity.  The header's
// LL words are read at GPU scope (other blocks read them for the handover),
// once for all receivers and as independent loads.
//
// Credit from every peer at once: pushing to all peers only when all credits
// are there means an instance that any rank completed has been pushed to
// every rank, so every receiver can take it whenever its daemon visits it; a
// credit wait therefore waits only for peers' daemons to run, never on
// another credit (the deadlock-freedom argument in docs/design-decisions.md,
// "LL").
//
// `after_own` (the leader's ll_follows_own): this block completed the tag's
// previous instance, k - 1, in this bucket without failure.  Then, if the
// owner words say k - 1 was the last push into the bucket, every receiver has
// acknowledged the instance that the parity-(k & 1) areas hold: a receiver
// sends its part of k - 1 only after it consumed and acknowledged everything
// this rank wrote before (its instances of the tag run in order), and this
// rank completed k - 1 only with every receiver's part of it.  The
// acknowledgements' loads, a round trip to every peer's arena whose acquire
// also empties L1, are skipped.
DFCCL_DEV bool ll_credit_all(const TaskRun &run, const dfccl_owner_bucket *own, bool after_own = false) {
  const uint64_t key = load_gpu(&own->ll_key);
  const uint64_t i0 = load_gpu(&own->ll_inst[0]), i1 = load_gpu(&own->ll_inst[1]);
  if (key == 0) return true;
  const bool same_tag = key == run.d->tag_key;
  const uint64_t prev = run.d->instance - 1;
  if (after_own && same_tag && ((prev & 1u) ? i1 : i0) == prev) return true;
  const uint64_t last = same_tag ? ((run.d->instance & 1u) ? i1 : i0) : (i0 > i1 ? i0 : i1);
  if (last == 0) return true;
  const uint64_t tag_bits = mix64(key) & 0xffffffff00000000ull;
  const uint64_t want = ll_ack_word(key, last);
  for (uint32_t i = 0; i + 1 < run.ep->nranks; ++i) {
    const uint32_t receiver = peer_at(run.ep->rank, run.ep->nranks, i);
    const uint64_t ack = load_acquire(ll_ack(run.ep, run.ep->rank, run.d->bucket, receiver));
    const bool ok = same_tag ? (ack & 0xffffffff00000000ull) == tag_bits && (ack & 0xffffffffull) >= (last & 0xffffffffull)
                             : ack == want;
    if (!ok) return false;
  }
  return true;
}

// Every path, before its first step of an instance (transfer.cuh): a bucket
// whose LL areas still hold another tag's lines is handed over only when
// every peer took them.  Until then this rank does not publish (which
// rewrites the record's key), so peers still find the old tag's bucket by
// probing.  One local load when the bucket did not change tags.
DFCCL_DEV int ll_handover(BlockEnv &env, TaskRun &run) {
  if (run.ep->ll_max_bytes == 0 || run.ep->nranks < 2) return WAIT_OK;
  const dfccl_owner_bucket *own = owner_bucket(run.ep, run.d->bucket);
  uint64_t key = 0;
  // GPU scope: the block that runs the owning tag's LL channel writes these
  // words, any block reads.
  if (is_leader()) key = load_gpu(&own->ll_key);
  key = from_leader(key);
  if (key == 0 || key == run.d->tag_key) return WAIT_OK;
  return block_wait(env, run, kAnyPeer, [&]() -> int { return ll_credit_all(run, own) ? 1 : 0; });
}

// The control warp: this rank's lines for `receiver`, into its area.
DFCCL_DEV void ll_push(const TaskRun &run, uint32_t receiver, const LLNames &names) {
  const dfccl_endpoint *ep = run.ep;
  const uint64_t area = ll_area(ep, receiver, ep->rank, run.d->bucket, run.d->instance);
  const uint32_t flag = names.flag;
  const uint64_t bytes = ll_bytes(run);
  const uint64_t src = ll_source(run, receiver);
  const uint64_t lines = names.lines;
  const uint64_t stride = lane_count();
  for (uint64_t base = lane_index(); base < lines; base += stride * kLLBatch) {
    // A batch of loads in flight, then its stores (an LL store may not be
    // moved before a load, so one line at a time would wait for each load).
    uint64_t v[kLLBatch];
#pragma unroll
    for (uint32_t j = 0; j < kLLBatch; ++j) {
      const uint64_t i = base + j * stride;
      const uint64_t off = (i - kLLHeaderLines) * 8;
      v[j] = i >= lines ? 0 : i == 0 ? run.token : i == 1 ? names.check : load_bytes8(src + off, word_bytes(bytes, off));
    }
#pragma unroll
    for (uint32_t j = 0; j < kLLBatch; ++j)
      if (base + j * stride < lines) ll_store(area + 16 * (base + j * stride), v[j], flag);
  }
}

// The control warp, when this instance failed after its push: its token
// line in every peer's area is overwritten with the token marked aborted and
// the origin of the failure, so peers still polling for these lines fail
// with PeerAbortedError instead of taking a contribution this rank gave up
// on (a peer that already took the lines has completed; that race is the
// same on every path).  The credit for these areas was checked at the push.
constexpr uint64_t kLLAbortMark = 0xab0a7ab0a7ab0a71ull;

// The poison's second line carries (status << 32 | origin rank), so that a
// mismatch or a lost peer reaches every rank as itself (push_abort's rule).
DFCCL_DEV uint64_t ll_poison_word(uint32_t status, uint32_t origin) {
  return kLLAbortMark ^ (((uint64_t)status << 32) | origin);
}
DFCCL_DEV bool ll_poison_valid(uint64_t data) {
  const uint64_t x = data ^ kLLAbortMark;
  return (x & 0xffffffffull) < DFCCL_MAX_RANKS && (x >> 32) != 0 && (x >> 32) < 16;
}

DFCCL_DEV void ll_poison(const BlockEnv &env, TaskRun &run, const LLNames &names, uint32_t status, uint32_t origin) {
  if (!ll_pushes(run)) return;  // a broadcast's receiver wrote no peer's area
  const dfccl_endpoint *ep = run.ep;
  const uint32_t flag = names.flag;
  for (uint32_t i = lane_index(); i + 1 < ep->nranks; i += lane_count()) {
    const uint64_t area = ll_area(ep, peer_at(ep->rank, ep->nranks, i), ep->rank, run.d->bucket, run.d->instance);
    // Either line alone says "aborted" (they land in no fixed order).
    ll_store(area, run.token ^ kLLAbortMark, flag);
    ll_store(area + 16, ll_poison_word(status, origin), flag);
  }
  if (!net_endpoint(ep)) return;
  // Remote peers: the proxy carries the two lines, where the queue has
  // room (else the abort mark in this rank's record reaches them).
  control_sync();
  release_fence();
  if (is_leader() && net_room(env, run, net_peers(ep))) {
    for (uint32_t i = 0; i + 1 < ep->nranks; ++i) {
      const uint32_t p = peer_at(ep->rank, ep->nranks, i);
      if (net_peer(ep, p)) net_lines(env, run, p, ll_area(ep, p, ep->rank, run.d->bucket, run.d->instance), 32);
    }
  }
}

// ---- publishing -----------------------------------------------------------------
// This rank's record for this instance (publish_instance), once.  Peers never
// need it to take this rank's lines: only to find this rank's bucket (a first
// instance, a tag that moved buckets), or to meet it from another path (a
// mismatch).  So it need not precede the lines, only some wait: RECV
// publishes before its first wait (every preempted run, and every run that
// fails there, has published), and a run that finds every peer's lines at
// once publishes during FINISH's move, which it overlaps.  Never after the
// completion word: that lets the host give the bucket to another tag, whose
// record this would overwrite.  pos[2]: published (it survives preemption).
DFCCL_DEV void ll_publish(const BlockEnv &env, TaskRun &run) {
  if (run.pos[2] != 0) return;
  uint64_t t = step_start();
  publish_instance(run, 0, run.d->send_addr, run.d->recv_addr);
  if (is_leader()) net_push_record(env, run);  // room: RECV's wait
  step_mark(env, &dfccl_step_profile::ll_publish_ns, t);
  run.pos[2] = 1;
}

// ---- RECV ----------------------------------------------------------------------
// The leader: the record of `peer` for this tag: cached in this context, else
// in the bucket's owner words (where the tag met it last), else found by
// probing (0: not there yet).  Caches what it finds in both places.
DFCCL_DEV uint64_t ll_peer_record(TaskRun &run, uint32_t peer, uint32_t index, bool reprobe) {
  dfccl_owner_bucket *own = owner_bucket(run.ep, run.d->bucket);
  uint64_t rec = run.ctx->peer_rec[index];
  if (rec == 0 && load_own(&own->cache_key) == run.d->tag_key) rec = load_own(&own->peer_rec[peer]);
  if (rec == 0 || reprobe) {
    const uint64_t found = probe_record(run.ep, peer, run.d->tag_key, run.chan, run.d->instance);
    if (found != 0) rec = found;
  }
  if (rec != 0 && rec != run.ctx->peer_rec[index]) {
    run.ctx->peer_rec[index] = rec;
    if (load_own(&own->cache_key) != run.d->tag_key) {
      for (uint32_t i = 0; i < DFCCL_PEER_CACHE; ++i) own->peer_rec[i] = 0;
    }
    own->peer_rec[peer] = rec;
    own->cache_key = run.d->tag_key;
  }
  return rec;
}

DFCCL_DEV uint32_t bucket_of(const dfccl_endpoint *ep, uint32_t peer, uint64_t rec) {
  return (uint32_t)((rec - ep->peer_table[peer]) / DFCCL_RECORD_BYTES);
}

// Waits until every line of `peer` for this instance is in this rank's area,
// publishing this rank's record after the first poll that does not find them.
// Every lane of the control warp checks its share of the lines on each poll;
// the leader keeps the deadline, checks aborts like block_wait, and every
// kLLReprobePolls polls looks the peer's record up afresh (the peer's tag may
// have moved to another bucket since it was cached).  A token line whose flag
// matches but whose signature line differs is a mismatch.
DFCCL_DEV int ll_wait_lines(BlockEnv &env, TaskRun &run, uint32_t peer, uint32_t index, const LLNames &names) {
  const dfccl_endpoint *ep = run.ep;
  uint64_t rec = 0;
  if (is_leader()) rec = ll_peer_record(run, peer, index, false);
  rec = from_leader(rec);
  uint64_t area = rec != 0 ? ll_area(ep, ep->rank, peer, bucket_of(ep, peer, rec), run.d->instance) : 0;
  const uint32_t flag = names.flag;
  const uint64_t check = names.check;
  const uint64_t lines = names.lines;
  uint64_t start = 0;
  uint32_t spins = 0;
  int r = WAIT_OK;
  for (;;) {
    bool arrived = area != 0, token = false, bad = false, aborted = false;
    if (area != 0) {
      for (uint64_t i = lane_index(); i < lines; i += lane_count()) {
        const LLLine l = ll_load(area + 16 * i);
        if (!ll_valid(l, flag) || (i == 0 && ll_data(l) != run.token)) {
          arrived = false;
          aborted |= i == 0 && ll_valid(l, flag) && ll_data(l) == (run.token ^ kLLAbortMark);
        } else if (i == 0) {
          token = true;
        } else if (i == 1 && ll_poison_valid(ll_data(l))) {
          aborted = true;
          arrived = false;
        } else if (i == 1 && ll_data(l) != check) {
          bad = true;
          arrived = false;
        }
      }
    }
    if (warp_all(arrived)) break;
    ll_publish(env, run);  // before any wait, and before giving up: peers may be probing for it
    if (warp_any(aborted)) {  // the sender gave this instance up (ll_poison)
      if (is_leader()) {
        const LLLine l = ll_load(area + 16);
        const bool known = ll_valid(l, flag) && ll_poison_valid(ll_data(l));
        take_relayed(run, known ? ll_data(l) ^ kLLAbortMark : ((uint64_t)DFCCL_STATUS_PEER_ABORTED << 32) | peer);
      }
      r = WAIT_ABORT;
      break;
    }
    // The signature line counts only next to its instance's token line.
    if (warp_any(bad) && warp_any(token)) {
      if (is_leader()) {
        run.status = DFCCL_STATUS_MISMATCH;
        run.detail = (int32_t)peer;
      }
      r = WAIT_ABORT;
      break;
    }
    int decision = WAIT_OK;  // leader: WAIT_OK = keep polling
    uint64_t moved = 0;
    if (is_leader()) {
      if (start == 0) start = now_ns();
      spin_pause(spins);
      ++spins;
      if (area == 0 || spins % kLLReprobePolls == 0) {
        const uint64_t found = ll_peer_record(run, peer, index, true);
        if (found != 0 && found != rec) {
          rec = found;
          moved = ll_area(ep, ep->rank, peer, bucket_of(ep, peer, rec), run.d->instance);
        }
        // A peer that failed before its push marked its own record (push_abort).
        const dfccl_chan_state *pc = found != 0 ? record_chan(found, run.chan) : nullptr;
        if (pc != nullptr && take_abort_mark(run, pc, load_relaxed(&pc->abort_token))) decision = WAIT_ABORT;
      }
      if (decision == WAIT_OK && (spins & 3u) == 0) {
        if (spins == 16) store_relaxed(&env.args->slot_waiting[run.d->slot], peer + 1);
        const bool expired = now_ns() >= run.deadline_ns || load_gpu(&env.args->state->quit_epoch) == env.args->epoch;
        if (((spins & 255u) == 0 || expired) && abort_pending(env, run, peer)) {
          decision = WAIT_ABORT;
        } else if (expired) {
          decision = WAIT_EXPIRED;
          run.waiting_on = peer + 1;
        }
      }
    }
    moved = from_leader(moved);
    if (moved != 0) area = moved;
    decision = (int)from_leader((uint64_t)decision);
    if (decision != WAIT_OK) {
      r = decision;
      break;
    }
  }
  if (is_leader() && r == WAIT_OK) {
    const uint64_t now = now_ns();
    if (start != 0 && now - start > run.max_wait_ns) run.max_wait_ns = now - start;
    run.deadline_ns = now + run.window_ns;
  }
  return r;
}

// ---- FINISH --------------------------------------------------------------------
// Peer p's first payload line in this rank's area (its record is cached in the
// context since RECV).
DFCCL_DEV uint64_t ll_payload(const TaskRun &run, uint32_t p) {
  const dfccl_endpoint *ep = run.ep;
  const uint64_t rec = run.ctx->peer_rec[peer_index(ep->rank, ep->nranks, p)];
  return ll_area(ep, ep->rank, p, bucket_of(ep, p, rec), run.d->instance) + 16ull * kLLHeaderLines;
}

// One move on the movers (move.cuh, MOVE_LL_REDUCE / MOVE_LL_GATHER): every
// rank's piece -- this rank's from its input, the peers' straight from their
// lines -- reduced in rank order into the output, or gathered into place.
// No unpacking by the control warp and no scratch: the movers' threads each
// take a word of every piece, all its loads in flight at once.
DFCCL_DEV void ll_finish(BlockEnv &env, TaskRun &run) {
  control_sync();  // the leader's cached peer records, for every lane
  const dfccl_task_desc *d = run.d;
  const dfccl_endpoint *ep = run.ep;
  const uint32_t n = ep->nranks, r = ep->rank;
  const uint64_t bytes = ll_bytes(run);
  if (is_leader()) {
    BlockShared *sm = env.sm;
    MoveDesc &m = sm->move;
    if (ll_rooted(run)) {
      // A broadcast: the root's lines into the output, or at the root its
      // input (nothing where in place): one piece, a gather of one.
      const bool root = r == d->root;
      sm->srcs[0] = root ? d->send_addr : ll_payload(run, d->root);
      m.kind = MOVE_LL_GATHER;
      m.nsrcs = 1;
      m.own = root ? 0 : 1;
    } else {
      for (uint32_t p = 0; p < n; ++p)
        sm->srcs[p] = p != r ? ll_payload(run, p)
                             : d->send_addr + (d->kind == DFCCL_REDUCE_SCATTER ? (uint64_t)r * bytes : 0);
      m.kind = d->kind == DFCCL_ALL_GATHER ? MOVE_LL_GATHER : MOVE_LL_REDUCE;
      m.nsrcs = n;
      m.own = r;
    }
    sm->dsts[0] = d->recv_addr;
    m.nelem = bytes;
    m.ndsts = 1;
    m.postdiv = d->op == DFCCL_AVG ? n : 1;
    m.dtype = d->dtype;
    m.op = d->op;
    m.quit = 0;
  }
  control_sync();
  uint64_t t = step_start();
  // The leader publishes while the movers move, if RECV did not have to
  // (the record is neither a source nor a destination of the move).
  start_move(env.sm);
  ll_publish(env, run);
  control_sync();
  wait_move(env.sm);
  step_mark(env, &dfccl_step_profile::ll_move_ns, t);
  // Every peer's lines are consumed: acknowledge (posted stores, nobody
  // waits for them unless it reuses the area).
  if (is_leader()) {
    const uint64_t ack = ll_ack_word(d->tag_key, d->instance);
    for (uint32_t j = 0; j < ll_sources(run); ++j) {
      const uint32_t i = ll_source_index(run, j), p = peer_at(r, n, i);
      // A remote sender's ack word is in its mirror here: the proxy carries
      // it (room: RECV's wait).
      net_store(env, run, p, ll_ack(ep, p, bucket_of(ep, p, run.ctx->peer_rec[i]), r), ack);
    }
  }
}

DFCCL_DEV int run_ll(BlockEnv &env, TaskRun &run) {
  const uint32_t n = run.ep->nranks, r = run.ep->rank;
  // The host plans LL only where it fits (planning.py); anything else would
  // write past the areas.
  const uint32_t kind = run.d->kind;
  if (run.d->nchannels != 1 || ll_bytes(run) > run.ep->ll_max_bytes || n > DFCCL_PEER_CACHE ||
      (kind != DFCCL_ALL_REDUCE && kind != DFCCL_ALL_GATHER && kind != DFCCL_REDUCE_SCATTER &&
       kind != DFCCL_BROADCAST)) {
    if (is_leader()) {
      run.status = DFCCL_STATUS_BAD_TASK;
      run.detail = -1;
    }
    return RUN_FAILED;
  }
  dfccl_owner_bucket *own = owner_bucket(run.ep, run.d->bucket);
  const LLNames names = ll_names(run);
  for (;;) {
    switch (run.step) {
      case L_PUSH: {
        // Credits first: publishing rewrites the record's key, which peers
        // still taking an old tag's lines from this bucket look up.
        uint64_t t = step_start();
        const bool pushes = ll_pushes(run);
        if (!pushes) {  // a broadcast's receiver
          run.pos[1] = 0;
          run.pos[2] = 0;
          run.step = L_RECV;
          break;
        }
        // A broadcast's root completed its last instance without any
        // receiver's part, so its credit is always read (ll_note_done).
        const bool after_own = is_leader() && ll_follows_own(env, run);
        const uint32_t remote = net_peers(run.ep);
        int w = block_wait(env, run, kAnyPeer, [&]() -> int {
          return ll_credit_all(run, own, after_own) && net_room(env, run, remote) ? 1 : 0;
        });
        step_mark(env, &dfccl_step_profile::ll_credit_ns, t);
        if (w != WAIT_OK) return stop_run(w);
        // The lines: what the peers wait for.  The record is published
        // later, where a wait or the move hides it (ll_publish).
        for (uint32_t i = 0; i + 1 < n; ++i) ll_push(run, peer_at(r, n, i), names);
        // What the areas of this bucket now hold, for the next push's credit.
        control_sync();
        if (remote != 0) {
          // Remote receivers' areas are mirrors here: the proxy carries them.
          release_fence();
          if (is_leader()) {
            for (uint32_t i = 0; i + 1 < n; ++i) {
              const uint32_t p = peer_at(r, n, i);
              if (net_peer(run.ep, p))
                net_lines(env, run, p, ll_area(run.ep, p, r, run.d->bucket, run.d->instance), 16 * names.lines);
            }
          }
        }
        if (is_leader()) {
          if (load_own(&own->ll_key) != run.d->tag_key) {
            own->ll_inst[0] = 0;
            own->ll_inst[1] = 0;
            own->ll_key = run.d->tag_key;
          }
          own->ll_inst[run.d->instance & 1u] = run.d->instance;
        }
        step_mark(env, &dfccl_step_profile::ll_push_ns, t);
        run.pos[1] = 0;
        run.pos[2] = 0;
        run.step = L_RECV;
        run.progressed = true;
        break;
      }
      case L_RECV: {
        uint64_t t = step_start();
        // Room for what the rest of the instance posts: this rank's record
        // (ll_publish) and an acknowledgement to every remote peer.  FINISH
        // follows RECV in the same run, and only this block's leader posts.
        int room = net_wait_room(env, run, 1 + net_peers(run.ep));
        if (room != WAIT_OK) return stop_run(room);
        const uint32_t sources = ll_sources(run);
        while (run.pos[1] < sources) {
          const uint32_t i = ll_source_index(run, (uint32_t)run.pos[1]);
          int w = ll_wait_lines(env, run, peer_at(r, n, i), i, names);
          step_mark(env, &dfccl_step_profile::ll_recv_ns, t);
          if (w == WAIT_ABORT) {
            // What travels, as in push_abort: a relayed failure keeps its
            // status and origin; one that starts here names this rank.
            uint32_t status = DFCCL_STATUS_PEER_ABORTED, origin = r;
            if (run.relayed && run.detail >= 0) {
              status = run.status;
              origin = (uint32_t)run.detail;
            } else if (run.status == DFCCL_STATUS_MISMATCH) {
              status = DFCCL_STATUS_MISMATCH;
            }
            ll_poison(env, run, names, (uint32_t)from_leader(status), (uint32_t)from_leader(origin));
          }
          if (w != WAIT_OK) return stop_run(w);
          run.pos[1] += 1;
          run.progressed = true;
        }
        run.step = L_FINISH;
        break;
      }
      case L_FINISH: {
        uint64_t t = step_start();
        ll_finish(env, run);
        step_mark(env, &dfccl_step_profile::ll_finish_ns, t);
        // ll_follows_own's reasoning needs every receiver's part of this
        // instance, which a broadcast's root never takes.
        if (is_leader() && !ll_rooted(run)) ll_note_done(env, run);
        if (kStepProfile && is_leader()) env.steps->ll_runs += 1;
        run.step = L_DONE;
        run.progressed = true;
        break;
      }
      default:
        return RUN_DONE;
    }
  }
}

}  // namespace dfccl
