// The network proxy of one communicator rank (docs/multi-node.md): native
// threads that never take the GIL.  It drains the rank's net queues (one per
// daemon block, dfccl/net.h) into UCX tagged messages to the remote peers,
// and lands what the peers send: slices and words into this rank's arena,
// their published records and rank status into its mirrors of their arenas.
//
// The proxy runs as `lanes` threads, each with its own UCX worker and its
// own connection to every remote peer (one TCP stream per lane and peer
// over TCP: a stream's copies run on one core).  Lane l carries what the
// daemon blocks b with b % lanes == l post, so a channel (always run by one
// block) keeps one lane.  Within a
// lane, messages from one peer are applied strictly in the order it sent
// them (a word never overtakes the slice posted before it): every message
// carries the sender's sequence number on that lane in its tag, receives
// are posted for exact sequence numbers, and a completed message is
// applied only after all earlier ones were.  What one block posts thus
// lands in order, as with one thread; entries of different blocks were
// never ordered (one thread drained the queues one after the other).
// Every lane pushes the rank's status, and a peer's state changes in its
// mirror only once every lane brought it: a rank seen leaving has nothing
// of its own in flight on any lane.
//
// A message is a fixed-size header, then its bytes
// (a put's, a share's or LL lines): up to the inline limit inside the
// header's own message (one message, not two; copied in when applied),
// more as a second message under the same sequence number, received
// straight into the arena (a put) or the mirror of the sender's arena (a
// share).  LL lines are never received into the arena: they are stored
// there 8 bytes at a time when applied, so that a daemon polling them reads
// each line's {data, flag} halves whole, which a copy of unknown
// granularity into the arena would not promise.
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <sched.h>
#include <time.h>

#include <atomic>
#include <deque>
#include <algorithm>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <ucp/api/ucp.h>

#include "dfccl/abi.h"
#include "dfccl/host_signals.h"
#include "dfccl/layout.h"
#include "dfccl/net.h"

namespace {

enum MsgKind : uint32_t { MSG_PUT = 1, MSG_RECORD = 2, MSG_STATUS = 3, MSG_SHARE = 4, MSG_LINES = 5 };

constexpr uint32_t kChanWords = sizeof(dfccl_chan_state) / 8;
constexpr uint32_t kStatusWords = 3;  // state, heartbeat, pid (dfccl_rank_status)
constexpr uint32_t kWindow = 16;      // header receives posted ahead, per peer
constexpr uint64_t kPayloadBit = 1ull << 63;
constexpr uint64_t kSeqMask = (1ull << 48) - 1;
constexpr uint32_t kMaxLanes = 8;
// Most bytes a message carries inside its header's message; the proxy's
// limit (DFCCL_NET_INLINE_BYTES, default all of it) may be lower.  Over TCP
// a second message costs the peer a receive posted once the header is in
// and both proxies a pass; copying a few KiB costs less.  Covers the lines
// of an LL piece up to ll_max_bytes's default (4 KiB: 8,224 bytes with the
// header lines) and ring slices up to as much.
constexpr uint64_t kInlineCapacity = DFCCL_LL_AREA_BYTES(DFCCL_LL_DEFAULT_MAX_BYTES);

struct Msg {
  uint32_t kind, inlined;         // inlined: the bytes follow the header in its message
  uint64_t offset, len, word_offset, word;
  uint64_t data[1 + kChanWords];  // RECORD: the header's key, then the channel; STATUS: its words
};

// A header as it travels: the message, then the bytes it carries inline.
struct Wire {
  Msg msg;
  uint8_t bytes[kInlineCapacity];
};

// One message as the hop trace keeps it (DFCCL_NET_TRACE, dfccl/net/hops.py):
// when this proxy sent it to `peer` or applied it from `peer`; or one call
// into UCX that took longer than kLongCallNs (nothing is taken off the
// daemon's queues or applied while it runs): its start, which call (`kind`)
// and, in `len`, its nanoseconds.  The Python side takes the layout and
// the codes from dfccl_net_trace_format().
enum TraceWhat : uint32_t { TRACE_SENT = 1, TRACE_APPLIED = 2, TRACE_BUSY = 3 };
enum TraceCall : uint32_t { CALL_WORKER_PASS = 1, CALL_SEND = 2 };
constexpr uint64_t kLongCallNs = 20000;
struct TraceEvent {
  uint64_t t_ns;   // CLOCK_MONOTONIC
  uint64_t seq;    // the message's sequence number from its sender
  uint64_t word;   // a put's word (a ring's posted or credit count); a record's instance
  uint64_t len;    // a put's, share's or lines' bytes
  uint32_t what, kind, peer, pad;
};
// The trace's `seq`: a lane's sequence number with the lane above it, so
// that (sender, receiver, seq) names one message across lanes.
uint64_t trace_seq(uint32_t lane, uint64_t seq) { return ((uint64_t)lane << 48) | (seq & kSeqMask); }

uint64_t make_tag(uint32_t sender, uint64_t seq, bool payload) {
  return (payload ? kPayloadBit : 0) | ((uint64_t)sender << 48) | (seq & kSeqMask);
}

uint64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

uint64_t load_acq(const void *p) { return __atomic_load_n((const uint64_t *)p, __ATOMIC_ACQUIRE); }
uint64_t load_rlx(const void *p) { return __atomic_load_n((const uint64_t *)p, __ATOMIC_RELAXED); }
void store_rel(void *p, uint64_t v) { __atomic_store_n((uint64_t *)p, v, __ATOMIC_RELEASE); }
void store_rlx(void *p, uint64_t v) { __atomic_store_n((uint64_t *)p, v, __ATOMIC_RELAXED); }

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

struct Peer {
  bool remote = false;
  uint8_t *mirror = nullptr;        // this rank's mirror of the peer's arena (host view)
  std::atomic<int> lost{0};
  std::string error;                // written once, before `lost`
  std::mutex mutex;                 // what the lanes share of the peer: `error`, the states below, the mirror's state word
  uint64_t lane_state[kMaxLanes];   // the state each lane last brought
  Peer() {
    for (auto &s : lane_state) s = ~0ull;
  }
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
void on_header(void *request, ucs_status_t status, const ucp_tag_recv_info_t *, void *user);

struct Proxy {
  uint32_t rank = 0, nranks = 0;
  uint8_t *arena = nullptr;          // this rank's arena (host view)
  uint64_t arena_bytes = 0;
  uint64_t inline_bytes = kInlineCapacity;
  dfccl_net_queue *queues = nullptr;
  uint32_t nqueues = 0;
  ucp_context_h context = nullptr;
  std::vector<std::unique_ptr<Lane>> lanes;
  std::vector<Peer> peers;
  bool started = false;
  std::atomic<int> stop{0};
  // This rank's status, as the host last set it (pushed on every lane when
  // it changes).
  std::atomic<uint64_t> status[kStatusWords];
  std::atomic<uint64_t> bytes_sent{0}, bytes_received{0}, messages{0};

  static bool tracing(const Lane &l) { return l.traced.load(std::memory_order_relaxed) < l.trace.size(); }

  void note_event(Lane &l, uint64_t t_ns, uint32_t what, uint32_t kind, uint32_t p, uint64_t seq, uint64_t word,
                  uint64_t len) {
    const uint64_t n = l.traced.load(std::memory_order_relaxed);
    if (n >= l.trace.size()) return;
    TraceEvent &e = l.trace[n];
    e.t_ns = t_ns;
    e.seq = seq;
    e.word = word;
    e.len = len;
    e.what = what;
    e.kind = kind;
    e.peer = p;
    e.pad = 0;
    l.traced.store(n + 1, std::memory_order_release);
  }

  void note(Lane &l, uint32_t what, uint32_t p, uint64_t seq, const Msg &m) {
    note_event(l, now_ns(), what, m.kind, p, trace_seq(l.index, seq), m.word, m.len);
  }

  // f(), a call into UCX; a long one goes into the trace.
  template <class F>
  auto timed(Lane &l, uint32_t call, F &&f) {
    if (!tracing(l)) return f();
    const uint64_t start = now_ns();
    auto r = f();
    const uint64_t took = now_ns() - start;
    if (took > kLongCallNs) note_event(l, start, TRACE_BUSY, call, nranks, 0, 0, took);
    return r;
  }

  bool progress(Lane &l) {
    return timed(l, CALL_WORKER_PASS, [&] { return ucp_worker_progress(l.worker) != 0; });
  }

  // Lane l's failed connections, after what they brought was applied: a
  // connection that fails after its lane brought the peer's leave is the
  // peer closing it (its other lanes may still bring theirs); before, the
  // peer is lost.
  void check_connections(Lane &l) {
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

  void fail_peer(uint32_t p, const char *what, ucs_status_t st) {
    Peer &peer = peers[p];
    std::lock_guard<std::mutex> hold(peer.mutex);
    if (peer.lost.load()) return;
    peer.error = std::string(what) + ": " + ucs_status_string(st);
    peer.lost.store(1, std::memory_order_release);
  }

  // ---- sending -------------------------------------------------------------
  bool send_part(Lane &l, uint32_t p, const void *buf, size_t len, uint64_t tag, Op *op) {
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

  void send(Lane &l, uint32_t p, std::unique_ptr<Outgoing> out, const void *payload) {
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

  static void reap_sent(Lane &l) {
    while (!l.outgoing.empty()) {
      Outgoing *o = l.outgoing.front().get();
      if (!o->header.done.load(std::memory_order_acquire) || !o->payload.done.load(std::memory_order_acquire)) break;
      l.outgoing.pop_front();
    }
  }

  // One queue entry from the daemon, sent on lane `l`.
  void take(Lane &l, const dfccl_net_entry &e) {
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
    } else if (e.kind == DFCCL_NET_LINES) {
      if (e.peer >= nranks || !peers[e.peer].remote || e.len == 0 || e.offset + e.len > arena_bytes) return;
      std::unique_ptr<Outgoing> out(new Outgoing());
      out->msg.kind = MSG_LINES;
      out->msg.offset = e.offset;
      out->msg.len = e.len;
      out->msg.word_offset = DFCCL_NET_NO_WORD;
      out->has_payload = true;
      send(l, e.peer, std::move(out), peers[e.peer].mirror + e.offset);
    } else if (e.kind == DFCCL_NET_SHARE) {
      if (e.peer >= nranks || !peers[e.peer].remote || e.len == 0 || e.offset + e.len > arena_bytes) return;
      std::unique_ptr<Outgoing> out(new Outgoing());
      out->msg.kind = MSG_SHARE;
      out->msg.offset = e.offset;
      out->msg.len = e.len;
      out->msg.word_offset = DFCCL_NET_NO_WORD;
      out->has_payload = true;
      send(l, e.peer, std::move(out), arena + e.offset);
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

  // The queues of lane l's blocks.
  bool drain_queues(Lane &l) {
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

  // On lane l, after what it took off its queues before.
  bool push_status(Lane &l, bool beat) {
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

  // ---- receiving -----------------------------------------------------------
  bool post_recv(Lane &l, uint32_t p, void *buf, size_t len, uint64_t tag, Op *op, Incoming *header_of = nullptr) {
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

  void post_headers(Lane &l, uint32_t p) {
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

  void apply(uint32_t p, const Lane &l, const Incoming &in) {
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
      memcpy((m.kind == MSG_PUT ? arena : peers[p].mirror) + m.offset, in.wire.bytes, m.len);
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

  // A message's bytes are received once its header is in, straight into
  // the arena or the mirror (any order: the tags are exact).  Called from
  // the header's completion, so that the bytes, which follow the header
  // on the wire, find their receive posted instead of being buffered by
  // UCX as unexpected and copied again; and from receive() for a header
  // that completed at once.
  void post_payload(Incoming *in) {
    if (in->payload_posted || !in->header.done.load(std::memory_order_acquire)) return;
    in->payload_posted = true;
    const Msg &m = in->msg;
    if (in->header.status != UCS_OK || (m.kind != MSG_PUT && m.kind != MSG_SHARE && m.kind != MSG_LINES) ||
        m.len == 0) {
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
    uint8_t *into = m.kind == MSG_PUT ? arena : peers[in->peer].mirror;
    post_recv(*in->lane, in->peer, into + m.offset, m.len, make_tag(in->peer, in->seq, true), &in->payload);
  }

  bool receive(Lane &l, uint32_t p) {
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
        if (in->msg.kind == MSG_PUT || in->msg.kind == MSG_SHARE || in->msg.kind == MSG_LINES)
          bytes_received.fetch_add(in->msg.len, std::memory_order_relaxed);
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

  // At close: what peers sent that nobody will receive now (their status
  // pushes, say), taken off the worker so that it goes quietly.
  static void drain_unexpected(Lane &l, uint64_t until) {
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

  void run(Lane &l) {
    uint64_t last_beat = now_ns(), last_busy = last_beat;
    while (!stop.load(std::memory_order_acquire)) {
      bool any = progress(l);
      any |= drain_queues(l);
      for (uint32_t p = 0; p < nranks; ++p)
        if (peers[p].remote && !peers[p].lost.load()) any |= receive(l, p);
      check_connections(l);
      const uint64_t now = now_ns();
      // A heartbeat every 50 ms whether or not the status changed, so that
      // a peer's silence means it is gone.
      const bool beat = now - last_beat > 50000000ull;
      if (beat) last_beat = now;
      any |= push_status(l, beat);
      reap_sent(l);
      // While traffic flows, only yield: a sleep costs a timer tick or more
      // on every hop, and a ring step waits for several hops.  After 2 ms
      // without any, sleep between polls.
      if (any) {
        last_busy = now;
      } else if (now - last_busy < 2000000ull) {
        sched_yield();
      } else {
        timespec ts = {0, 20000};
        nanosleep(&ts, nullptr);
      }
    }
  }
};

void on_header(void *request, ucs_status_t status, const ucp_tag_recv_info_t *info, void *user) {
  Incoming *in = static_cast<Incoming *>(user);
  if (status == UCS_OK && info != nullptr) in->header_len = info->length;
  on_op(request, status, &in->header);
  in->proxy->post_payload(in);
}

void err_handler(void *arg, ucp_ep_h, ucs_status_t status) {
  auto *c = static_cast<Connection *>(arg);
  c->status = status;
  c->failed.store(true, std::memory_order_release);
}

void set_error(char *err, size_t len, const std::string &what) {
  if (err != nullptr && len > 0) snprintf(err, len, "%s", what.c_str());
}

// UCX settings the proxy's traffic wants where the environment does not
// set them (UCX_<name> there wins).  A slice is one message of 4 KiB to
// 1 MiB sent by one thread, which TCP's default segments (8 KiB out, 64 KiB
// in) cut into many small copies and sends: a 256 KiB slice's send held
// the proxy ~200 us and moved ~1,000 MiB/s; with these, ~80 us and twice
// the bandwidth.  Rendezvous for slices (the send returns at once) moved
// 5-10% less on a GPU host, so UCX keeps choosing the protocol
// (docs/performance-log.md, section 45).
struct UcxDefault {
  const char *name, *value;
};
constexpr UcxDefault kUcxDefaults[] = {
    {"TCP_TX_SEG_SIZE", "64k"},
    {"TCP_RX_SEG_SIZE", "256k"},
};

bool ucx_env_sets(const char *name) {
  const std::string var = std::string("UCX_") + name;
  return getenv(var.c_str()) != nullptr;
}

}  // namespace

extern "C" {

size_t dfccl_net_queue_bytes(void) { return sizeof(dfccl_net_queue); }

// The UCX settings a proxy applies where UCX_<name> is not set, as
// "NAME=VALUE NAME=VALUE ...".
const char *dfccl_net_ucx_defaults(void) {
  static const std::string text = [] {
    std::string t;
    for (const auto &d : kUcxDefaults) t += (t.empty() ? "" : " ") + std::string(d.name) + "=" + d.value;
    return t;
  }();
  return text.c_str();
}

// The most lanes a proxy runs.
uint32_t dfccl_net_max_lanes(void) { return kMaxLanes; }

// A proxy of `lanes` threads (1..dfccl_net_max_lanes()) for this rank's
// arena and its `nqueues` net queues; nullptr with `err` set where UCX
// cannot start.
void *dfccl_net_create(uint32_t rank, uint32_t nranks, uint64_t arena, uint64_t arena_bytes, uint64_t queues,
                       uint32_t nqueues, uint32_t lanes, char *err, size_t errlen) {
  if (lanes == 0 || lanes > kMaxLanes) {
    set_error(err, errlen, "lanes must be in 1.." + std::to_string(kMaxLanes) + ", not " + std::to_string(lanes));
    return nullptr;
  }
  std::unique_ptr<Proxy> px(new Proxy());
  px->rank = rank;
  px->nranks = nranks;
  px->arena = reinterpret_cast<uint8_t *>(arena);
  px->arena_bytes = arena_bytes;
  px->queues = reinterpret_cast<dfccl_net_queue *>(queues);
  px->nqueues = nqueues;
  px->peers = std::vector<Peer>(nranks);
  for (auto &s : px->status) s.store(0);
  ucp_params_t params;
  memset(&params, 0, sizeof(params));
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_TAG;
  ucp_config_t *config = nullptr;
  ucs_status_t st = ucp_config_read(nullptr, nullptr, &config);
  if (st != UCS_OK) {
    set_error(err, errlen, std::string("ucp_config_read: ") + ucs_status_string(st));
    return nullptr;
  }
  for (const auto &d : kUcxDefaults) {
    if (ucx_env_sets(d.name)) continue;
    st = ucp_config_modify(config, d.name, d.value);
    // A UCX built without that transport has no such setting.
    if (st != UCS_OK && st != UCS_ERR_NO_ELEM) {
      ucp_config_release(config);
      set_error(err, errlen, std::string("ucp_config_modify(") + d.name + "=" + d.value + "): " + ucs_status_string(st));
      return nullptr;
    }
  }
  st = ucp_init(&params, config, &px->context);
  ucp_config_release(config);
  if (st != UCS_OK) {
    set_error(err, errlen, std::string("ucp_init: ") + ucs_status_string(st));
    return nullptr;
  }
  ucp_worker_params_t wp;
  memset(&wp, 0, sizeof(wp));
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;  // set up by the caller, then run by the lane's thread
  for (uint32_t i = 0; i < lanes; ++i) {
    std::unique_ptr<Lane> l(new Lane());
    l->index = i;
    l->peers = std::vector<LanePeer>(nranks);
    st = ucp_worker_create(px->context, &wp, &l->worker);
    if (st != UCS_OK) {
      for (auto &made : px->lanes) ucp_worker_destroy(made->worker);
      ucp_cleanup(px->context);
      set_error(err, errlen, std::string("ucp_worker_create: ") + ucs_status_string(st));
      return nullptr;
    }
    px->lanes.push_back(std::move(l));
  }
  return px.release();
}

// The most bytes a message can carry inside its header's message.
uint64_t dfccl_net_inline_capacity(void) { return kInlineCapacity; }

// Bytes up to `bytes` travel inline (before dfccl_net_start only).  0: set;
// -1: more than the capacity, or too late.
int dfccl_net_set_inline_bytes(void *h, uint64_t bytes) {
  Proxy *px = static_cast<Proxy *>(h);
  if (bytes > kInlineCapacity || px->started) return -1;
  px->inline_bytes = bytes;
  return 0;
}

// This rank's address, what a peer needs to reach it: the lane count,
// then each lane's worker address, each after its length (uint32_t words,
// host order).  0: written; 1: `cap` is too small (`*len` says how much is
// needed); -1: UCX failed.
int dfccl_net_address(void *h, uint8_t *buf, size_t cap, size_t *len) {
  Proxy *px = static_cast<Proxy *>(h);
  std::vector<uint8_t> out;
  auto put_u32 = [&](uint32_t v) { out.insert(out.end(), (uint8_t *)&v, (uint8_t *)&v + 4); };
  put_u32((uint32_t)px->lanes.size());
  for (auto &l : px->lanes) {
    ucp_address_t *addr = nullptr;
    size_t n = 0;
    if (ucp_worker_get_address(l->worker, &addr, &n) != UCS_OK) return -1;
    put_u32((uint32_t)n);
    out.insert(out.end(), (uint8_t *)addr, (uint8_t *)addr + n);
    ucp_worker_release_address(l->worker, addr);
  }
  *len = out.size();
  if (out.size() > cap) return 1;
  memcpy(buf, out.data(), out.size());
  return 0;
}

// Connects every lane to the same lane of `peer`, whose address
// (dfccl_net_address) is `addr`; its arena's mirror here is `mirror`.
// 0: connected; -1: `err` says why (a peer with another lane count among them).
int dfccl_net_connect(void *h, uint32_t peer, const uint8_t *addr, size_t len, uint64_t mirror, char *err,
                      size_t errlen) {
  Proxy *px = static_cast<Proxy *>(h);
  if (peer >= px->nranks) return -1;
  auto get_u32 = [&](size_t at, uint32_t *v) {
    if (at + 4 > len) return false;
    memcpy(v, addr + at, 4);
    return true;
  };
  uint32_t lanes = 0;
  if (!get_u32(0, &lanes)) {
    set_error(err, errlen, "the peer's address is truncated");
    return -1;
  }
  if (lanes != px->lanes.size()) {
    set_error(err, errlen, "its proxy runs " + std::to_string(lanes) + " lanes and this rank's " +
                               std::to_string(px->lanes.size()) + " (DFCCL_NET_LANES must be equal on every rank)");
    return -1;
  }
  Peer &p = px->peers[peer];
  size_t at = 4;
  for (auto &l : px->lanes) {
    l->peers[peer].connection.reset(new Connection());
    Connection *arg = l->peers[peer].connection.get();
    uint32_t n = 0;
    if (!get_u32(at, &n) || at + 4 + n > len) {
      set_error(err, errlen, "the peer's address is truncated");
      return -1;
    }
    ucp_ep_params_t ep;
    memset(&ep, 0, sizeof(ep));
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.address = reinterpret_cast<const ucp_address_t *>(addr + at + 4);
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = err_handler;
    ep.err_handler.arg = arg;
    ucs_status_t st = ucp_ep_create(l->worker, &ep, &l->peers[peer].ep);
    if (st != UCS_OK) {
      set_error(err, errlen, std::string("ucp_ep_create: ") + ucs_status_string(st));
      return -1;
    }
    at += 4 + n;
  }
  p.remote = true;
  p.mirror = reinterpret_cast<uint8_t *>(mirror);
  return 0;
}

void dfccl_net_start(void *h) {
  Proxy *px = static_cast<Proxy *>(h);
  px->started = true;
  for (auto &l : px->lanes) {
    for (uint32_t p = 0; p < px->nranks; ++p)
      if (px->peers[p].remote) px->post_headers(*l, p);
  }
  for (auto &lp : px->lanes) {
    Lane *l = lp.get();
    l->thread = std::thread([px, l] {
      dfccl_block_async_signals();
      // Named for profilers and top -H (a name that does not take costs nothing else).
      char name[16];
      snprintf(name, sizeof(name), "dfccl-net-%u", l->index);
      const int named = pthread_setname_np(pthread_self(), name);
      (void)named;
      px->run(*l);
    });
  }
}

void dfccl_net_set_status(void *h, uint64_t state, uint64_t heartbeat, uint64_t pid) {
  Proxy *px = static_cast<Proxy *>(h);
  px->status[1].store(heartbeat, std::memory_order_relaxed);
  px->status[2].store(pid, std::memory_order_relaxed);
  px->status[0].store(state, std::memory_order_release);
}

// 0: the peer is reachable; 1: its connection failed (`err` says how).
int dfccl_net_peer_lost(void *h, uint32_t peer, char *err, size_t errlen) {
  Proxy *px = static_cast<Proxy *>(h);
  if (peer >= px->nranks || !px->peers[peer].lost.load(std::memory_order_acquire)) return 0;
  set_error(err, errlen, px->peers[peer].error);
  return 1;
}

// Bytes sent, bytes received (slices), messages sent.
void dfccl_net_counters(void *h, uint64_t *out) {
  Proxy *px = static_cast<Proxy *>(h);
  out[0] = px->bytes_sent.load();
  out[1] = px->bytes_received.load();
  out[2] = px->messages.load();
}

// Keeps the first `capacity` messages sent and applied (before
// dfccl_net_start only).  0: the trace is on; -1: too late.
// (per lane).
int dfccl_net_trace_start(void *h, uint64_t capacity) {
  Proxy *px = static_cast<Proxy *>(h);
  if (px->started) return -1;
  for (auto &l : px->lanes) {
    l->trace.assign(capacity, TraceEvent{});
    l->traced.store(0);
  }
  return 0;
}

// The trace's layout for the Python side: "bytes;name:offset:size ...;code=value ...".
const char *dfccl_net_trace_format(void) {
  static char text[512];
  if (text[0] == 0) {
    snprintf(text, sizeof(text),
             "%zu;t_ns:%zu:8 seq:%zu:8 word:%zu:8 len:%zu:8 what:%zu:4 kind:%zu:4 peer:%zu:4;"
             "sent=%u applied=%u busy=%u worker_pass=%u send_call=%u put=%u record=%u status=%u share=%u "
             "lines=%u long_call_ns=%llu",
             sizeof(TraceEvent), offsetof(TraceEvent, t_ns), offsetof(TraceEvent, seq), offsetof(TraceEvent, word),
             offsetof(TraceEvent, len), offsetof(TraceEvent, what), offsetof(TraceEvent, kind),
             offsetof(TraceEvent, peer), (unsigned)TRACE_SENT, (unsigned)TRACE_APPLIED, (unsigned)TRACE_BUSY, (unsigned)CALL_WORKER_PASS,
             (unsigned)CALL_SEND, (unsigned)MSG_PUT,
             (unsigned)MSG_RECORD, (unsigned)MSG_STATUS, (unsigned)MSG_SHARE, (unsigned)MSG_LINES,
             (unsigned long long)kLongCallNs);
  }
  return text;
}

// Copies up to `cap` events of all lanes into `out`, in time order (while
// the proxy runs, the events counted are complete; after dfccl_net_close,
// they are all there); returns how many.
uint64_t dfccl_net_trace_read(void *h, void *out, uint64_t cap) {
  Proxy *px = static_cast<Proxy *>(h);
  std::vector<TraceEvent> all;
  for (auto &l : px->lanes) {
    const uint64_t n = l->traced.load(std::memory_order_acquire);
    all.insert(all.end(), l->trace.begin(), l->trace.begin() + (ptrdiff_t)n);
  }
  std::stable_sort(all.begin(), all.end(), [](const TraceEvent &a, const TraceEvent &b) { return a.t_ns < b.t_ns; });
  const uint64_t n = std::min<uint64_t>(all.size(), cap);
  if (n != 0) memcpy(out, all.data(), n * sizeof(TraceEvent));
  return n;
}

// Stops the thread after up to `linger_ns` spent sending what is queued
// (the last status above all, so that peers see this rank leave before its
// connection drops), then closes the connections and the worker.  The
// handle stays readable (the hop trace, now complete) until
// dfccl_net_destroy.
void dfccl_net_close(void *h, uint64_t linger_ns) {
  Proxy *px = static_cast<Proxy *>(h);
  px->stop.store(1, std::memory_order_release);
  for (auto &l : px->lanes)
    if (l->thread.joinable()) l->thread.join();
  const uint64_t until = now_ns() + linger_ns;
  for (auto &l : px->lanes) {
    px->drain_queues(*l);
    px->push_status(*l, true);
  }
  for (auto &l : px->lanes) {
    while (!l->outgoing.empty() && now_ns() < until) {
      ucp_worker_progress(l->worker);
      Proxy::reap_sent(*l);
    }
  }
  for (auto &l : px->lanes) {
    for (uint32_t p = 0; p < px->nranks; ++p) {
      LanePeer &peer = l->peers[p];
      if (peer.ep == nullptr) continue;
      ucp_request_param_t prm;
      memset(&prm, 0, sizeof(prm));
      prm.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      prm.flags = UCP_EP_CLOSE_FLAG_FORCE;
      ucs_status_ptr_t r = ucp_ep_close_nbx(peer.ep, &prm);
      if (r != nullptr && !UCS_PTR_IS_ERR(r)) {
        while (ucp_request_check_status(r) == UCS_INPROGRESS && now_ns() < until + 100000000ull)
          ucp_worker_progress(l->worker);
        ucp_request_free(r);
      }
      peer.ep = nullptr;
    }
    // Receives still posted: cancelled, their requests freed before the worker goes.
    for (auto &peer : l->peers) {
      for (auto &in : peer.incoming)
        for (Op *op : {&in->header, &in->payload})
          if (op->req != nullptr && !op->done.load()) ucp_request_cancel(l->worker, op->req);
    }
    for (int i = 0; i < 100; ++i) ucp_worker_progress(l->worker);
    for (auto &peer : l->peers) peer.incoming.clear();
    Proxy::drain_unexpected(*l, until);
    l->outgoing.clear();
    ucp_worker_destroy(l->worker);
    l->worker = nullptr;
  }
  ucp_cleanup(px->context);
}

// Frees a closed handle.
void dfccl_net_destroy(void *h) { delete static_cast<Proxy *>(h); }

}  // extern "C"
