// Point to point (send / recv) and all-to-all.
//
// A send from rank A to rank B and the recv on B that takes it are one
// instance of a *pair tag*: the host names both by the key of (communicator,
// tag, A -> B), so each rank keeps a record of it in its own table and the
// record / meet / chain machinery of collectives applies unchanged: the k-th
// send on (A -> B, tag) meets the k-th recv, and instances of one pair tag
// run one after the other on each channel.  descriptor.root names the peer.
//
//   direct (both ranks in this process): the receiver reads the sender's
//   buffer in place.
//     PUBLISH  buffers and signature                        (no wait)
//     MEET     the peer's instance                          (wait)
//     WORK     receiver: copy its channel part; both: tell the peer
//     WAIT     the peer told us: the receiver has read the sender's buffer,
//              the sender has met the receiver              (wait)
//
//   fifo (peers in other processes): the sender pushes slices into a FIFO the
//   receiver owns in its arena, credit flow control like the ring's.
//     PUBLISH / MEET as above (the receiver publishes its FIFO)
//     WORK     per slice: wait for a free slot / a posted slice, move, post
//     WAIT     sender: every slice consumed (then nobody writes into the
//              receiver's record or FIFO for this instance)
//   A channel with nothing to move still sends one empty slice, so a receiver
//   never finishes before its sender has met it (the receiver's next instance
//   would replace what the sender looks for).
//
// All-to-all is one collective instance of an ordinary tag.  Each rank's
// counts and offsets per peer live in a split table in its arena
// (dfccl_a2a_table layout in abi.h, at descriptor.aux_offset); the record
// publishes where.  Every rank pulls what it receives:
//     PUBLISH  staged: copy this channel's part of every outgoing message into
//              the arena copy first; then publish            (no wait)
//     MEET     every peer, checking the pair's counts both ways  (wait per peer)
//     WORK     copy this channel's part of every incoming message, then store
//              the instance token into each sender's done[channel][me]
//     WAIT     every peer's done flag in our own table       (wait per peer)
// The done flags are plain stores of one writer each (no remote atomics), so
// the same steps serve the direct, staged and ring modes.
#pragma once

#include "transfer_ring.cuh"

namespace dfccl {

enum P2pStep { Q_PUBLISH = 0, Q_MEET = 1, Q_WORK = 2, Q_WAIT = 3, Q_DONE = 4 };

DFCCL_DEV bool p2p_sender(const TaskRun &run) { return run.d->kind == DFCCL_SEND; }

// ---- send / recv, direct ---------------------------------------------------------
DFCCL_DEV int run_p2p_direct(BlockEnv &env, TaskRun &run) {
  const dfccl_task_desc *d = run.d;
  const uint32_t peer = d->root;
  const uint32_t esize = dtype_size(d->dtype);
  for (;;) {
    switch (run.step) {
      case Q_PUBLISH:
        publish_instance(run, 0, d->send_addr, d->recv_addr);
        run.step = Q_MEET;
        run.progressed = true;
        break;
      case Q_MEET: {
        uint64_t word = 0;
        int w = meet_peer(env, run, peer, 0, &word);
        if (w != WAIT_OK) return stop_run(w);
        run.step = Q_WORK;
        run.progressed = true;
        break;
      }
      case Q_WORK:
        if (!p2p_sender(run)) {
          const Range part = split(d->count, d->nchannels, run.chan, pack_elems(esize));
          if (is_leader()) {
            env.sm->srcs[0] = run.ctx->peer_send[0] + part.off * esize;
            env.sm->dsts[0] = d->recv_addr + part.off * esize;
          }
          move_data(env, run, 1, 1, part.len, 1);
          release_fence();
        }
        // One writer per flag: a plain store.  Its value is not instance
        // tagged: the peer zeroed it when it published this instance, which we
        // have met, and zeroes it again only after it has seen this store.
        if (is_leader()) store_relaxed(&record_chan(run.ctx->peer_rec[0], run.chan)->phase2, 1);
        run.step = Q_WAIT;
        run.progressed = true;
        break;
      case Q_WAIT: {
        uint64_t *flag = &run.mine->phase2;
        int w = block_wait(env, run, peer, [&]() -> int { return load_acquire(flag) >= 1 ? 1 : 0; });
        if (w != WAIT_OK) return stop_run(w);
        run.step = Q_DONE;
        run.progressed = true;
        break;
      }
      default:
        return RUN_DONE;
    }
  }
}

// ---- send / recv through the receiver's FIFO ---------------------------------------
struct P2pGeometry {
  uint32_t esize;
  uint64_t slot_bytes;  // the receiver's FIFO slot
  uint64_t slots;       // and its slots per channel
  uint64_t slice;       // elements per FIFO slot
  uint64_t nslices;  // at least one
  Range chan;
};

// The slot size is the receiver's: its FIFO may be smaller than planned (a
// reserved minimum FIFO: the message loops through it in smaller slots),
// and both ends must cut the message alike.  The receiver knows it from its
// own descriptor; the sender learns it from the receiver's fifo word at MEET
// and keeps it in pos[2] (0 before that: nothing then needs the geometry).
DFCCL_DEV uint64_t p2p_slot_bytes(const TaskRun &run) {
  return p2p_sender(run) ? run.pos[2] : fifo_shape(run.d, run.d->fifo_offset).slot_bytes;
}

DFCCL_DEV P2pGeometry p2p_geometry(const TaskRun &run) {
  P2pGeometry g;
  g.esize = dtype_size(run.d->dtype);
  g.slot_bytes = p2p_slot_bytes(run);
  g.slots = p2p_sender(run) ? run.ctx->nbr_slots : fifo_shape(run.d, run.d->fifo_offset).slots;
  g.slice = g.slot_bytes / g.esize;
  if (g.slice == 0) g.slice = 1;  // before MEET on the sender (unused there)
  g.chan = split(run.d->count, run.d->nchannels, run.chan, pack_elems(g.esize));
  g.nslices = g.chan.len == 0 ? 1 : ceil_div(g.chan.len, g.slice);
  return g;
}

// One slice: wait (free slot in the receiver's FIFO / slice posted into ours),
// move it, post (slice posted / credit back).  Resumes at pos[1].
DFCCL_DEV int p2p_slice(BlockEnv &env, TaskRun &run, const P2pGeometry &g) {
  const dfccl_task_desc *d = run.d;
  const bool sender = p2p_sender(run);
  const uint64_t i = run.pos[1];
  const uint64_t inst = d->instance;
  const uint64_t slots = g.slots;
  dfccl_chan_state *m = run.mine;
  int w = block_wait(env, run, d->root, [&]() -> int {
    if (sender ? i - count_for(load_acquire(&m->send_credit), inst) >= slots
               : count_for(load_acquire(&m->recv_posted), inst) < i + 1)
      return 0;
    return net_room(env, run, 1) ? 1 : 0;
  });
  if (w != WAIT_OK) return w;
  const uint64_t off = g.chan.off + i * g.slice;
  const uint64_t end = g.chan.off + g.chan.len;
  const uint64_t len = off >= end ? 0 : (end - off < g.slice ? end - off : g.slice);
  if (is_leader()) {
    if (sender) {
      env.sm->srcs[0] = d->send_addr + off * g.esize;
      env.sm->dsts[0] = run.ctx->nbr_fifo + (i % slots) * g.slot_bytes;
    } else {
      const uint64_t fifo = run.ep->peer_arena[run.ep->rank] + (own_fifo_word(run, run.chan) & DFCCL_FIFO_OFFSET_MASK);
      env.sm->srcs[0] = fifo + (i % slots) * g.slot_bytes;
      env.sm->dsts[0] = d->recv_addr + off * g.esize;
    }
  }
  move_data(env, run, 1, 1, len, 1);
  release_fence();  // with it, the relaxed store below releases the slice
  if (is_leader()) {
    // A remote peer's record and FIFO are mirrors here: the proxy carries
    // the slice, then the word (net.cuh).
    dfccl_chan_state *pc = record_chan(run.ctx->peer_rec[0], run.chan);
    if (sender)
      net_store(env, run, d->root, &pc->recv_posted, tagged_count(inst, i + 1), env.sm->dsts[0], len * g.esize);
    else
      net_store(env, run, d->root, &pc->send_credit, tagged_count(inst, i + 1));
  }
  run.pos[1] += 1;
  run.progressed = true;
  return WAIT_OK;
}

DFCCL_DEV int run_p2p_fifo(BlockEnv &env, TaskRun &run) {
  const dfccl_task_desc *d = run.d;
  const uint32_t peer = d->root;
  const bool sender = p2p_sender(run);
  P2pGeometry g = p2p_geometry(run);
  for (;;) {
    switch (run.step) {
      case Q_PUBLISH: {
        int w = net_wait_room(env, run, 1);
        if (w != WAIT_OK) return stop_run(w);
        publish_instance(run, sender ? 0 : own_fifo_word(run, run.chan), d->send_addr, d->recv_addr);
        if (is_leader()) net_push_record(env, run);
        run.pos[1] = 0;
        run.step = Q_MEET;
        run.progressed = true;
        break;
      }
      case Q_MEET: {
        uint64_t word = 0;
        int w = meet_peer(env, run, peer, 0, &word);
        if (w != WAIT_OK) return stop_run(w);
        if (sender) {
          word = from_leader(word);
          const FifoShape theirs = fifo_shape(d, word);
          if (is_leader()) {
            run.ctx->nbr_slots = (uint32_t)theirs.slots;
            run.ctx->nbr_fifo = run.ep->peer_arena[peer] + (word & DFCCL_FIFO_OFFSET_MASK);
          }
          run.pos[2] = theirs.slot_bytes;
          g = p2p_geometry(run);
          g.slots = theirs.slots;  // the leader's store to the context may not be visible to the warp yet
        }
        run.step = Q_WORK;
        run.progressed = true;
        break;
      }
      case Q_WORK:
        while (run.pos[1] < g.nslices) {
          int w = p2p_slice(env, run, g);
          if (w != WAIT_OK) return stop_run(w);
        }
        run.step = Q_WAIT;
        break;
      case Q_WAIT: {
        if (sender) {
          const uint64_t sent = g.nslices, inst = d->instance;
          dfccl_chan_state *m = run.mine;
          int w = block_wait(env, run, peer, [&]() -> int {
            return count_for(load_acquire(&m->send_credit), inst) >= sent ? 1 : 0;
          });
          if (w != WAIT_OK) return stop_run(w);
        }
        run.step = Q_DONE;
        run.progressed = true;
        break;
      }
      default:
        return RUN_DONE;
    }
  }
}

DFCCL_DEV int run_p2p(BlockEnv &env, TaskRun &run) {
  return run.d->path == DFCCL_PATH_DIRECT ? run_p2p_direct(env, run) : run_p2p_fifo(env, run);
}

// ---- all-to-all -------------------------------------------------------------------
// Word `index` of a split table (abi.h): relaxed loads, because the memory may
// have held another instance's table (stale L1 lines) and peers' tables are
// remote.
DFCCL_DEV uint64_t a2a_word(uint64_t table, uint64_t index) { return load_relaxed(ptr<const uint64_t>(table) + index); }

struct A2aGeometry {
  uint32_t n, r, c, nch, esize;
  uint64_t align;
  uint64_t table;  // this rank's split table
  uint64_t copy;   // staged: the copy of this rank's send buffer
};

DFCCL_DEV A2aGeometry a2a_geometry(const TaskRun &run) {
  A2aGeometry g;
  g.n = run.ep->nranks;
  g.r = run.ep->rank;
  g.c = run.chan;
  g.nch = run.d->nchannels;
  g.esize = dtype_size(run.d->dtype);
  g.align = pack_elems(g.esize);
  g.table = run.ep->peer_arena[g.r] + run.d->aux_offset;
  g.copy = g.table + DFCCL_A2A_COPY_OFFSET(g.n, g.nch);
  return g;
}

// The leader: rank p's published channel state (p != r, cache index i).
DFCCL_DEV dfccl_chan_state *a2a_peer_chan(const TaskRun &run, const A2aGeometry &g, uint32_t p) {
  const uint32_t index = peer_index(g.r, g.n, p);
  return record_chan(peer_record(run, index, p), g.c);
}

DFCCL_DEV int run_all_to_all(BlockEnv &env, TaskRun &run) {
  const dfccl_task_desc *d = run.d;
  const A2aGeometry g = a2a_geometry(run);
  const uint32_t n = g.n;
  for (;;) {
    switch (run.step) {
      case Q_PUBLISH: {
        // A remote peer reads our table and its part of the copy in its
        // mirror of our arena: each goes there before our record does.
        int w = net_wait_room(env, run, 2 * net_peers(run.ep) + 1);
        if (w != WAIT_OK) return stop_run(w);
        if (staged(run)) {
          // The peers' channel g.c reads part g.c of each message.
          for (uint32_t p = 0; p < n; ++p) {
            if (p == g.r) continue;
            const uint64_t off = a2a_word(g.table, p);
            const Range part = split(a2a_word(g.table, n + p), g.nch, g.c, g.align);
            if (part.len == 0) continue;
            if (is_leader()) {
              env.sm->srcs[0] = d->send_addr + (off + part.off) * g.esize;
              env.sm->dsts[0] = g.copy + (off + part.off) * g.esize;
            }
            move_data(env, run, 1, 1, part.len, 1);
          }
          release_fence();  // the copies before `ready`
          if (is_leader()) {
            for (uint32_t p = 0; p < n; ++p) {
              if (!net_peer(run.ep, p)) continue;
              const Range part = split(a2a_word(g.table, n + p), g.nch, g.c, g.align);
              net_share(env, run, p, g.table, 4ull * n * 8);  // counts and offsets, not the done flags
              net_share(env, run, p, g.copy + (a2a_word(g.table, p) + part.off) * g.esize, part.len * g.esize);
            }
          }
          publish_instance(run, d->aux_offset, d->aux_offset + DFCCL_A2A_COPY_OFFSET(n, g.nch), d->recv_addr);
        } else {
          // Peers read our send buffer in place: all of them in this process.
          publish_instance(run, d->aux_offset, d->send_addr, d->recv_addr);
        }
        if (is_leader()) net_push_record(env, run);
        run.pos[0] = 0;
        run.pos[1] = 0;
        run.step = Q_MEET;
        run.progressed = true;
        break;
      }
      case Q_MEET:
        while (run.pos[0] + 1 < n) {
          const uint32_t i = (uint32_t)run.pos[0];
          const uint32_t p = peer_at(g.r, n, i);
          uint64_t aux = 0;
          int w = meet_peer(env, run, p, i, &aux);
          if (w != WAIT_OK) return stop_run(w);
          // The pair agrees both ways: what p sends us is what we expect from
          // p, and what we send p is what p expects from us.  Both ranks
          // check, so both report the mismatch.
          uint64_t bad = 0;
          if (is_leader()) {
            const uint64_t theirs = run.ep->peer_arena[p] + aux;
            bad = a2a_word(theirs, n + g.r) != a2a_word(g.table, 3 * n + p) ||
                  a2a_word(theirs, 3 * n + g.r) != a2a_word(g.table, n + p);
          }
          if (from_leader(bad)) {
            run.status = DFCCL_STATUS_MISMATCH;
            run.detail = (int32_t)p;
            return RUN_FAILED;
          }
          run.pos[0] += 1;
          run.progressed = true;
        }
        run.step = Q_WORK;
        break;
      case Q_WORK: {
        // Room for the done flags of the remote peers first (the moves
        // below are not repeated once they ran).
        int w = net_wait_room(env, run, net_peers(run.ep));
        if (w != WAIT_OK) return stop_run(w);
        // Our own message first, then the peers' in ring order (every rank
        // starts at a different sender).
        for (uint32_t i = 0; i < n; ++i) {
          const uint32_t p = (g.r + i) % n;
          const Range part = split(a2a_word(g.table, 3 * n + p), g.nch, g.c, g.align);
          if (part.len == 0) continue;
          if (is_leader()) {
            uint64_t src;
            if (p == g.r) {
              src = d->send_addr + (a2a_word(g.table, p) + part.off) * g.esize;
            } else {
              const dfccl_chan_state *pc = a2a_peer_chan(run, g, p);
              const uint64_t theirs = run.ep->peer_arena[p] + load_relaxed(&pc->fifo);
              const uint64_t base = staged(run) ? run.ep->peer_arena[p] + load_relaxed(&pc->send_addr)
                                                : load_relaxed(&pc->send_addr);
              src = base + (a2a_word(theirs, g.r) + part.off) * g.esize;
            }
            env.sm->srcs[0] = src;
            env.sm->dsts[0] = d->recv_addr + (a2a_word(g.table, 2 * n + p) + part.off) * g.esize;
          }
          move_data(env, run, 1, 1, part.len, 1);
        }
        release_fence();  // our reads of the peers' data before the done flags
        if (is_leader()) {
          for (uint32_t p = 0; p < n; ++p) {
            if (p == g.r) continue;
            const uint64_t theirs = run.ep->peer_arena[p] + load_relaxed(&a2a_peer_chan(run, g, p)->fifo);
            net_store(env, run, p, ptr<uint64_t>(theirs) + 4 * (uint64_t)n + (uint64_t)g.c * n + g.r, run.token);
          }
        }
        run.step = Q_WAIT;
        run.progressed = true;
        break;
      }
      case Q_WAIT:
        // Every peer has read what it takes from us on this channel: our
        // buffers, copy and table may go.
        while (run.pos[1] + 1 < n) {
          const uint32_t p = peer_at(g.r, n, (uint32_t)run.pos[1]);
          const uint64_t *flag = ptr<const uint64_t>(g.table) + 4 * (uint64_t)n + (uint64_t)g.c * n + p;
          const uint64_t token = run.token;
          int w = block_wait(env, run, p, [&]() -> int { return load_acquire(flag) == token ? 1 : 0; });
          if (w != WAIT_OK) return stop_run(w);
          run.pos[1] += 1;
          run.progressed = true;
        }
        run.step = Q_DONE;
        break;
      default:
        return RUN_DONE;
    }
  }
}

}  // namespace dfccl
