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
#pragma once

#include "transfer_common.cuh"

namespace dfccl {

enum RingStep { R_PUBLISH = 0, R_MEET = 1, R_PRIMS = 2, R_DRAIN = 3, R_DONE = 4 };

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
  uint64_t nloops;
  Range chan;        // this channel's part of [0, count)
  bool in_place;
};

struct Prim {
  uint32_t flags;
  uint64_t in_off, out_off, len;  // elements
};

DFCCL_DEV RingGeometry ring_geometry(const TaskRun &run) {
  const dfccl_task_desc *d = run.d;
  RingGeometry g;
  g.n = run.ep->nranks;
  g.r = run.ep->rank;
  g.c = run.chan;
  g.nch = d->nchannels;
  g.esize = dtype_size(d->dtype);
  g.align = pack_elems(g.esize);
  g.slice = d->slice_bytes / g.esize;
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

// This rank's receive FIFO on this channel: (slots << 48) | arena offset.
DFCCL_DEV uint64_t own_fifo_word(const TaskRun &run, uint32_t channel) {
  const uint64_t chan_bytes = (uint64_t)run.d->fifo_slots * run.d->slice_bytes;
  return ((uint64_t)run.d->fifo_slots << 48) | (run.d->fifo_offset + channel * chan_bytes);
}

DFCCL_DEV int ring_step(BlockEnv &env, TaskRun &run, const RingGeometry &g) {
  const dfccl_task_desc *d = run.d;
  const Prim p = ring_prim(g, d, run.pos[1]);
  const uint64_t sent = run.pos[2], recvd = run.pos[3];
  const uint64_t inst = d->instance;
  const uint32_t nbr_slots = run.ctx->nbr_slots;
  dfccl_chan_state *m = run.mine;
  int w = block_wait(env, run, (p.flags & P_RECV) ? g.prev : g.next, [&]() -> int {
    if ((p.flags & P_RECV) && count_for(load_acquire(&m->recv_posted), inst) < recvd + 1) return 0;
    if ((p.flags & P_SEND) && sent - count_for(load_acquire(&m->send_credit), inst) >= nbr_slots) return 0;
    return 1;
  });
  if (w != WAIT_OK) return w;

  uint32_t nsrcs = 0, ndsts = 0;
  if (is_leader()) {
    const uint64_t my_fifo = run.ep->peer_arena[g.r] + (own_fifo_word(run, g.c) & DFCCL_FIFO_OFFSET_MASK);
    if (p.flags & P_RECV) env.sm->srcs[nsrcs++] = my_fifo + (recvd % d->fifo_slots) * d->slice_bytes;
    if (p.flags & P_WITH_IN) env.sm->srcs[nsrcs++] = d->send_addr + p.in_off * g.esize;
    if (p.flags & P_OUT) env.sm->dsts[ndsts++] = d->recv_addr + p.out_off * g.esize;
    if (p.flags & P_SEND) env.sm->dsts[ndsts++] = run.ctx->nbr_fifo + (sent % nbr_slots) * d->slice_bytes;
  } else {
    nsrcs = ((p.flags & P_RECV) ? 1u : 0u) + ((p.flags & P_WITH_IN) ? 1u : 0u);
    ndsts = ((p.flags & P_OUT) ? 1u : 0u) + ((p.flags & P_SEND) ? 1u : 0u);
  }
  const uint32_t postdiv = ((p.flags & P_FINAL) && d->op == DFCCL_AVG) ? g.n : 1;
  move_data(env, run, nsrcs, ndsts, p.len, postdiv);
  release_fence();  // with it, the relaxed stores below release the slice
  if (is_leader()) {
    if (p.flags & P_RECV)
      store_relaxed(&record_chan(run.ctx->peer_rec[0], g.c)->send_credit, tagged_count(inst, recvd + 1));
    if (p.flags & P_SEND)
      store_relaxed(&record_chan(run.ctx->peer_rec[1], g.c)->recv_posted, tagged_count(inst, sent + 1));
  }
  run.pos[1] += 1;
  run.pos[2] += (p.flags & P_SEND) ? 1 : 0;
  run.pos[3] += (p.flags & P_RECV) ? 1 : 0;
  run.progressed = true;
  return WAIT_OK;
}

DFCCL_DEV int run_ring(BlockEnv &env, TaskRun &run) {
  const RingGeometry g = ring_geometry(run);
  const int kind = run.d->kind;
  for (;;) {
    switch (run.step) {
      case R_PUBLISH:
        publish_instance(run, own_fifo_word(run, g.c), run.d->send_addr, run.d->recv_addr);
        run.pos[0] = 0;
        run.step = R_MEET;
        run.progressed = true;
        break;
      case R_MEET: {
        // pos[0]: 0 = meet the previous rank next, 1 = the next rank, 2 = met.
        uint64_t word = 0;
        if (run.pos[0] == 0) {
          if (receives(g, kind)) {
            int w = meet_peer(env, run, g.prev, 0, &word);
            if (w != WAIT_OK) return stop_run(w);
          }
          run.pos[0] = 1;
        }
        if (run.pos[0] == 1) {
          if (sends(g, kind)) {
            int w = meet_peer(env, run, g.next, 1, &word);
            if (w != WAIT_OK) return stop_run(w);
            if (is_leader()) {
              run.ctx->nbr_slots = (uint32_t)(word >> 48);
              run.ctx->nbr_fifo = run.ep->peer_arena[g.next] + (word & DFCCL_FIFO_OFFSET_MASK);
            }
          }
          run.pos[0] = 2;
        }
        run.step = R_PRIMS;
        run.progressed = true;
        break;
      }
      case R_PRIMS: {
        const uint64_t total = g.nloops * g.nprims;
        while (run.pos[1] < total) {
          int w = ring_step(env, run, g);
          if (w != WAIT_OK) return stop_run(w);
        }
        run.step = R_DRAIN;
        break;
      }
      case R_DRAIN: {
        // Every slice we posted has been consumed: nobody writes into our
        // record for this instance any more.
        const uint64_t sent = run.pos[2], inst = run.d->instance;
        dfccl_chan_state *m = run.mine;
        int w = block_wait(env, run, g.next, [&]() -> int {
          return count_for(load_acquire(&m->send_credit), inst) >= sent ? 1 : 0;
        });
        if (w != WAIT_OK) return stop_run(w);
        run.step = R_DONE;
        run.progressed = true;
        break;
      }
      default:
        return RUN_DONE;
    }
  }
}

}  // namespace dfccl
