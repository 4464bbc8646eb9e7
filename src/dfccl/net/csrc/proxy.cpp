// The network proxy of one communicator rank (docs/multi-node.md): native
// threads that never take the GIL.  It drains the rank's net queues (one per
// daemon block, dfccl/net.h) into UCX tagged messages to the remote peers,
// and lands what the peers send: slices and words into this rank's arena,
// their published records and rank status into its mirrors of their arenas.
//
// This file is its C API (dfccl/net/link.py calls it); the proxy is in the
// headers beside it, included here as one translation unit so that all of
// it keeps internal linkage: wire.h (what travels), lane.h (a lane's
// thread, worker and connections), proxy.h (what the lanes share, their
// loop), send.h (the daemon's queues to messages) and receive.h (the peers'
// messages applied in order).
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>

#include <algorithm>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <ucp/api/ucp.h>

#include "dfccl/host_signals.h"
#include "dfccl/net.h"
#include "wire.h"
#include "lane.h"
#include "proxy.h"
#include "send.h"
#include "receive.h"

namespace {

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

// Stops the lanes' threads after up to `linger_ns` spent sending what is
// queued (the last status above all, so that peers see this rank leave
// before its connections drop), then closes the connections and workers.
// The handle stays readable (the hop trace, now complete) until
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
  // The lanes' last messages go out side by side: one lane's backlog must
  // not spend the linger another's leave needs (a connection dropped
  // before its lane brought the leave reads as a lost peer).
  for (bool pending = true; pending && now_ns() < until;) {
    pending = false;
    for (auto &l : px->lanes) {
      if (l->outgoing.empty()) continue;
      ucp_worker_progress(l->worker);
      Proxy::reap_sent(*l);
      pending |= !l->outgoing.empty();
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
