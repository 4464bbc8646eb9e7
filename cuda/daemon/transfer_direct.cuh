// The direct path: peers' buffers are addressable, so every rank reads its
// peers' inputs (and, for a two-shot all-reduce, their reduced segments) in
// place.  The only waits are per-tag flags, which is where preemption happens:
//
//   PUBLISH  this rank's buffers and signature            (no wait)
//   MEET     every peer's published instance              (wait per peer)
//   WORK1    reduce / copy what this rank owns
//   WAIT1    all peers finished WORK1   (two-shot all-reduce only)
//   WORK2    gather the peers' reduced segments (two-shot all-reduce only)
//   WAIT2    all peers finished reading this rank's buffers
//
// A rank completes only after WAIT2, so no peer touches its buffers or its
// record afterwards: the record can be reused and the buffers handed back.
//
// Staged (DFCCL_TASK_STAGED: peers in other processes, which cannot map this
// rank's buffers): PUBLISH first copies, on each channel, exactly the parts of
// the input that the peers' same channel will read into this rank's arena
// (which every peer maps), and publishes offsets there; a two-shot all-reduce
// also writes its reduced segment there for the peers' WORK2.  Peers read the
// copies, so this rank may write its output in place whenever it likes.
//
// A staged rank whose staging had no room for the copies got a FIFO instead
// (DFCCL_FIFO_NO_STAGE) and publishes that; every rank also publishes its
// staging as a ring FIFO.  After MEET every rank has seen every rank's word,
// so all of them take the same turn: if any rank could not stage, all run the
// collective as a ring (transfer_ring.cuh, from R_ADOPT) through those FIFOs.
#pragma once

#include "transfer_common.cuh"

namespace dfccl {

enum DirectStep { D_PUBLISH = 0, D_MEET = 1, D_WORK1 = 2, D_WAIT1 = 3, D_WORK2 = 4, D_WAIT2 = 5, D_DONE = 6 };
// A staged collective that fell back to the ring runs ring step s as D_RING + s.
constexpr uint32_t D_RING = 8;

struct DirectGeometry {
  uint32_t n, r, c, nch, esize;
  uint64_t align;
};

DFCCL_DEV DirectGeometry direct_geometry(const TaskRun &run) {
  DirectGeometry g;
  g.n = run.ep->nranks;
  g.r = run.ep->rank;
  g.c = run.chan;
  g.nch = run.d->nchannels;
  g.esize = dtype_size(run.d->dtype);
  g.align = pack_elems(g.esize);
  return g;
}

DFCCL_DEV bool staged(const TaskRun &run) { return (run.d->flags & DFCCL_TASK_STAGED) != 0; }

// A direct all-reduce runs in one phase when it is small (the host's
// ONE_SHOT flag, equal on every rank) and no rank is in place: a rank that
// writes its output over its input would overwrite what peers still read.
// Whether any rank is in place is learnt while meeting them (pos[1]); staged
// ranks publish as out of place (peers read their copies).
DFCCL_DEV bool two_shot(const TaskRun &run) {
  return run.d->kind == DFCCL_ALL_REDUCE && ((run.d->flags & DFCCL_TASK_ONE_SHOT) == 0 || run.pos[1] != 0);
}

// Staged: offsets in this rank's arena of the input copy and of the output
// copy (two-shot all-reduce); the host sized the staging the same way
// (planning.py, staged_bytes).
DFCCL_DEV uint64_t stage_in_offset(const TaskRun &run) {
  return run.d->fifo_offset & DFCCL_FIFO_OFFSET_MASK & ~DFCCL_FIFO_FLAG_MASK;
}
DFCCL_DEV bool has_stage(const TaskRun &run) { return (run.d->fifo_offset & DFCCL_FIFO_NO_STAGE) == 0; }
DFCCL_DEV uint64_t stage_out_offset(const TaskRun &run, const DirectGeometry &g) {
  const uint64_t in_elems = run.d->kind == DFCCL_REDUCE_SCATTER ? (uint64_t)g.n * run.d->count : run.d->count;
  return stage_in_offset(run) + round_up(in_elems * g.esize, 256);
}
DFCCL_DEV uint64_t own_arena(const TaskRun &run) { return run.ep->peer_arena[run.ep->rank]; }

// Staged: a word rank p published, as an address here: an offset in its
// arena, or (DFCCL_REG_BIT) a registered allocation's slot and an offset in it.
DFCCL_DEV uint64_t staged_address(const TaskRun &run, uint32_t p, uint64_t word) {
  if ((word & DFCCL_REG_BIT) == 0) return run.ep->peer_arena[p] + word;
  const uint64_t slot = (word & ~DFCCL_REG_BIT) >> DFCCL_REG_SLOT_SHIFT;
  const uint64_t *table = reinterpret_cast<const uint64_t *>(run.ep->reg_table);
  return table[(uint64_t)p * DFCCL_REG_SLOTS + slot] + (word & DFCCL_REG_OFFSET_MASK);
}
DFCCL_DEV bool send_registered(const TaskRun &run) { return (run.d->flags & DFCCL_TASK_SEND_REGISTERED) != 0; }

// The leader: input / output address of rank p (this rank's from its descriptor,
// a peer's from the record it published).
DFCCL_DEV uint64_t rank_buffer(const TaskRun &run, const DirectGeometry &g, uint32_t p, bool output) {
  if (p == g.r) return output ? run.d->recv_addr : run.d->send_addr;
  uint32_t index = peer_index(g.r, g.n, p);
  if (index < DFCCL_PEER_CACHE && run.ctx->peer_rec[index] != 0) {
    const uint64_t a = output ? run.ctx->peer_recv[index] : run.ctx->peer_send[index];
    return staged(run) ? staged_address(run, p, a) : a;
  }
  dfccl_chan_state *pc = record_chan(peer_record(run, index, p), g.c);
  const uint64_t a = load_relaxed(output ? &pc->recv_addr : &pc->send_addr);
  return staged(run) ? staged_address(run, p, a) : a;
}

// Our output at dst_off = op over all ranks of their input at src_off; with
// `copy_base` (nonzero), also written at copy_base + dst_off.
DFCCL_DEV void reduce_all_inputs(BlockEnv &env, const TaskRun &run, const DirectGeometry &g, uint64_t src_off,
                                 uint64_t dst_off, uint64_t nelem, uint64_t copy_base = 0) {
  if (is_leader()) {
    for (uint32_t p = 0; p < g.n; ++p) env.sm->srcs[p] = rank_buffer(run, g, p, false) + src_off * g.esize;
    env.sm->dsts[0] = run.d->recv_addr + dst_off * g.esize;
    env.sm->dsts[1] = copy_base + dst_off * g.esize;
  }
  move_data(env, run, g.n, copy_base != 0 ? 2 : 1, nelem, run.d->op == DFCCL_AVG ? g.n : 1);
}

DFCCL_DEV void copy_from(BlockEnv &env, const TaskRun &run, const DirectGeometry &g, uint32_t p, bool from_output,
                         uint64_t src_off, uint64_t dst_off, uint64_t nelem) {
  if (is_leader()) {
    env.sm->srcs[0] = rank_buffer(run, g, p, from_output) + src_off * g.esize;
    env.sm->dsts[0] = run.d->recv_addr + dst_off * g.esize;
  }
  move_data(env, run, 1, 1, nelem, 1);
}

// WORK1: what this rank produces from the peers' inputs.
DFCCL_DEV void direct_work1(BlockEnv &env, const TaskRun &run, const DirectGeometry &g) {
  const dfccl_task_desc *d = run.d;
  switch (d->kind) {
    case DFCCL_ALL_REDUCE: {
      if (two_shot(run)) {
        Range seg = split(d->count, g.n, g.r, g.align);
        Range part = split(seg.len, g.nch, g.c, g.align);
        const uint64_t off = seg.off + part.off;
        // Staged: the reduced segment also goes to the copy peers read.
        reduce_all_inputs(env, run, g, off, off, part.len, staged(run) ? own_arena(run) + stage_out_offset(run, g) : 0);
      } else {
        Range part = split(d->count, g.nch, g.c, g.align);
        reduce_all_inputs(env, run, g, part.off, part.off, part.len);
      }
      break;
    }
    case DFCCL_REDUCE_SCATTER: {
      Range part = split(d->count, g.nch, g.c, g.align);
      reduce_all_inputs(env, run, g, (uint64_t)g.r * d->count + part.off, part.off, part.len);
      break;
    }
    case DFCCL_ALL_GATHER: {
      Range part = split(d->count, g.nch, g.c, g.align);
      const bool in_place = d->send_addr == d->recv_addr + (uint64_t)g.r * d->count * g.esize;
      for (uint32_t i = 0; i < g.n; ++i) {
        uint32_t p = (g.r + i) % g.n;
        if (p == g.r && in_place) continue;
        copy_from(env, run, g, p, false, part.off, (uint64_t)p * d->count + part.off, part.len);
      }
      break;
    }
    case DFCCL_BROADCAST: {
      Range part = split(d->count, g.nch, g.c, g.align);
      if (g.r != d->root || d->send_addr != d->recv_addr) copy_from(env, run, g, d->root, false, part.off, part.off, part.len);
      break;
    }
    default: {  // DFCCL_REDUCE
      Range part = split(d->count, g.nch, g.c, g.align);
      if (g.r == d->root) reduce_all_inputs(env, run, g, part.off, part.off, part.len);
      break;
    }
  }
}

// WORK2 (two-shot all-reduce): copy every peer's reduced segment.
DFCCL_DEV void direct_work2(BlockEnv &env, const TaskRun &run, const DirectGeometry &g) {
  for (uint32_t i = 1; i < g.n; ++i) {
    uint32_t p = (g.r + i) % g.n;
    Range seg = split(run.d->count, g.n, p, g.align);
    Range part = split(seg.len, g.nch, g.c, g.align);
    copy_from(env, run, g, p, true, seg.off + part.off, seg.off + part.off, part.len);
  }
}

// Staged PUBLISH: copy [off, off + len) of this rank's input to its arena copy.
DFCCL_DEV void stage_part(BlockEnv &env, const TaskRun &run, const DirectGeometry &g, uint64_t off, uint64_t len) {
  if (len == 0) return;
  if (is_leader()) {
    env.sm->srcs[0] = run.d->send_addr + off * g.esize;
    env.sm->dsts[0] = own_arena(run) + stage_in_offset(run) + off * g.esize;
  }
  move_data(env, run, 1, 1, len, 1);
}

// Staged PUBLISH: what the peers' channel g.c will read of this rank's input.
DFCCL_DEV void stage_input(BlockEnv &env, const TaskRun &run, const DirectGeometry &g) {
  const dfccl_task_desc *d = run.d;
  const Range part = split(d->count, g.nch, g.c, g.align);
  switch (d->kind) {
    case DFCCL_ALL_REDUCE:
      if ((d->flags & DFCCL_TASK_ONE_SHOT) != 0) {
        stage_part(env, run, g, part.off, part.len);
      } else {
        for (uint32_t p = 0; p < g.n; ++p) {
          if (p == g.r) continue;
          Range seg = split(d->count, g.n, p, g.align);
          Range sp = split(seg.len, g.nch, g.c, g.align);
          stage_part(env, run, g, seg.off + sp.off, sp.len);
        }
      }
      break;
    case DFCCL_REDUCE_SCATTER:
      for (uint32_t p = 0; p < g.n; ++p)
        if (p != g.r) stage_part(env, run, g, (uint64_t)p * d->count + part.off, part.len);
      break;
    case DFCCL_ALL_GATHER:
      stage_part(env, run, g, part.off, part.len);
      break;
    case DFCCL_BROADCAST:
      if (g.r == d->root) stage_part(env, run, g, part.off, part.len);
      break;
    default:  // DFCCL_REDUCE
      if (g.r != d->root) stage_part(env, run, g, part.off, part.len);
      break;
  }
  release_fence();  // the copies before `ready`
}

// Leader, after release_fence() (which makes these relaxed adds release the
// phase's writes): tell every peer this phase is done.
DFCCL_DEV void signal_peers(const TaskRun &run, const DirectGeometry &g, bool phase1) {
  if (!is_leader()) return;
  for (uint32_t i = 0; i + 1 < g.n; ++i) {
    uint32_t p = peer_at(g.r, g.n, i);
    dfccl_chan_state *pc = record_chan(peer_record(run, i, p), g.c);
    red_add_relaxed(phase1 ? &pc->phase1 : &pc->phase2, 1);
  }
}

DFCCL_DEV int wait_phase(BlockEnv &env, TaskRun &run, const DirectGeometry &g, bool phase1) {
  uint64_t *counter = phase1 ? &run.mine->phase1 : &run.mine->phase2;
  const uint64_t need = g.n - 1;
  return block_wait(env, run, kAnyPeer, [&]() -> int { return load_acquire(counter) >= need ? 1 : 0; });
}

DFCCL_DEV int run_direct(BlockEnv &env, TaskRun &run) {
  const DirectGeometry g = direct_geometry(run);
  for (;;) {
    switch (run.step) {
      case D_PUBLISH:
        if (staged(run)) {
          // pos[3]: the smallest FIFO slot of the ranks met (the fallback
          // ring's slice); pos[2]: the next rank's word.
          const uint64_t ring = own_fifo_word(run, g.c);
          run.pos[2] = 0;
          run.pos[3] = fifo_shape(run.d, run.d->fifo_offset).slot_bytes;
          if (!has_stage(run)) {
            publish_instance(run, ring | DFCCL_FIFO_NO_STAGE, 0, 0);
            run.pos[1] = DFCCL_FIFO_NO_STAGE;
          } else if (send_registered(run)) {
            // Peers read the input itself: in place counts, as on the direct path.
            const uint64_t in_place = run.d->send_addr == run.d->recv_addr ? DFCCL_FIFO_IN_PLACE : 0;
            publish_instance(run, ring | in_place, run.d->send_reg, stage_out_offset(run, g));
            run.pos[1] = in_place;
          } else {
            stage_input(env, run, g);
            publish_instance(run, ring, stage_in_offset(run), stage_out_offset(run, g));
            run.pos[1] = 0;
          }
        } else {
          publish_instance(run, run.d->send_addr == run.d->recv_addr ? 1 : 0, run.d->send_addr, run.d->recv_addr);
          run.pos[1] = run.d->send_addr == run.d->recv_addr ? 1 : 0;
        }
        run.pos[0] = 0;
        run.step = D_MEET;
        run.progressed = true;
        break;
      case D_MEET:
        while (run.pos[0] + 1 < g.n) {
          uint32_t i = (uint32_t)run.pos[0];
          uint64_t word = 0;
          int w = meet_peer(env, run, peer_at(g.r, g.n, i), i, &word);
          if (w != WAIT_OK) return stop_run(w);
          word = from_leader(word);
          run.pos[1] |= word & DFCCL_FIFO_FLAG_MASK;
          if (staged(run)) {
            const uint64_t slot_bytes = fifo_shape(run.d, word).slot_bytes;
            if (slot_bytes < run.pos[3]) run.pos[3] = slot_bytes;
            if (i == 0) run.pos[2] = word;
          }
          run.pos[0] += 1;
          run.progressed = true;
        }
        if (run.pos[1] & DFCCL_FIFO_NO_STAGE) {
          run.step = D_RING + R_ADOPT;
          return RUN_DONE;  // with this step, run_transfer goes on in the ring
        }
        run.step = D_WORK1;
        break;
      case D_WORK1:
        direct_work1(env, run, g);
        release_fence();
        signal_peers(run, g, two_shot(run));
        run.step = two_shot(run) ? D_WAIT1 : D_WAIT2;
        run.progressed = true;
        break;
      case D_WAIT1: {
        int w = wait_phase(env, run, g, true);
        if (w != WAIT_OK) return stop_run(w);
        run.step = D_WORK2;
        break;
      }
      case D_WORK2:
        direct_work2(env, run, g);
        release_fence();
        signal_peers(run, g, false);
        run.step = D_WAIT2;
        run.progressed = true;
        break;
      case D_WAIT2: {
        int w = wait_phase(env, run, g, false);
        if (w != WAIT_OK) return stop_run(w);
        run.step = D_DONE;
        run.progressed = true;
        break;
      }
      default:
        return RUN_DONE;
    }
  }
}

}  // namespace dfccl
