// The host link: the one place where the daemon reads host memory.
//
// A read of host-mapped memory crosses PCIe (and, in a VM, the IOMMU): a
// dependent read costs ~2.3 us on the 1 x H200 VM, and the lines of one
// warp-wide load share that round trip (benchmarks/probes/host_handoff_probe.py).
// Host memory is read by the control warp of one block at a time, each lane
// loading one 16-byte word, so that several lines go in one round trip.  One
// round trip reads the control words and the next link_ahead ring entries;
// the block copies into device memory:
//   - the control words (submission tail, policy, quit request, abort epoch);
//   - new submission-queue entries, into the device ring: those read ahead
//     when they prove published and intact (dfccl_sqe), the rest after the
//     tail, several lines per round trip;
//   - the endpoints' abort flags, when the abort epoch moved.
// Every block then pulls, schedules and checks aborts from device memory.
//
// Which block reads it:
//   - with a link block (dfccl_daemon_args.link_block), one extra block
//     whose control warp does nothing else: it reads the link round trip
//     after round trip, reading ahead DFCCL_LINK_AHEAD_MAX entries, so a
//     submission reaches the device ring about one round trip after the host
//     wrote it, and no scheduler pass ever waits for PCIe (host_link_block);
//   - without one, whichever scheduler block's pass takes the link lock
//     first, at most once per kLinkPollNs; a block that is running
//     collectives takes it only when no idle block has for kLinkBusyPollNs,
//     so the round trips stay off the critical path of a run
//     (poll_host_link).  With every block polling the host on its own the
//     reads queued up for tens of microseconds.
#pragma once

#include "block_env.cuh"

namespace dfccl {

constexpr uint64_t kLinkPollNs = 1000;
constexpr uint64_t kLinkBusyPollNs = 20000;
constexpr int kDescWords = (int)(sizeof(dfccl_task_desc) / 16);
constexpr int kSqeWords = (int)(sizeof(dfccl_sqe) / 16);
constexpr int kLinkControlWords = 3;  // sq_tail .. abort_epoch
static_assert(kSqeWords == 8, "one ring entry per eight lanes");

// Copies ring entries [from, to) host -> device, after the tail was read (so
// they are complete).  The control warp takes four entries per round trip:
// lane l moves word l % 8 of entry l / 8.
DFCCL_DEV void copy_entries(const dfccl_daemon_args *a, uint64_t from, uint64_t to) {
  for (uint64_t base = from; base < to; base += 32 / kSqeWords) {
    for (int l = control_lane(); l < 32; l += control_lanes()) {
      const uint64_t i = base + (uint64_t)(l / kSqeWords);
      const int w = l % kSqeWords;
      if (i >= to || w >= kDescWords) continue;
      const uint64_t pos = i & (a->ring_size - 1);
      pack16 v;
      load_host_words(reinterpret_cast<const char *>(&a->ring[pos].desc) + 16 * w, v.lo, v.hi);
      store_pack(reinterpret_cast<char *>(&a->dev_ring[pos]) + 16 * w, v);
    }
  }
}

// Leader: an entry read before the tail is taken only if it is entry
// `position` of this lap, complete (dfccl_sqe_check) and published (below
// `upto`).
DFCCL_DEV bool take_early_entry(const dfccl_daemon_args *a, const pack16 *words, uint64_t position, uint64_t upto) {
  if (position >= upto) return false;
  const uint64_t seq = words[kSqeWords - 1].lo, check = words[kSqeWords - 1].hi;
  if (seq != position + 1 || check != dfccl_sqe_check(reinterpret_cast<const uint64_t *>(words), seq)) return false;
  char *dst = reinterpret_cast<char *>(&a->dev_ring[position & (a->ring_size - 1)]);
#pragma unroll
  for (int w = 0; w < kDescWords; ++w) store_pack(dst + 16 * w, words[w]);
  return true;
}

// The control warp: one round trip for the control words and the `ahead`
// ring entries from `avail` on, one 16-byte word per lane, into
// sm->link_words.
DFCCL_DEV void read_link_words(const dfccl_daemon_args *a, BlockShared *sm, uint64_t avail, uint32_t ahead) {
  for (int l = control_lane(); l < 8 + 8 * (int)ahead; l += control_lanes()) {
    const char *src;
    if (l < 8) {
      if (l >= kLinkControlWords) continue;
      src = reinterpret_cast<const char *>(a->control) + 16 * l;
    } else {
      const uint64_t pos = (avail + (uint64_t)((l - 8) / kSqeWords)) & (a->ring_size - 1);
      src = reinterpret_cast<const char *>(&a->ring[pos]) + 16 * ((l - 8) % kSqeWords);
    }
    load_host_words(src, sm->link_words[l].lo, sm->link_words[l].hi);
  }
}

// The control warp, after read_link_words(avail, ahead): copies what the
// words say into device memory (control words, abort flags, the entries read
// ahead that prove published, the rest of the new entries after the tail).
// `pulled` (leader; in and out): a lower bound of how far every block has
// pulled, raised here when the new entries would overwrite device-ring
// entries not yet pulled past it.  Returns the new sq_avail (leader).
DFCCL_DEV uint64_t take_link_words(const BlockEnv &env, uint64_t avail, uint32_t ahead, uint64_t &pulled) {
  const dfccl_daemon_args *a = env.args;
  dfccl_daemon_state *st = a->state;
  BlockShared *sm = env.sm;
  fence_system();  // acquire: what the host wrote before the words read from here on
  if (is_leader()) sm->link_scan = sm->link_words[0].lo > pulled + a->ring_size ? 1u : 0u;
  control_sync();
  if (sm->link_scan) {
    // How far every block has pulled, one block per lane: the leader reading
    // them one after the other (a dependent L2 round trip each, 32 blocks on
    // an H200) took longer than the host round trip itself.
    uint64_t low = ~0ull;
    for (uint32_t b = (uint32_t)control_lane(); b < a->nblocks; b += (uint32_t)control_lanes()) {
      const uint64_t h = load_gpu(&st->sq_head[b]);
      low = h < low ? h : low;
    }
    low = control_min(low);
    if (low > pulled) pulled = low;
  }
  control_sync();
  if (is_leader()) {
    const pack16 *w = sm->link_words;
    const uint64_t tail = w[0].lo;
    store_gpu(&st->base_window_ns, w[0].hi);
    store_gpu(&st->max_window_ns, w[1].lo);
    store_gpu(&st->idle_quit_ns, w[1].hi);
    store_gpu(&st->quit_request, w[2].lo);
    if (w[2].hi != load_gpu(&st->abort_epoch)) {
      for (uint32_t e = 0; e < a->max_endpoints; e += 4) {
        uint64_t lo, hi;
        load_host_words(a->endpoint_abort + e, lo, hi);
        store_pack(a->endpoint_abort_dev + e, pack16{lo, hi});
      }
      store_gpu(&st->abort_epoch, w[2].hi);
    }
    // New entries, as far as every block has pulled the device-ring entries
    // they would overwrite (a block lags only while a long run holds it).
    const uint64_t limit = pulled + a->ring_size;
    const uint64_t upto = limit < tail ? limit : tail;
    uint64_t from = avail;
    for (uint32_t e = 0; e < ahead && take_early_entry(a, &w[8 + kSqeWords * e], from, upto); ++e) ++from;
    sm->link_from = from;
    sm->link_upto = upto > avail ? upto : avail;
  }
  control_sync();
  copy_entries(a, sm->link_from, sm->link_upto);
  fence_gpu();  // every lane's copies before the leader's count
  control_sync();
  const uint64_t upto = sm->link_upto;
  if (is_leader() && upto > avail) {
    store_release_gpu(&st->sq_avail, upto);  // the copies before the count, for the pullers
    store_relaxed(&a->control->sq_copied, upto);
  }
  return upto;
}

// The link block's control warp (dfccl_daemon_args.link_block): reads the
// link round trip after round trip, reading ahead as far as it can, until
// the daemon leaves (block 0 stores the launch's epoch into quit_epoch; the
// scheduler blocks see the same word).  A round trip that brings nothing new
// (the control words as last seen, no published entry at the head) costs
// nothing more: the next read leaves at once, so a submission is seen about
// one host round trip after the host wrote it.  The quit word's load (device
// memory) shares the round trip.  It holds no task and waits for nothing but
// host memory, so it adds no wait to the scheduler's (the invariants in
// docs/architecture.md are unchanged); the blocks it feeds pull from device
// memory only.
DFCCL_NOINLINE void host_link_block(const BlockEnv &env) {
  const dfccl_daemon_args *a = env.args;
  dfccl_daemon_state *st = a->state;
  BlockShared *sm = env.sm;
  constexpr uint32_t ahead = DFCCL_LINK_AHEAD_MAX;
  uint64_t avail = load_gpu(&st->sq_avail);  // this block alone moves it while the launch lasts
  uint64_t pulled = 0;
  pack16 seen[kLinkControlWords] = {};  // leader: the control words as last taken
  bool first = true;
  for (;;) {
    const uint64_t quit = is_leader() ? load_early(&st->quit_epoch) : 0;
    read_link_words(a, sm, avail, ahead);
    if (is_leader()) {
      const pack16 *w = sm->link_words;
      bool news = first;
      for (int i = 0; i < kLinkControlWords; ++i) news |= w[i].lo != seen[i].lo || w[i].hi != seen[i].hi;
      // An entry read ahead that is already published, or entries of a tail
      // seen before that did not fit the device ring then.
      news |= w[8 + kSqeWords - 1].lo == avail + 1 || seen[0].lo > avail;
      sm->quit = quit == (uint64_t)a->epoch ? 1u : 0u;
      sm->link_go = news ? 1u : 0u;
      if (news)
        for (int i = 0; i < kLinkControlWords; ++i) seen[i] = w[i];
    }
    control_sync();
    if (sm->quit) return;
    if (sm->link_go) {
      first = false;
      const uint64_t upto = take_link_words(env, avail, ahead, pulled);
      avail = upto > avail ? upto : avail;
    } else {
      link_pause();
    }
    control_sync();
  }
}

// The control warp of any block, once per scheduler pass (`busy`, `now`,
// `seen_ns`: the leader's).  Returns at once unless this block gets the link
// and kLinkPollNs (kLinkBusyPollNs for a block that ran a task in its last
// pass) have passed since the last read.  `seen_ns` (leader-private): when
// this block last looked at the link's clock; a busy block does not even
// read that clock (a device-memory round trip) more often than every
// kLinkBusyPollNs.
DFCCL_NOINLINE void poll_host_link(const BlockEnv &env, bool busy, uint64_t now, uint64_t &seen_ns) {
  const dfccl_daemon_args *a = env.args;
  dfccl_daemon_state *st = a->state;
  BlockShared *sm = env.sm;
  if (is_leader()) {
    sm->link_go = 0;
    const bool lazy = busy && a->nblocks > 1;
    if (!(lazy && now >= seen_ns && now - seen_ns < kLinkBusyPollNs)) {
      seen_ns = now;
      const uint64_t last = load_gpu(&st->link_poll_ns);
      if (!(now >= last && now - last < (lazy ? kLinkBusyPollNs : kLinkPollNs)) && try_lock_gpu(&st->link_busy)) {
        store_gpu(&st->link_poll_ns, now);
        sm->link_go = 1;
      }
    }
  }
  control_sync();
  if (!sm->link_go) return;
  const uint32_t ahead = a->link_ahead <= DFCCL_LINK_AHEAD_MAX ? a->link_ahead : DFCCL_LINK_AHEAD_MAX;
  if (is_leader()) sm->link_avail = load_gpu(&st->sq_avail);
  control_sync();
  const uint64_t avail = sm->link_avail;
  read_link_words(a, sm, avail, ahead);
  uint64_t pulled = 0;  // scanned afresh: another block may hold the link next
  take_link_words(env, avail, ahead, pulled);
  if (is_leader()) store_release_gpu(&st->link_busy, 0u);
}
}  // namespace dfccl
