// Peers on other hosts: the daemon's side of the network proxy (dfccl/net.h,
// docs/multi-node.md).  A remote peer's arena is a mirror here: the daemon
// reads and writes it as if it were the peer's, and after each store the
// peer must see it posts an entry for the proxy.  Only the block's leader
// posts; a step that posts checks for room in the same wait that checks its
// peers, so a full queue is one more reason to wait (bounded, preemptible:
// the proxy drains it without waiting for any peer).
#pragma once

#include "wait.cuh"
#include "dfccl/net.h"

namespace dfccl {

DFCCL_DEV bool net_peer(const dfccl_endpoint *ep, uint32_t rank) {
  return rank < DFCCL_MAX_RANKS && ((ep->net_remote >> rank) & 1ull) != 0;
}
DFCCL_DEV bool net_endpoint(const dfccl_endpoint *ep) { return ep->net_queues != 0; }

DFCCL_DEV dfccl_net_queue *net_queue(const BlockEnv &env, const dfccl_endpoint *ep) {
  return ptr<dfccl_net_queue>(ep->net_queues + (uint64_t)env.block * sizeof(dfccl_net_queue));
}

// Leader: this block's queue, its cursors copied into the run.  The queue
// lives in host memory, so each read of it is a PCIe round trip on a GPU:
// the run keeps the tail it writes and the head it last saw (TaskRun::net,
// taken over from the block's last run where that was on the same queue)
// and reads the head again only when that copy says the queue is too full.
DFCCL_DEV dfccl_net_queue *net_cursor(const BlockEnv &env, TaskRun &run) {
  dfccl_net_queue *q = net_queue(env, run.ep);
  NetCursor &c = run.net;
  if (!c.valid || c.queues != run.ep->net_queues || c.comm_key != run.ep->comm_key) {
    c.queues = run.ep->net_queues;
    c.comm_key = run.ep->comm_key;
    c.tail = load_own(&q->tail);
    c.head = load_acquire(&q->head);
    c.valid = true;
  }
  return q;
}

// Leader: whether this block's queue holds `n` more entries (always, on a
// rank without remote peers).
DFCCL_DEV bool net_room(const BlockEnv &env, TaskRun &run, uint32_t n) {
  if (!net_endpoint(run.ep)) return true;
  NetCursor &c = run.net;
  dfccl_net_queue *q = net_cursor(env, run);
  if (c.tail + n - c.head <= DFCCL_NET_QUEUE_ENTRIES) return true;
  c.head = load_acquire(&q->head);  // acquire: the proxy took the entries before we overwrite them
  return c.tail + n - c.head <= DFCCL_NET_QUEUE_ENTRIES;
}

// Leader, with room checked: one entry.  What it names (a slice the movers
// wrote, a word) is ordered before it by the caller's release_fence().
DFCCL_DEV void net_post(const BlockEnv &env, TaskRun &run, uint32_t kind, uint32_t peer, uint64_t offset,
                        uint64_t len, uint64_t word_offset, uint64_t word) {
  dfccl_net_queue *q = net_cursor(env, run);
  NetCursor &c = run.net;
  const uint64_t t = c.tail;
  dfccl_net_entry *e = &q->entries[t & (DFCCL_NET_QUEUE_ENTRIES - 1)];
  e->kind = kind;
  e->peer = peer;
  e->offset = offset;
  e->len = len;
  e->word_offset = word_offset;
  e->word = word;
  store_release(&q->tail, t + 1);
  c.tail = t + 1;
}

// Leader: stores `v` into `word`, which lies in `rank`'s arena as mapped
// here; for a remote rank the proxy then carries it there, after the `len`
// bytes at `data` of the same arena (0: none).
DFCCL_DEV void net_store(const BlockEnv &env, TaskRun &run, uint32_t rank, uint64_t *word, uint64_t v,
                         uint64_t data = 0, uint64_t len = 0) {
  store_relaxed(word, v);
  if (!net_peer(run.ep, rank)) return;
  const uint64_t base = run.ep->peer_arena[rank];
  net_post(env, run, DFCCL_NET_PUT, rank, len != 0 ? data - base : 0, len, (uint64_t)word - base, v);
}

// Leader, with room checked: has the proxy copy `len` bytes at `data` of
// this rank's own arena to the same place of `rank`'s mirror of it (what
// that peer reads there besides the record).  Ordered before `data`'s
// readiness is published (a later record entry) like any entry.
DFCCL_DEV void net_share(const BlockEnv &env, TaskRun &run, uint32_t rank, uint64_t data, uint64_t len) {
  if (len == 0) return;
  const uint64_t base = run.ep->peer_arena[run.ep->rank];
  net_post(env, run, DFCCL_NET_SHARE, rank, data - base, len, DFCCL_NET_NO_WORD, 0);
}

// Leader, with room checked: has the proxy carry the `len` bytes of LL
// lines at `data` of remote `rank`'s mirror to the same place of its arena
// (NET_LINES: no word, the lines' flags say they are there).  Ordered after
// the lines by the caller's release_fence() like any entry.
DFCCL_DEV void net_lines(const BlockEnv &env, TaskRun &run, uint32_t rank, uint64_t data, uint64_t len) {
  const uint64_t base = run.ep->peer_arena[rank];
  net_post(env, run, DFCCL_NET_LINES, rank, data - base, len, DFCCL_NET_NO_WORD, 0);
}

// Remote peers of this rank (0 without any).
DFCCL_DEV uint32_t net_peers(const dfccl_endpoint *ep) {
  uint32_t n = 0;
  for (uint64_t m = ep->net_remote; m != 0; m &= m - 1) ++n;
  return n;
}

// Leader, with room checked: has the proxy copy what this rank published
// in its record (this channel) into every remote peer's mirror of it.
DFCCL_DEV void net_push_record(const BlockEnv &env, TaskRun &run) {
  if (!net_endpoint(run.ep)) return;
  const uint64_t base = run.ep->peer_arena[run.ep->rank];
  const uint64_t header = record_at(run.ep, run.ep->rank, run.d->bucket);
  net_post(env, run, DFCCL_NET_RECORD, run.ep->rank, (uint64_t)run.mine - base, 0, header - base, 0);
}

// Waits (bounded, preemptible) until the queue holds `n` more entries.
DFCCL_DEV int net_wait_room(BlockEnv &env, TaskRun &run, uint32_t n) {
  if (!net_endpoint(run.ep)) return WAIT_OK;
  return block_wait(env, run, run.ep->rank, [&]() -> int { return net_room(env, run, n) ? 1 : 0; });
}

}  // namespace dfccl
