// The proxy's core: what its lanes share (the peers and their failures,
// this rank's status, the counters), the hop trace's notes, and the loop
// each lane's thread runs.  The loop's two paths are defined beside it:
// send.h takes the daemon's queues to messages, receive.h lands the peers'
// messages in order.
#pragma once

#include <sched.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <ucp/api/ucp.h>

#include "dfccl/net.h"
#include "lane.h"
#include "wire.h"

namespace {

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

  // Where the bytes of a PUT or SHARE from `peer` land: a slice in this
  // rank's arena, what all-to-all peers read in the sender's mirror.
  uint8_t *landing(const Msg &m, uint32_t peer) const { return m.kind == MSG_PUT ? arena : peers[peer].mirror; }

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

  void fail_peer(uint32_t p, const char *what, ucs_status_t st) {
    Peer &peer = peers[p];
    std::lock_guard<std::mutex> hold(peer.mutex);
    if (peer.lost.load()) return;
    peer.error = std::string(what) + ": " + ucs_status_string(st);
    peer.lost.store(1, std::memory_order_release);
  }

  // ---- sending (send.h) ----------------------------------------------------
  bool drain_queues(Lane &l);
  void take(Lane &l, const dfccl_net_entry &e);
  bool push_status(Lane &l, bool beat);
  void send(Lane &l, uint32_t p, std::unique_ptr<Outgoing> out, const void *payload);
  bool send_part(Lane &l, uint32_t p, const void *buf, size_t len, uint64_t tag, Op *op);
  static void reap_sent(Lane &l);

  // ---- receiving (receive.h) -----------------------------------------------
  void post_headers(Lane &l, uint32_t p);
  bool post_recv(Lane &l, uint32_t p, void *buf, size_t len, uint64_t tag, Op *op, Incoming *header_of = nullptr);
  void post_payload(Incoming *in);
  bool receive(Lane &l, uint32_t p);
  void apply(uint32_t p, const Lane &l, const Incoming &in);
  void check_connections(Lane &l);
  static void drain_unexpected(Lane &l, uint64_t until);

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

}  // namespace
