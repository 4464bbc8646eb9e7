// CUDA graphs (docs/architecture.md, "CUDA graphs"): the device side of a
// collective captured in a graph.
//
// At capture the host binds the collective once: a tag of its own, its
// record and staging, a completion slot, and the descriptor, which it
// captures as the parameters of an arm node (dfccl_graph_arm) followed by a
// wait on the slot's completion word.  Every replay runs the arm node, one
// thread (the dfccl_graph_arm_node kernel on a GPU, a stream operation in the
// simulator), which pushes the next instance of that tag:
//   - zeroes the slot's completion word (host-mapped), which the captured
//     wait then waits on (cuStreamWaitValue32 AND DFCCL_GRAPH_GEN_BIT);
//   - counts the replay in graph_count[slot], a seqlock word (binding << 32
//     | replays, DFCCL_GRAPH_WRITING while the descriptor is rewritten), and
//     writes the replay's descriptor: instance = the bound one + replays - 1,
//     gen = DFCCL_GRAPH_GEN_BIT | replays;
//   - counts it in graph_pending (the daemon does not leave while a replay is
//     pending: its graph's stream waits for it), sets the slot's bit in
//     graph_mask and bumps graph_seq, which the blocks watch, and the host's
//     graph_arms, which the host watches to relaunch a daemon that left.
// Every rank replays its graph as often as its peers, so the k-th replay
// meets the k-th replay everywhere; the replays of different captured
// collectives are different tags and, as eager ones, meet in any order.
#pragma once

#include "block_env.cuh"

namespace dfccl {

constexpr uint64_t kGraphWriting = 1ull << 31;  // graph_count: a descriptor is being rewritten

DFCCL_DEV uint32_t graph_replays(uint64_t count) { return (uint32_t)count & ~(uint32_t)kGraphWriting; }

// The arm node: one thread.  A slot out of range is never bound by the host;
// it is ignored (the replay's wait then never passes: no memory is touched).
DFCCL_DEV void graph_arm(const dfccl_daemon_args *a, const dfccl_graph_arm *arm) {
  const uint32_t slot = arm->desc.slot;
  if (slot >= a->nslots) return;
  store_relaxed(&a->done[slot], 0u);
  uint64_t *count = &a->graph_count[slot];
  uint64_t seen = load_gpu(count), next;
  for (;;) {
    const uint32_t replays = (seen >> 32) == arm->binding ? graph_replays(seen) + 1u : 1u;
    next = (arm->binding << 32) | (replays & ~(uint32_t)kGraphWriting);
    const uint64_t old = cas_relaxed(count, seen, next | kGraphWriting);
    if (old == seen) break;
    seen = old;
  }
  fence_gpu();  // the writing mark before the descriptor
  dfccl_task_desc d = arm->desc;
  d.instance = arm->desc.instance + graph_replays(next) - 1u;
  d.gen = DFCCL_GRAPH_GEN_BIT | graph_replays(next);
  a->graph_desc[slot] = d;
  fence_gpu();  // the descriptor before the count that vouches for it
  store_gpu(count, next);
  atomic_add(&a->state->graph_pending, 1ull);
  fence_system();  // the descriptor, the count and the zeroed word before the bit
  atomic_or_local(&a->graph_mask[slot / 32], 1u << (slot % 32));
  const uint64_t seq = atomic_add(&a->state->graph_seq, 1ull) + 1ull;
  store_relaxed(&a->control->graph_arms, seq);
}

// The leader, pulling: the replay armed in `slot` (seqlock read), into
// `words`.  False while the arm node is still writing it (its graph_seq bump
// follows, and with it another scan).
DFCCL_DEV bool graph_read(const dfccl_daemon_args *a, uint32_t slot, pack16 *words) {
  const uint64_t before = load_gpu(&a->graph_count[slot]);
  fence_gpu();
  const pack16 *src = reinterpret_cast<const pack16 *>(&a->graph_desc[slot]);
  for (int w = 0; w < (int)(sizeof(dfccl_task_desc) / 16); ++w) words[w] = load_pack_early(src + w);
  fence_gpu();
  const uint64_t after = load_gpu(&a->graph_count[slot]);
  const dfccl_task_desc *d = reinterpret_cast<const dfccl_task_desc *>(words);
  return before == after && (before & kGraphWriting) == 0 && d->gen == (DFCCL_GRAPH_GEN_BIT | graph_replays(before));
}

// The leader finishing a replay (or block 0 rejecting one), before its
// completion word: the replay is no longer pending.  The bit is cleared
// before the word is published, since the next replay may set it as soon as
// the word is.
DFCCL_DEV void graph_retire(const dfccl_daemon_args *a, const dfccl_task_desc *d) {
  if (!(d->flags & DFCCL_TASK_GRAPH)) return;
  atomic_and_local(&a->graph_mask[d->slot / 32], ~(1u << (d->slot % 32)));
  atomic_add(&a->state->graph_pending, ~0ull);
}

// After the completion word: a failed replay is flagged to the host (whose
// next call raises it).  After, not before: the host clears the flag and
// then reads the completion words, so a flag set before a word it did not
// see yet could be cleared and lost with a second failure in between.
// Release: a host that sees the flag sees the word.
DFCCL_DEV void graph_flag_failure(const dfccl_daemon_args *a, const dfccl_task_desc *d, uint32_t status) {
  if (!(d->flags & DFCCL_TASK_GRAPH) || status == DFCCL_STATUS_OK) return;
  store_release(&a->control->graph_failed, (uint64_t)d->slot + 1u);
}

}  // namespace dfccl
