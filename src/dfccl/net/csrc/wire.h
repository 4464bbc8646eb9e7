// What travels between two proxies and what the hop trace keeps of it: the
// message kinds, the header and its inline bytes, the tags, the trace's
// events; and the clock and the atomic accessors for the words shared with
// the daemons.
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
#pragma once

#include <stdint.h>
#include <time.h>

#include "dfccl/abi.h"
#include "dfccl/layout.h"

namespace {

enum MsgKind : uint32_t { MSG_PUT = 1, MSG_RECORD = 2, MSG_STATUS = 3, MSG_SHARE = 4, MSG_LINES = 5 };

constexpr uint32_t kChanWords = sizeof(dfccl_chan_state) / 8;
constexpr uint32_t kStatusWords = 3;  // state, heartbeat, pid (dfccl_rank_status)
constexpr uint64_t kPayloadBit = 1ull << 63;
constexpr uint64_t kSeqMask = (1ull << 48) - 1;
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

// Whether a message of this kind carries bytes (inline or as a second
// message): a slice (PUT), what all-to-all peers read (SHARE), LL lines.
inline bool carries_bytes(uint32_t kind) { return kind == MSG_PUT || kind == MSG_SHARE || kind == MSG_LINES; }

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

}  // namespace
