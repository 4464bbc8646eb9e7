// Pieces every data path uses: publishing this rank's instance of a tag,
// meeting a peer's published instance, geometry, and giving up loudly.
#pragma once

#include "move.cuh"
#include "net.cuh"
#include "wait.cuh"

namespace dfccl {

// The peer a wait names when it waits for several (diagnostics).
constexpr uint32_t kAnyPeer = 0xfffeu;

DFCCL_DEV uint64_t round_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }
DFCCL_DEV uint64_t ceil_div(uint64_t x, uint64_t a) { return (x + a - 1) / a; }

// Elements per 16-byte pack: partitions are cut on pack boundaries so that
// every part but the last of a buffer keeps 16-byte alignment.
DFCCL_DEV uint64_t pack_elems(uint32_t esize) { return esize >= 16 ? 1 : 16 / esize; }

struct Range {
  uint64_t off, len;
};

// Part `i` of `parts` equal, pack-aligned pieces of [0, total).
DFCCL_DEV Range split(uint64_t total, uint32_t parts, uint32_t i, uint64_t align) {
  uint64_t per = round_up(ceil_div(total, parts), align);
  uint64_t b = per * i < total ? per * i : total;
  uint64_t e = b + per < total ? b + per : total;
  return Range{b, e - b};
}

// The ring's steps (transfer_ring.cuh); a staged direct collective that falls
// back to the ring enters at R_ADOPT (transfer_direct.cuh).
enum RingStep { R_PUBLISH = 0, R_MEET = 1, R_PRIMS = 2, R_DRAIN = 3, R_FINISH = 4, R_DONE = 5, R_ADOPT = 6 };

// A receive FIFO as a fifo word names it (abi.h, DFCCL_FIFO_*), the planned
// shape filled in (its offsets are 16-byte aligned: the low bits are flags).
struct FifoShape {
  uint64_t offset;      // in the owner's arena
  uint64_t unit;        // the word's size field (0: the planned slice)
  uint64_t slot_bytes;
  uint64_t slots;
};

DFCCL_DEV FifoShape fifo_shape(const dfccl_task_desc *d, uint64_t word) {
  FifoShape f;
  f.offset = word & DFCCL_FIFO_OFFSET_MASK & ~DFCCL_FIFO_FLAG_MASK;
  f.unit = (word >> DFCCL_FIFO_UNIT_SHIFT) & DFCCL_FIFO_UNIT_MAX;
  f.slot_bytes = f.unit != 0 ? f.unit * DFCCL_FIFO_UNIT_BYTES : d->slice_bytes;
  f.slots = word >> DFCCL_FIFO_SLOTS_SHIFT;
  if (f.slots == 0) f.slots = d->fifo_slots;
  return f;
}

// This rank's receive FIFO on this channel, as the word peers read.
DFCCL_DEV uint64_t own_fifo_word(const TaskRun &run, uint32_t channel) {
  const FifoShape f = fifo_shape(run.d, run.d->fifo_offset);
  return (f.slots << DFCCL_FIFO_SLOTS_SHIFT) | (f.unit << DFCCL_FIFO_UNIT_SHIFT) |
         (f.offset + channel * f.slots * f.slot_bytes);
}

// Slices of `slice_bytes` a FIFO of this shape holds.
DFCCL_DEV uint64_t fifo_slices(const FifoShape &f, uint64_t slice_bytes) {
  return f.slots * f.slot_bytes / slice_bytes;
}

// One data move from the address lists the leader wrote into sm->srcs/dsts.
// The movers' writes are published by a later flag, after release_fence().
DFCCL_DEV void move_data(BlockEnv &env, const TaskRun &run, uint32_t nsrcs, uint32_t ndsts, uint64_t nelem,
                         uint32_t postdiv) {
  if (is_leader()) {
    MoveDesc &m = env.sm->move;
    m.nelem = nelem;
    m.nsrcs = nsrcs;
    m.ndsts = ndsts;
    m.postdiv = postdiv;
    m.dtype = run.d->dtype;
    m.op = run.d->op;
    m.quit = 0;
    m.kind = MOVE_REDUCE_COPY;
  }
  control_sync();
  execute_move(env.sm);
}

// The peer's record address in the per-task cache, or found again by probing.
DFCCL_DEV uint64_t peer_record(const TaskRun &run, uint32_t index, uint32_t rank) {
  if (index < DFCCL_PEER_CACHE && run.ctx->peer_rec[index] != 0) return run.ctx->peer_rec[index];
  return probe_record(run.ep, rank, run.d->tag_key, run.chan, run.d->instance);
}

// Step 0 of every collective: make this rank's instance visible on this
// channel.  Counters peers write into are zeroed first; peers write them only
// after they have seen `ready`, which is released last.
DFCCL_DEV void publish_instance(TaskRun &run, uint64_t fifo_word, uint64_t send_word, uint64_t recv_word) {
  if (is_leader()) {
    dfccl_chan_state *m = run.mine;
    const dfccl_task_desc *d = run.d;
    store_relaxed(&m->recv_posted, 0);
    store_relaxed(&m->send_credit, 0);
    store_relaxed(&m->phase1, 0);
    store_relaxed(&m->phase2, 0);
    store_relaxed(&m->signature, task_signature(*d, run.ep->nranks));
    store_relaxed(&m->count, d->count);
    store_relaxed(&m->slice_bytes, d->slice_bytes);
    store_relaxed(&m->send_addr, send_word);
    store_relaxed(&m->recv_addr, recv_word);
    store_relaxed(&m->fifo, fifo_word);
    store_relaxed(&m->instance, d->instance);
    uint64_t own = record_at(run.ep, run.ep->rank, d->bucket);
    store_relaxed(&ptr<dfccl_record_header>(own)->key, d->tag_key);
    store_release(&m->ready, run.token);  // releases every field above
  }
}

// Waits until `peer` has published this instance on this channel and checks
// that it names the same collective.  One remote read per poll.  The peer's
// record is first looked for where this tag met it last time (the cache in
// this rank's record header: a tag keeps its bucket while it is bound, so
// successive instances skip the probe), else found by probing; the table is
// probed afresh every 64 polls, because a bucket that held this tag earlier
// may still carry its key while the live record appears elsewhere only when
// the peer publishes.  The peer's abort marker is read every 16 polls.  Once
// `ready` matches, the peer's published fields are read in one batch of
// independent loads (one round trip, not one per field).  The leader caches
// the record and the peer's buffer addresses (direct path) in the context and
// the record in the bucket's owner words, and returns the peer's fifo word in
// *fifo_word.
DFCCL_DEV int meet_peer(BlockEnv &env, TaskRun &run, uint32_t peer, uint32_t cache_index, uint64_t *fifo_word) {
  uint64_t rec = 0, met = 0, send_addr = 0, recv_addr = 0;
  uint32_t polls = 0;
  const uint32_t c = run.chan;
  dfccl_owner_bucket *own = owner_bucket(run.ep, run.d->bucket);
  // The owner words cache by peer rank (ranks >= DFCCL_PEER_CACHE are
  // probed).  Their key is read once: while this instance is pending the bucket keeps
  // this tag, so a key that names the tag goes on naming it (the tag's
  // other channels store the same values).
  const bool cached = is_leader() && peer < DFCCL_PEER_CACHE && load_own(&own->cache_key) == run.d->tag_key;
  if (cached) rec = load_own(&own->peer_rec[peer]);
  const uint64_t cached_rec = rec;
  int r = block_wait(env, run, peer, [&]() -> int {
    ++polls;
    if (rec == 0 || (polls & 63u) == 0) {
      rec = probe_record(run.ep, peer, run.d->tag_key, c, run.d->instance);
      if (rec == 0) return 0;
    }
    dfccl_chan_state *pc = record_chan(rec, c);
    if (load_acquire(&pc->ready) != run.token) {
      return (polls & 15u) == 0 && take_abort_mark(run, pc, load_relaxed(&pc->abort_token)) ? -1 : 0;
    }
    met = rec;
    const uint64_t abort_token = load_relaxed(&pc->abort_token);
    const uint64_t signature = load_relaxed(&pc->signature);
    const uint64_t count = load_relaxed(&pc->count);
    const uint64_t slice_bytes = load_relaxed(&pc->slice_bytes);
    const uint64_t fifo = load_relaxed(&pc->fifo);
    send_addr = load_relaxed(&pc->send_addr);
    recv_addr = load_relaxed(&pc->recv_addr);
    // The signature first: a peer that failed this instance because it does
    // not match ours has pushed its abort here, and both sides should report
    // the mismatch, not one of them an abort.
    if (signature != task_signature(*run.d, run.ep->nranks) || count != run.d->count ||
        slice_bytes != run.d->slice_bytes) {
      // Fields that differ may be a torn read: a peer that gave this instance
      // up (aborted, or failed it elsewhere) goes on to publish its next
      // instance of the tag here, and those field stores can be seen before
      // its `ready`.  Its give-up mark precedes them (push_abort's fence):
      // read it again after this fence.  A mark says why the peer left (a
      // mismatch it saw travels as a mismatch); a `ready` that moved on says
      // the fields were not this instance's; only otherwise is it ours.
      fence_system();
      if (take_abort_mark(run, pc, load_acquire(&pc->abort_token))) return -1;
      if (load_relaxed(&pc->ready) != run.token) return 0;
      run.status = DFCCL_STATUS_MISMATCH;
      run.detail = (int32_t)peer;
      return -1;
    }
    if (take_abort_mark(run, pc, abort_token)) return -1;
    *fifo_word = fifo;
    return 1;
  });
  if (is_leader() && met != 0 && cache_index < DFCCL_PEER_CACHE) {
    run.ctx->peer_rec[cache_index] = met;
    run.ctx->peer_send[cache_index] = send_addr;
    run.ctx->peer_recv[cache_index] = recv_addr;
  }
  if (is_leader() && met != 0 && peer < DFCCL_PEER_CACHE) {
    // Every channel of the tag writes the same values: plain stores suffice.
    // The key goes last: a reader that sees it finds this tag's records (a
    // bucket changes tags only when nothing of the old tag is pending).
    if (!cached) {
      if (load_own(&own->cache_key) != run.d->tag_key) {
        for (uint32_t i = 0; i < DFCCL_PEER_CACHE; ++i) own->peer_rec[i] = 0;
      }
      own->peer_rec[peer] = met;
      own->cache_key = run.d->tag_key;
    } else if (met != cached_rec) {
      own->peer_rec[peer] = met;
    }
  }
  return r;
}

// Marks this instance failed where the peers will look: in this rank's own
// record (peers that have not met us yet find it there) and in the records of
// the peers we talk to (so that their waits stop).  A failure thereby travels
// along the ring or across the star instead of leaving peers to time out.  The
// rank where it started travels with it.
DFCCL_DEV void mark_abort(uint64_t rec, uint32_t channel, uint64_t token, uint64_t info) {
  dfccl_chan_state *pc = record_chan(rec, channel);
  store_relaxed(&pc->abort_info, info);
  store_release(&pc->abort_token, token);
}

// mark_abort into `rank`'s record `rec`; a remote rank's through the proxy
// (a failure path: with no room in the queue the mark is dropped, and the
// peer learns of the failure when it times out or sees this rank leave).
DFCCL_DEV void net_mark_abort(const BlockEnv &env, TaskRun &run, uint32_t rank, uint64_t rec, uint64_t info) {
  if (!net_peer(run.ep, rank)) {
    mark_abort(rec, run.chan, run.token, info);
    return;
  }
  if (!net_room(env, run, 2)) return;
  dfccl_chan_state *pc = record_chan(rec, run.chan);
  net_store(env, run, rank, &pc->abort_info, info);
  fence_system();
  net_store(env, run, rank, &pc->abort_token, run.token);
}

struct RingNeighbours {
  uint32_t prev, next;
};
DFCCL_DEV RingNeighbours ring_neighbours(const dfccl_endpoint *ep) {
  return RingNeighbours{(ep->rank + ep->nranks - 1) % ep->nranks, (ep->rank + 1) % ep->nranks};
}

DFCCL_DEV void push_abort(BlockEnv &env, TaskRun &run, bool all_peers) {
  if (!is_leader()) return;
  // What travels: a failure that came from elsewhere keeps its status and
  // origin (a mismatch or a lost peer reaches every rank as itself); one
  // that starts here is a mismatch seen here, or this rank giving up.
  uint32_t status = DFCCL_STATUS_PEER_ABORTED, origin = run.ep->rank;
  if (run.relayed && run.detail >= 0) {
    status = run.status;
    origin = (uint32_t)run.detail;
  } else if (run.status == DFCCL_STATUS_MISMATCH) {
    status = DFCCL_STATUS_MISMATCH;
  }
  const uint64_t info = ((uint64_t)status << 32) | origin;
  mark_abort(record_at(run.ep, run.ep->rank, run.d->bucket), run.chan, run.token, info);
  if (net_room(env, run, 1)) net_push_record(env, run);
  // Our mark before the probes below: a peer not met yet either is found
  // by them or, publishing later, meets our record with the mark in it.
  fence_system();
  if (all_peers) {
    for (uint32_t i = 0; i + 1 < run.ep->nranks; ++i) {
      uint32_t p = peer_at(run.ep->rank, run.ep->nranks, i);
      uint64_t rec = peer_record(run, i, p);
      if (rec != 0) net_mark_abort(env, run, p, rec, info);
    }
  } else if (run.d->kind == DFCCL_SEND || run.d->kind == DFCCL_RECV) {
    // Point to point: the one peer, at 0.
    const uint64_t rec = peer_record(run, 0, run.d->root);
    if (rec != 0) net_mark_abort(env, run, run.d->root, rec, info);
  } else {
    // The ring's cache: the previous rank at 0, the next at 1.  A neighbour
    // not met yet (this run failed meeting the other one) is probed: it may
    // have met us already and wait for our data.
    const RingNeighbours nb = ring_neighbours(run.ep);
    for (uint32_t i = 0; i < 2 && i + 1 < run.ep->nranks; ++i) {
      const uint32_t p = i == 0 ? nb.prev : nb.next;
      const uint64_t rec = peer_record(run, i, p);
      if (rec != 0) net_mark_abort(env, run, p, rec, info);
    }
  }
  // The marks before anything this channel publishes next (the tag's next
  // instance rewrites this record's fields): a peer that reads those fields
  // torn finds the mark (meet_peer).  Failures only, so it costs nothing
  // on the way of a collective that completes.
  fence_system();
}

}  // namespace dfccl
