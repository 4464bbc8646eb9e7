// One lane of the proxy: a thread, its UCX worker, its connection to every
// remote peer, the messages it has in flight each way, and the UCX
// callbacks that complete them.
//
// The proxy runs as `lanes` threads, each with its own UCX worker and its
// own connection to every remote peer (one TCP stream per lane and peer
// over TCP: a stream's copies run on one core).  Lane l carries what the
// daemon blocks b with b % lanes == l post, so a channel (always run by one
// block) keeps one lane.
#pragma once

#include <stdint.h>

#include <atomic>
#include <deque>
#include <memory>
#include <thread>
#include <vector>

#include <ucp/api/ucp.h>

#include "wire.h"

namespace {

constexpr uint32_t kWindow = 16;  // header receives posted ahead, per peer
constexpr uint32_t kMaxLanes = 8;

// One operation UCX may complete later; `done` is set by its callback.  Its
// request is freed only once done (a receive freed early is dropped).
struct Op {
  std::atomic<int> done{0};
  ucs_status_t status = UCS_OK;
  void *req = nullptr;
  ~Op() {
    if (req != nullptr) ucp_request_free(req);
  }
};

// A message being received from one peer, applied when it and every
// earlier one are complete.
struct Proxy;
struct Incoming {
  Wire wire;                    // received here; its bytes only when msg.inlined
  Msg &msg = wire.msg;
  std::vector<uint64_t> lines;  // MSG_LINES not inlined: the lines until applied
  uint64_t header_len = 0;      // bytes the header's message had
  Op header, payload;
  bool payload_posted = false;
  Proxy *proxy = nullptr;
  struct Lane *lane = nullptr;
  uint32_t peer = 0;
  uint64_t seq = 0;
};

// A message being sent: the header, and the bytes it carries, live here
// until UCX is done with it.
struct Outgoing {
  Wire wire;
  Msg &msg = wire.msg;
  Op header, payload;
  bool has_payload = false;
};

// One lane's connection to one peer, as its error handler sees it: the
// handler runs inside the lane's worker progress, before that pass's
// messages are applied, so it only notes the failure and the lane judges
// it after applying them (Proxy::check_connections).
struct Connection {
  std::atomic<bool> failed{false};
  ucs_status_t status = UCS_OK;
};

// One lane's side of a connection to a peer.
struct LanePeer {
  ucp_ep_h ep = nullptr;
  std::unique_ptr<Connection> connection;  // its error handler's argument
  uint64_t send_seq = 0, recv_seq = 0;
  std::deque<std::unique_ptr<Incoming>> incoming;
};

// One thread, its UCX worker and its connections.  Only its thread touches
// it while the proxy runs.
struct Lane {
  uint32_t index = 0;
  ucp_worker_h worker = nullptr;
  std::vector<LanePeer> peers;
  std::deque<std::unique_ptr<Outgoing>> outgoing;
  std::thread thread;
  uint64_t pushed_status[kStatusWords] = {~0ull, ~0ull, ~0ull};
  // The hop trace: written by this lane's thread only, up to its capacity
  // (then no more: no wrap, so a reader never sees an event half written).
  std::vector<TraceEvent> trace;
  std::atomic<uint64_t> traced{0};
};

void on_op(void *request, ucs_status_t status, void *user) {
  Op *op = static_cast<Op *>(user);
  op->status = status;
  op->done.store(1, std::memory_order_release);
  (void)request;
}
void on_recv(void *request, ucs_status_t status, const ucp_tag_recv_info_t *, void *user) {
  on_op(request, status, user);
}
// Defined in receive.h: it posts the receive of the message's bytes.
void on_header(void *request, ucs_status_t status, const ucp_tag_recv_info_t *, void *user);

void err_handler(void *arg, ucp_ep_h, ucs_status_t status) {
  auto *c = static_cast<Connection *>(arg);
  c->status = status;
  c->failed.store(true, std::memory_order_release);
}

}  // namespace
