// The staged ring path: data moves rank r -> r+1 in slices through a FIFO that
// the receiver owns (one per tag instance and channel), with credit flow
// control like NCCL's simple protocol.  Every primitive is
//
//   wait   until the slice to receive has been posted into our FIFO and/or the
//          next rank's FIFO has a free slot          (the preemption point)
//   move   reduce/copy one slice
//   post   credit back to the previous rank / "posted" to the next rank
//
// so a preempted collective stops between two primitives: a slice is either
// fully moved and posted or not started, and resume continues at the saved
// primitive index.  Before completing, a rank waits until the next rank has
// consumed every slice it sent, so no peer writes into its record afterwards.
//
// Each rank's FIFO has its own shape (abi.h, DFCCL_FIFO_*): the planned one,
// or a smaller one when its staging was short.  Every rank therefore meets
// every peer, not only its neighbours, and the ring runs with the smallest
// slot size of all as its slice (every rank computes the same from the same
// published words); each FIFO holds at least two such slices, which is all
// the ring needs.  Each rank then marks in its own record that it has met
// every peer (phase1, a plain store: ring peers need no atomics) and
// completes only once every peer has marked so or moved on to a later
// instance, so no peer still looks for this instance in its record when it
// publishes the next (a rank of a broadcast or reduce chain could otherwise
// finish before a rank further down met it).
#pragma once

#include "transfer_common.cuh"

namespace dfccl {


// What one primitive does.
enum PrimFlags : uint32_t {
  P_RECV = 1,       // source: the slice in our FIFO
  P_SEND = 2,       // destination: a slot of the next rank's FIFO
  P_WITH_IN = 4,    // source: our input chunk (reduced with the FIFO slice if P_RECV)
  P_OUT = 8,        // destination: our output chunk
  P_FINAL = 16      // the value is final: apply AVG's division
};

struct RingGeometry {
  uint32_t n, r, c, nch, esize, prev, next;
  uint32_t nprims;   // primitives per loop
  uint32_t q;        // position in the chain (broadcast, reduce)
  uint64_t align, slice;
  uint64_t slice_bytes;
  uint64_t nloops;
  Range chan;        // this channel's part of [0, count)
  bool in_place;
};

struct Prim {
  uint32_t flags;
  uint64_t in_off, out_off, len;  // elements
};

// `slice_bytes`: the slice the ring runs with (known once every peer is met).
DFCCL_DEV RingGeometry ring_geometry(const TaskRun &run, uint64_t slice_bytes) {
  const dfccl_task_desc *d = run.d;
  RingGeometry g;
  g.n = run.ep->nranks;
  g.r = run.ep->rank;
  g.c = run.chan;
  g.nch = d->nchannels;
  g.esize = dtype_size(d->dtype);
  g.align = pack_elems(g.esize);
  g.slice_bytes = slice_bytes;
  g.slice = slice_bytes / g.esize;
  g.prev = (g.r + g.n - 1) % g.n;
  g.next = (g.r + 1) % g.n;
  g.chan = split(d->count, g.nch, g.c, g.align);
  g.q = 0;
  switch (d->kind) {
    case DFCCL_ALL_REDUCE:
      g.nprims = 2 * g.n - 1;
      g.nloops = ceil_div(g.chan.len, (uint64_t)g.n * g.slice);
      g.in_place = d->send_addr == d->recv_addr;
      break;
    case DFCCL_ALL_GATHER:
      g.nprims = g.n;
      g.nloops = ceil_div(g.chan.len, g.slice);
      g.in_place = d->send_addr == d->recv_addr + (uint64_t)g.r * d->count * g.esize;
      break;
    case DFCCL_REDUCE_SCATTER:
      g.nprims = g.n;
      g.nloops = ceil_div(g.chan.len, g.slice);
      g.in_place = d->recv_addr == d->send_addr + (uint64_t)g.r * d->count * g.esize;
      break;
    case DFCCL_BROADCAST:
      g.nprims = 1;
      g.nloops = ceil_div(g.chan.len, g.slice);
      g.q = (g.r + g.n - d->root) % g.n;
      g.in_place = d->send_addr == d->recv_addr;
      break;
    default:  // DFCCL_REDUCE: the chain runs root+1 -> ... -> root
      g.nprims = 1;
      g.nloops = ceil_div(g.chan.len, g.slice);
      g.q = (g.r + 2 * g.n - d->root - 1) % g.n;
      g.in_place = d->send_addr == d->recv_addr;
      break;
  }
  return g;
}

DFCCL_DEV bool receives(const RingGeometry &g, int kind) {
  return (kind == DFCCL_BROADCAST || kind == DFCCL_REDUCE) ? g.q > 0 : true;
}
DFCCL_DEV bool sends(const RingGeometry &g, int kind) {
  return (kind == DFCCL_BROADCAST || kind == DFCCL_REDUCE) ? g.q + 1 < g.n : true;
}

// Primitive `index` of this rank's sequence (loop-major).
DFCCL_DEV Prim ring_prim(const RingGeometry &g, const dfccl_task_desc *d, uint64_t index) {
  const uint64_t loop = index / g.nprims;
  const uint32_t k = (uint32_t)(index % g.nprims);
  const uint32_t n = g.n, r = g.r;
  Prim p;
  if (d->kind == DFCCL_ALL_REDUCE) {
    // Reduce-scatter steps k = 0..n-1 move chunk r-k; the last leaves chunk
    // r+1 final.  All-gather steps k = n..2n-2 forward chunk r+n-k.
    uint32_t j;
    if (k == 0) {
      p.flags = P_WITH_IN | P_SEND;
      j = r;
    } else if (k + 1 < n) {
      p.flags = P_RECV | P_WITH_IN | P_SEND;
      j = (r + n - k) % n;
    } else if (k + 1 == n) {
      p.flags = P_RECV | P_WITH_IN | P_SEND | P_OUT | P_FINAL;
      j = (r + 1) % n;
    } else {
      p.flags = P_RECV | P_OUT | (k + 1 < 2 * n - 1 ? P_SEND : 0u);
      j = (r + 2 * n - k) % n;
    }
    const uint64_t per_loop = (uint64_t)n * g.slice;
    const uint64_t lb = loop * per_loop;
    const uint64_t ll = g.chan.len - lb < per_loop ? g.chan.len - lb : per_loop;
    Range part = split(ll, n, j, g.align);
    p.in_off = p.out_off = g.chan.off + lb + part.off;
    p.len = part.len;
    return p;
  }
  const uint64_t lb = g.chan.off + loop * g.slice;
  const uint64_t rest = g.chan.off + g.chan.len - lb;
  p.len = rest < g.slice ? rest : g.slice;
  p.in_off = p.out_off = lb;
  switch (d->kind) {
    case DFCCL_ALL_GATHER: {
      uint32_t j;
      if (k == 0) {
        p.flags = P_WITH_IN | P_SEND | (g.in_place ? 0u : (uint32_t)P_OUT);
        j = r;
      } else {
        p.flags = P_RECV | P_OUT | (k + 1 < n ? P_SEND : 0u);
        j = (r + n - k) % n;
      }
      p.out_off = (uint64_t)j * d->count + lb;
      break;
    }
    case DFCCL_REDUCE_SCATTER: {
      uint32_t j = (r + 2 * n - 1 - k) % n;
      if (k == 0) p.flags = P_WITH_IN | P_SEND;
      else if (k + 1 < n) p.flags = P_RECV | P_WITH_IN | P_SEND;
      else p.flags = P_RECV | P_WITH_IN | P_OUT | P_FINAL;
      p.in_off = (uint64_t)j * d->count + lb;
      break;
    }
    case DFCCL_BROADCAST:
      if (g.q == 0) p.flags = P_WITH_IN | P_SEND | (g.in_place ? 0u : (uint32_t)P_OUT);
      else p.flags = P_RECV | P_OUT | (g.q + 1 < n ? P_SEND : 0u);
      break;
    default:  // DFCCL_REDUCE
      if (g.q == 0) p.flags = P_WITH_IN | P_SEND;
      else if (g.q + 1 < n) p.flags = P_RECV | P_WITH_IN | P_SEND;
      else p.flags = P_RECV | P_WITH_IN | P_OUT | P_FINAL;
      break;
  }
  return p;
}

// The peer met `i`-th: the previous rank, the next, then the others.
DFCCL_DEV uint32_t ring_peer(const RingGeometry &g, uint64_t i) {
  return i == 0 ? g.prev : i == 1 ? g.next : (uint32_t)((g.r + i) % g.n);
}

DFCCL_DEV int ring_step(BlockEnv &env, TaskRun &run, const RingGeometry &g) {
  const dfccl_task_desc *d = run.d;
  const Prim p = ring_prim(g, d, run.pos[1]);
  const uint64_t sent = run.pos[2], recvd = run.pos[3];
  const uint64_t inst = d->instance;
  const uint32_t nbr_slots = run.ctx->nbr_slots;
  const uint64_t own_slots = fifo_slices(fifo_shape(d, d->fifo_offset), g.slice_bytes);
  dfccl_chan_state *m = run.mine;
  int w = block_wait(env, run, (p.flags & P_RECV) ? g.prev : g.next, [&]() -> int {
    if ((p.flags & P_RECV) && count_for(load_acquire(&m->recv_posted), inst) < recvd + 1) return 0;
    if ((p.flags & P_SEND) && sent - count_for(load_acquire(&m->send_credit), inst) >= nbr_slots) return 0;
    return net_room(env, run, 2) ? 1 : 0;
  });
  if (w != WAIT_OK) return w;

  uint32_t nsrcs = 0, ndsts = 0;
  if (is_leader()) {
    const uint64_t my_fifo = run.ep->peer_arena[g.r] + (own_fifo_word(run, g.c) & DFCCL_FIFO_OFFSET_MASK);
    if (p.flags & P_RECV) env.sm->srcs[nsrcs++] = my_fifo + (recvd % own_slots) * g.slice_bytes;
    if (p.flags & P_WITH_IN) env.sm->srcs[nsrcs++] = d->send_addr + p.in_off * g.esize;
    if (p.flags & P_OUT) env.sm->dsts[ndsts++] = d->recv_addr + p.out_off * g.esize;
    if (p.flags & P_SEND) env.sm->dsts[ndsts++] = run.ctx->nbr_fifo + (sent % nbr_slots) * g.slice_bytes;
  } else {
    nsrcs = ((p.flags & P_RECV) ? 1u : 0u) + ((p.flags & P_WITH_IN) ? 1u : 0u);
    ndsts = ((p.flags & P_OUT) ? 1u : 0u) + ((p.flags & P_SEND) ? 1u : 0u);
  }
  const uint32_t postdiv = ((p.flags & P_FINAL) && d->op == DFCCL_AVG) ? g.n : 1;
  move_data(env, run, nsrcs, ndsts, p.len, postdiv);
  release_fence();  // with it, the relaxed stores below release the slice
  if (is_leader()) {
    // A remote neighbour's record and FIFO are mirrors here: the proxy
    // carries the slice, then the word (net.cuh).
    if (p.flags & P_RECV)
      net_store(env, run, g.prev, &record_chan(run.ctx->peer_rec[0], g.c)->send_credit, tagged_count(inst, recvd + 1));
    if (p.flags & P_SEND)
      net_store(env, run, g.next, &record_chan(run.ctx->peer_rec[1], g.c)->recv_posted, tagged_count(inst, sent + 1),
                env.sm->dsts[ndsts - 1], p.len * g.esize);
  }
  run.pos[1] += 1;
  run.pos[2] += (p.flags & P_SEND) ? 1 : 0;
  run.pos[3] += (p.flags & P_RECV) ? 1 : 0;
  run.progressed = true;
  return WAIT_OK;
}

// Enters the ring with every peer met: the slice the ring runs with, the
// next rank's FIFO (its word), and this rank's mark that it met them all.
DFCCL_DEV void start_ring(TaskRun &run, const RingGeometry &g, uint64_t slice_bytes, uint64_t next_word) {
  if (is_leader()) {
    const FifoShape next = fifo_shape(run.d, next_word);
    run.ctx->nbr_slots = (uint32_t)fifo_slices(next, slice_bytes);
    run.ctx->nbr_fifo = run.ep->peer_arena[g.next] + next.offset;
    store_relaxed(&run.mine->phase1, tagged_count(run.d->instance, 1));
  }
  run.pos[0] = slice_bytes;
  run.pos[1] = run.pos[2] = run.pos[3] = 0;
  run.progressed = true;
}

// `base`: where the ring's steps start in run.step (0; D_RING for a staged
// direct collective that fell back to the ring).
DFCCL_DEV int run_ring(BlockEnv &env, TaskRun &run, uint32_t base) {
  const dfccl_task_desc *d = run.d;
  // Before every peer is met the slice is not known yet: the planned one
  // stands in (nothing before R_PRIMS uses it).
  const uint32_t step = run.step - base;
  RingGeometry g = ring_geometry(run, step >= R_PRIMS && step < R_DONE ? run.pos[0] : d->slice_bytes);
  // With two ranks the previous and the next are one peer: its cache entry
  // fills both places (prev at 0, next at 1), met once.
  const uint64_t meets = g.n == 2 ? 2 : g.n - 1;
  for (;;) {
    switch (run.step - base) {
      case R_PUBLISH: {
        int w = net_wait_room(env, run, 1);
        if (w != WAIT_OK) return stop_run(w);
        publish_instance(run, own_fifo_word(run, g.c), d->send_addr, d->recv_addr);
        if (is_leader()) net_push_record(env, run);
        run.pos[0] = 0;
        run.pos[3] = fifo_shape(d, d->fifo_offset).slot_bytes;
        run.step = base + R_MEET;
        run.progressed = true;
        break;
      }
      case R_MEET: {
        // pos[0]: peers met so far (ring_peer order); pos[3]: the smallest
        // slot size seen, ours included; pos[2]: the next rank's word.
        while (run.pos[0] < meets) {
          if (g.n == 2 && run.pos[0] == 1) {
            // Met as the previous rank already (its word is in pos[2]):
            // where a peer's record lies in host memory (another host),
            // a meeting is several PCIe round trips.
            if (is_leader()) {
              run.ctx->peer_rec[1] = run.ctx->peer_rec[0];
              run.ctx->peer_send[1] = run.ctx->peer_send[0];
              run.ctx->peer_recv[1] = run.ctx->peer_recv[0];
            }
            run.pos[0] = 2;
            break;
          }
          uint64_t word = 0;
          int w = meet_peer(env, run, ring_peer(g, run.pos[0]), (uint32_t)run.pos[0], &word);
          if (w != WAIT_OK) return stop_run(w);
          word = from_leader(word);
          const uint64_t slot_bytes = fifo_shape(d, word).slot_bytes;
          if (slot_bytes < run.pos[3]) run.pos[3] = slot_bytes;
          if (run.pos[0] == 1 || g.n == 2) run.pos[2] = word;
          run.pos[0] += 1;
          run.progressed = true;
        }
        int w = net_wait_room(env, run, 1);
        if (w != WAIT_OK) return stop_run(w);
        start_ring(run, g, run.pos[3], run.pos[2]);
        if (is_leader()) net_push_record(env, run);
        g = ring_geometry(run, run.pos[0]);
        run.step = base + R_PRIMS;
        break;
      }
      case R_ADOPT: {
        // A staged direct collective met every peer in its own order
        // (peer r + 1 + i at cache index i; pos[3], pos[2] as in R_MEET):
        // the ring's cache holds the previous rank at 0, the next at 1,
        // rank r + i at i.
        if (is_leader()) {
          uint64_t direct[DFCCL_PEER_CACHE];
          for (uint32_t i = 0; i < DFCCL_PEER_CACHE; ++i) direct[i] = run.ctx->peer_rec[i];
          for (uint32_t i = 0; i < meets && i < DFCCL_PEER_CACHE; ++i) {
            const uint32_t j = i == 0 ? g.n - 2 : i == 1 ? 0 : i - 1;
            const uint64_t rec = j < DFCCL_PEER_CACHE ? direct[j] : 0;
            run.ctx->peer_rec[i] = rec != 0 ? rec : probe_record(run.ep, ring_peer(g, i), d->tag_key, g.c, d->instance);
          }
        }
        start_ring(run, g, run.pos[3], run.pos[2]);
        g = ring_geometry(run, run.pos[0]);
        run.step = base + R_PRIMS;
        break;
      }
      case R_PRIMS: {
        const uint64_t total = g.nloops * g.nprims;
        while (run.pos[1] < total) {
          int w = ring_step(env, run, g);
          if (w != WAIT_OK) return stop_run(w);
        }
        run.step = base + R_DRAIN;
        break;
      }
      case R_DRAIN: {
        // Every slice we posted has been consumed: nobody writes into our
        // record for this instance any more.
        const uint64_t sent = run.pos[2], inst = d->instance;
        dfccl_chan_state *m = run.mine;
        int w = block_wait(env, run, g.next, [&]() -> int {
          return count_for(load_acquire(&m->send_credit), inst) >= sent ? 1 : 0;
        });
        if (w != WAIT_OK) return stop_run(w);
        run.step = base + R_FINISH;
        run.progressed = true;
        break;
      }
      case R_FINISH: {
        // Every peer has met every rank, this one included (R_MEET's mark),
        // or is past this instance: it published a later one, or its record
        // went to another tag (either only once it completed this one).
        const uint64_t inst = d->instance;
        int w = block_wait(env, run, kAnyPeer, [&]() -> int {
          for (uint32_t i = 0; i + 1 < g.n; ++i) {
            const uint64_t rec = peer_record(run, i, ring_peer(g, i));
            if (rec == 0) return 0;
            dfccl_chan_state *pc = record_chan(rec, g.c);
            if (count_for(load_acquire(&pc->phase1), inst) != 0) continue;
            if (load_relaxed(&ptr<dfccl_record_header>(rec)->key) != d->tag_key) continue;
            if (load_relaxed(&pc->instance) <= inst) return 0;
          }
          return 1;
        });
        if (w != WAIT_OK) return stop_run(w);
        run.step = base + R_DONE;
        run.progressed = true;
        break;
      }
      default:
        return RUN_DONE;
    }
  }
}

}  // namespace dfccl
