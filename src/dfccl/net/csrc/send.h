// The proxy's sending path, on one lane: the daemon's net queue entries of
// the lane's blocks become messages to the peers, with this rank's status
// after them, each under the lane's next sequence number for its peer;
// and what UCX has finished sending is let go.
#pragma once

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <memory>
#include <utility>

#include <ucp/api/ucp.h>

#include "dfccl/abi.h"
#include "dfccl/net.h"
#include "lane.h"
#include "proxy.h"
#include "wire.h"

namespace {

// The queues of lane l's blocks.
inline bool Proxy::drain_queues(Lane &l) {
  bool any = false;
  for (uint32_t b = l.index; b < nqueues; b += (uint32_t)lanes.size()) {
    dfccl_net_queue *q = &queues[b];
    const uint64_t tail = load_acq(&q->tail);
    uint64_t head = load_rlx(&q->head);
    while (head != tail) {
      take(l, q->entries[head & (DFCCL_NET_QUEUE_ENTRIES - 1)]);
      ++head;
      store_rel(&q->head, head);
      any = true;
    }
  }
  return any;
}

// One queue entry from the daemon, sent on lane `l`.
inline void Proxy::take(Lane &l, const dfccl_net_entry &e) {
  if (e.kind == DFCCL_NET_PUT) {
    if (e.peer >= nranks || !peers[e.peer].remote) return;
    std::unique_ptr<Outgoing> out(new Outgoing());
    out->msg.kind = MSG_PUT;
    out->msg.offset = e.offset;
    out->msg.len = e.len;
    out->msg.word_offset = e.word_offset;
    out->msg.word = e.word;
    out->has_payload = e.len != 0;
    send(l, e.peer, std::move(out), peers[e.peer].mirror + e.offset);
  } else if (e.kind == DFCCL_NET_LINES || e.kind == DFCCL_NET_SHARE) {
    // Bytes without a word: LL lines the daemon wrote into its mirror of
    // the peer's arena, or bytes of this rank's own arena the peer reads
    // in its mirror of it.
    const bool share = e.kind == DFCCL_NET_SHARE;
    if (e.peer >= nranks || !peers[e.peer].remote || e.len == 0 || e.offset + e.len > arena_bytes) return;
    std::unique_ptr<Outgoing> out(new Outgoing());
    out->msg.kind = share ? MSG_SHARE : MSG_LINES;
    out->msg.offset = e.offset;
    out->msg.len = e.len;
    out->msg.word_offset = DFCCL_NET_NO_WORD;
    out->has_payload = true;
    send(l, e.peer, std::move(out), (share ? arena : peers[e.peer].mirror) + e.offset);
  } else if (e.kind == DFCCL_NET_RECORD) {
    // What the owner publishes, read now (the latest state: a later
    // entry for the same channel only brings newer values).
    Msg m;
    memset(&m, 0, sizeof(m));
    m.kind = MSG_RECORD;
    m.offset = e.offset;
    m.word_offset = e.word_offset;
    const uint8_t *chan = arena + e.offset;
    m.data[1] = load_acq(chan);  // ready first: the fields read after it are at least as new
    for (uint32_t i = 1; i < kChanWords; ++i) m.data[1 + i] = load_rlx(chan + 8 * i);
    m.data[0] = load_rlx(arena + e.word_offset);
    // Unused by the receiver (the channel carries it); in the hop trace
    // it names the instance this record publishes.
    m.word = m.data[1 + offsetof(dfccl_chan_state, instance) / 8];
    for (uint32_t p = 0; p < nranks; ++p) {
      if (!peers[p].remote) continue;
      std::unique_ptr<Outgoing> out(new Outgoing());
      out->msg = m;
      send(l, p, std::move(out), nullptr);
    }
  }
}

// On lane l, after what it took off its queues before.
inline bool Proxy::push_status(Lane &l, bool beat) {
  uint64_t s[kStatusWords];
  bool changed = false;
  for (uint32_t i = 0; i < kStatusWords; ++i) {
    s[i] = status[i].load(std::memory_order_acquire);
    changed |= s[i] != l.pushed_status[i];
  }
  if (!changed && !beat) return false;
  for (uint32_t i = 0; i < kStatusWords; ++i) l.pushed_status[i] = s[i];
  for (uint32_t p = 0; p < nranks; ++p) {
    if (!peers[p].remote) continue;
    std::unique_ptr<Outgoing> out(new Outgoing());
    memset(&out->msg, 0, sizeof(Msg));
    out->msg.kind = MSG_STATUS;
    for (uint32_t i = 0; i < kStatusWords; ++i) out->msg.data[i] = s[i];
    send(l, p, std::move(out), nullptr);
  }
  return true;
}

inline void Proxy::send(Lane &l, uint32_t p, std::unique_ptr<Outgoing> out, const void *payload) {
  if (peers[p].lost.load()) return;
  const uint64_t seq = l.peers[p].send_seq++;
  note(l, TRACE_SENT, p, seq, out->msg);
  const bool inlined = out->has_payload && out->msg.len <= inline_bytes;
  if (inlined) {
    memcpy(out->wire.bytes, payload, out->msg.len);
    out->msg.inlined = 1;
  }
  send_part(l, p, &out->wire, sizeof(Msg) + (inlined ? out->msg.len : 0), make_tag(rank, seq, false),
            &out->header);
  if (out->has_payload && !inlined) {
    send_part(l, p, payload, out->msg.len, make_tag(rank, seq, true), &out->payload);
  } else {
    out->payload.done.store(1);
  }
  if (out->has_payload) bytes_sent.fetch_add(out->msg.len, std::memory_order_relaxed);
  messages.fetch_add(1, std::memory_order_relaxed);
  l.outgoing.push_back(std::move(out));
}

inline bool Proxy::send_part(Lane &l, uint32_t p, const void *buf, size_t len, uint64_t tag, Op *op) {
  ucp_request_param_t prm;
  memset(&prm, 0, sizeof(prm));
  prm.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  prm.cb.send = on_op;
  prm.user_data = op;
  ucs_status_ptr_t r = timed(l, CALL_SEND, [&] { return ucp_tag_send_nbx(l.peers[p].ep, buf, len, tag, &prm); });
  if (r == nullptr) {
    op->done.store(1);
    return true;
  }
  if (UCS_PTR_IS_ERR(r)) {
    fail_peer(p, "send", UCS_PTR_STATUS(r));
    op->done.store(1);
    return false;
  }
  op->req = r;
  return true;
}

inline void Proxy::reap_sent(Lane &l) {
  while (!l.outgoing.empty()) {
    Outgoing *o = l.outgoing.front().get();
    if (!o->header.done.load(std::memory_order_acquire) || !o->payload.done.load(std::memory_order_acquire)) break;
    l.outgoing.pop_front();
  }
}

}  // namespace
