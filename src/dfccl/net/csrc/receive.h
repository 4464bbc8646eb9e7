// The proxy's receiving path, on one lane: receives posted ahead for each
// peer's next messages, their bytes received once the header is in, and
// each message applied to the arena or the peer's mirror in the order the
// peer sent it; then the lane's connections that failed, and what is left
// on the worker at close.
//
// Within a lane, messages from one peer are applied strictly in the order
// it sent them (a word never overtakes the slice posted before it): every
// message carries the sender's sequence number on that lane in its tag,
// receives are posted for exact sequence numbers, and a completed message
// is applied only after all earlier ones were.  What one block posts thus
// lands in order, as with one thread; entries of different blocks were
// never ordered (one thread drained the queues one after the other).
// Every lane pushes the rank's status, and a peer's state changes in its
// mirror only once every lane brought it: a rank seen leaving has nothing
// of its own in flight on any lane.
#pragma once

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include <ucp/api/ucp.h>

#include "dfccl/abi.h"
#include "dfccl/net.h"
#include "lane.h"
#include "proxy.h"
#include "wire.h"

namespace {

inline void Proxy::post_headers(Lane &l, uint32_t p) {
  LanePeer &peer = l.peers[p];
  while (peer.incoming.size() < kWindow && !peers[p].lost.load()) {
    std::unique_ptr<Incoming> in(new Incoming());
    Incoming *raw = in.get();
    raw->proxy = this;
    raw->lane = &l;
    raw->peer = p;
    raw->seq = peer.recv_seq + peer.incoming.size();
    peer.incoming.push_back(std::move(in));
    if (!post_recv(l, p, &raw->wire, sizeof(Wire), make_tag(p, raw->seq, false), &raw->header, raw)) return;
  }
}

inline bool Proxy::post_recv(Lane &l, uint32_t p, void *buf, size_t len, uint64_t tag, Op *op, Incoming *header_of) {
  ucp_request_param_t prm;
  memset(&prm, 0, sizeof(prm));
  prm.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  prm.cb.recv = header_of != nullptr ? on_header : on_recv;
  prm.user_data = header_of != nullptr ? static_cast<void *>(header_of) : static_cast<void *>(op);
  ucp_tag_recv_info_t info;  // filled where the receive completes at once (no callback then)
  if (header_of != nullptr) {
    prm.op_attr_mask |= UCP_OP_ATTR_FIELD_RECV_INFO;
    prm.recv_info.tag_info = &info;
  }
  ucs_status_ptr_t r = ucp_tag_recv_nbx(l.worker, buf, len, tag, ~0ull, &prm);
  if (r == nullptr) {
    if (header_of != nullptr) header_of->header_len = info.length;
    op->done.store(1);
    return true;
  }
  if (UCS_PTR_IS_ERR(r)) {
    fail_peer(p, "receive", UCS_PTR_STATUS(r));
    op->status = UCS_PTR_STATUS(r);
    op->done.store(1);
    return false;
  }
  op->req = r;
  return true;
}

void on_header(void *request, ucs_status_t status, const ucp_tag_recv_info_t *info, void *user) {
  Incoming *in = static_cast<Incoming *>(user);
  if (status == UCS_OK && info != nullptr) in->header_len = info->length;
  on_op(request, status, &in->header);
  in->proxy->post_payload(in);
}

// A message's bytes are received once its header is in, straight into
// the arena or the mirror (any order: the tags are exact).  Called from
// the header's completion, so that the bytes, which follow the header
// on the wire, find their receive posted instead of being buffered by
// UCX as unexpected and copied again; and from receive() for a header
// that completed at once.
inline void Proxy::post_payload(Incoming *in) {
  if (in->payload_posted || !in->header.done.load(std::memory_order_acquire)) return;
  in->payload_posted = true;
  const Msg &m = in->msg;
  if (in->header.status != UCS_OK || !carries_bytes(m.kind) || m.len == 0) {
    in->payload.done.store(1);
    return;
  }
  if (m.offset + m.len > arena_bytes || (m.kind == MSG_LINES && (m.len % 16 != 0 || m.offset % 16 != 0)) ||
      (m.inlined && in->header_len != sizeof(Msg) + m.len)) {
    in->payload.status = UCS_ERR_INVALID_PARAM;
    in->payload.done.store(1);
    return;
  }
  if (m.inlined) {  // the bytes came with the header
    in->payload.done.store(1);
    return;
  }
  if (stop.load(std::memory_order_acquire)) {
    // Closing: its receives are being cancelled, and this one would not be.
    in->payload.status = UCS_ERR_CANCELED;
    in->payload.done.store(1);
    return;
  }
  if (m.kind == MSG_LINES) {
    in->lines.resize(m.len / 8);
    post_recv(*in->lane, in->peer, in->lines.data(), m.len, make_tag(in->peer, in->seq, true), &in->payload);
    return;
  }
  post_recv(*in->lane, in->peer, landing(m, in->peer) + m.offset, m.len, make_tag(in->peer, in->seq, true),
            &in->payload);
}

inline bool Proxy::receive(Lane &l, uint32_t p) {
  LanePeer &peer = l.peers[p];
  bool any = false;
  for (auto &in : peer.incoming) post_payload(in.get());
  while (!peer.incoming.empty()) {
    Incoming *in = peer.incoming.front().get();
    if (!in->header.done.load(std::memory_order_acquire) || !in->payload.done.load(std::memory_order_acquire))
      break;
    if (in->header.status == UCS_OK && in->payload.status == UCS_OK) {
      apply(p, l, *in);
      note(l, TRACE_APPLIED, p, in->seq, in->msg);
      if (carries_bytes(in->msg.kind)) bytes_received.fetch_add(in->msg.len, std::memory_order_relaxed);
    } else {
      fail_peer(p, "receive", in->payload.status != UCS_OK ? in->payload.status : in->header.status);
    }
    peer.incoming.pop_front();
    peer.recv_seq += 1;
    any = true;
  }
  post_headers(l, p);
  return any;
}

inline void Proxy::apply(uint32_t p, const Lane &l, const Incoming &in) {
  const Msg &m = in.msg;
  if (m.kind == MSG_LINES) {
    // Any order: every 8-byte half carries its own flag.
    uint8_t *at = arena + m.offset;  // bounds checked when the header came in (post_payload)
    const uint8_t *from = m.inlined ? in.wire.bytes : reinterpret_cast<const uint8_t *>(in.lines.data());
    for (uint64_t i = 0; i < m.len; i += 8) {
      uint64_t half;
      memcpy(&half, from + i, 8);
      store_rlx(at + i, half);
    }
    return;
  }
  if (m.inlined && (m.kind == MSG_PUT || m.kind == MSG_SHARE))  // checked in post_payload, as the lines
    memcpy(landing(m, p) + m.offset, in.wire.bytes, m.len);
  if (m.kind == MSG_PUT) {
    if (m.word_offset != DFCCL_NET_NO_WORD && m.word_offset + 8 <= arena_bytes) {
      __atomic_thread_fence(__ATOMIC_RELEASE);  // the slice before the word
      store_rel(arena + m.word_offset, m.word);
    }
  } else if (m.kind == MSG_RECORD) {
    if (m.offset + sizeof(dfccl_chan_state) > arena_bytes || m.word_offset + 8 > arena_bytes) return;
    uint8_t *chan = peers[p].mirror + m.offset;
    const uint64_t *w = m.data + 1;
    // What the owner writes; the words peers write into the record
    // (posted, credit, phase2) are this rank's own business.
    const size_t fields[] = {offsetof(dfccl_chan_state, signature), offsetof(dfccl_chan_state, count),
                             offsetof(dfccl_chan_state, send_addr), offsetof(dfccl_chan_state, recv_addr),
                             offsetof(dfccl_chan_state, fifo),      offsetof(dfccl_chan_state, slice_bytes),
                             offsetof(dfccl_chan_state, phase1),    offsetof(dfccl_chan_state, instance),
                             offsetof(dfccl_chan_state, abort_info)};
    for (size_t f : fields) store_rlx(chan + f, w[f / 8]);
    store_rel(chan + offsetof(dfccl_chan_state, abort_token), w[offsetof(dfccl_chan_state, abort_token) / 8]);
    store_rel(peers[p].mirror + m.word_offset, m.data[0]);  // the header's key
    store_rel(chan + offsetof(dfccl_chan_state, ready), w[offsetof(dfccl_chan_state, ready) / 8]);
  } else if (m.kind == MSG_STATUS) {
    // The state once every lane brought it: then whatever the peer sent
    // on any lane before it has been applied.
    Peer &peer = peers[p];
    uint8_t *s = peer.mirror;
    std::lock_guard<std::mutex> hold(peer.mutex);
    peer.lane_state[l.index] = m.data[0];
    store_rlx(s + offsetof(dfccl_rank_status, heartbeat), m.data[1]);
    store_rlx(s + offsetof(dfccl_rank_status, pid), m.data[2]);
    bool agreed = true;
    for (size_t i = 0; i < lanes.size(); ++i) agreed &= peer.lane_state[i] == m.data[0];
    if (agreed) store_rel(s + offsetof(dfccl_rank_status, state), m.data[0]);
  }
}

// Lane l's failed connections, after what they brought was applied: a
// connection that fails after its lane brought the peer's leave is the
// peer closing it (its other lanes may still bring theirs); before, the
// peer is lost.
inline void Proxy::check_connections(Lane &l) {
  for (uint32_t p = 0; p < nranks; ++p) {
    Connection *c = l.peers[p].connection.get();
    if (c == nullptr || !c->failed.exchange(false, std::memory_order_acquire)) continue;
    uint64_t state;
    {
      std::lock_guard<std::mutex> hold(peers[p].mutex);
      state = peers[p].lane_state[l.index];
    }
    if (state == DFCCL_RANK_LIVE || state == ~0ull) fail_peer(p, "connection", c->status);
  }
}

// At close: what peers sent that nobody will receive now (their status
// pushes, say), taken off the worker so that it goes quietly.
inline void Proxy::drain_unexpected(Lane &l, uint64_t until) {
  std::vector<uint8_t> scratch;
  while (now_ns() < until) {
    ucp_tag_recv_info_t info;
    ucp_tag_message_h m = ucp_tag_probe_nb(l.worker, 0, 0, 1, &info);
    if (m == nullptr) break;
    scratch.resize(info.length ? info.length : 1);
    ucp_request_param_t prm;
    memset(&prm, 0, sizeof(prm));
    ucs_status_ptr_t r = ucp_tag_msg_recv_nbx(l.worker, scratch.data(), info.length, m, &prm);
    if (r == nullptr || UCS_PTR_IS_ERR(r)) continue;
    while (ucp_request_check_status(r) == UCS_INPROGRESS && now_ns() < until) ucp_worker_progress(l.worker);
    if (ucp_request_check_status(r) == UCS_INPROGRESS) ucp_request_cancel(l.worker, r);
    ucp_request_free(r);
  }
}

}  // namespace
