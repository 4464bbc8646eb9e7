// The host link: the one place where the daemon reads host memory.
//
// A read of host-mapped memory crosses PCIe (and, in a VM, the IOMMU).  Such
// reads do not pipeline well: with every block polling the host on its own,
// they queue up and each one was measured to take tens of microseconds, which
// every scheduler pass paid.  So host memory is read by one block at a time
// (whichever block's scheduler pass takes the link lock first, at most once
// per kLinkPollNs; a block that is running collectives takes it only when no
// idle block has for kLinkBusyPollNs, so the PCIe round trips stay off the
// critical path of a run), in one round trip when nothing races the host,
// which copies what it finds into device memory:
//   - the control words (submission tail, policy, quit request, abort epoch);
//   - new submission-queue entries, into the device ring;
//   - the endpoints' abort flags, when the abort epoch moved.
// Every block then pulls, schedules and checks aborts from device memory.
#pragma once

#include "block_env.cuh"

namespace dfccl {

constexpr uint64_t kLinkPollNs = 1000;
constexpr uint64_t kLinkBusyPollNs = 20000;
// Entries read speculatively with the control words, in one round trip.
constexpr int kLinkAheadEntries = 2;
constexpr int kDescWords = (int)(sizeof(dfccl_task_desc) / 16);
constexpr int kSqeWords = (int)(sizeof(dfccl_sqe) / 16);

// Copies ring entries [from, to) host -> device after the tail was read (so
// they are complete).  One round trip per entry: its 16-byte words are
// independent loads.
DFCCL_DEV void copy_entries(const dfccl_daemon_args *a, uint64_t from, uint64_t to) {
  for (uint64_t i = from; i < to; ++i) {
    const uint64_t pos = i & (a->ring_size - 1);
    const char *src = reinterpret_cast<const char *>(&a->ring[pos].desc);
    char *dst = reinterpret_cast<char *>(&a->dev_ring[pos]);
    uint64_t lo[kDescWords], hi[kDescWords];
#pragma unroll
    for (int w = 0; w < kDescWords; ++w) load_host_words(src + 16 * w, lo[w], hi[w]);
#pragma unroll
    for (int w = 0; w < kDescWords; ++w) store_pack(dst + 16 * w, pack16{lo[w], hi[w]});
  }
}

// An entry read before the tail: taken only if it is entry `position` of
// this lap, complete (dfccl_sqe_check) and published (below `upto`).
DFCCL_DEV bool take_early_entry(const dfccl_daemon_args *a, const pack16 *words, uint64_t position, uint64_t upto) {
  if (position >= upto) return false;
  const uint64_t seq = words[kSqeWords - 1].lo, check = words[kSqeWords - 1].hi;
  if (seq != position + 1 || check != dfccl_sqe_check(reinterpret_cast<const uint64_t *>(words), seq)) return false;
  char *dst = reinterpret_cast<char *>(&a->dev_ring[position & (a->ring_size - 1)]);
#pragma unroll
  for (int w = 0; w < kDescWords; ++w) store_pack(dst + 16 * w, words[w]);
  return true;
}

// The leader of any block, once per scheduler pass.  Returns at once unless
// this block gets the link and kLinkPollNs (kLinkBusyPollNs for a block that
// ran a task in its last pass) have passed since the last read.  `seen_ns`
// (leader-private): when this block last looked at the link's clock; a busy
// block does not even read that clock (a device-memory round trip) more often
// than every kLinkBusyPollNs.
//
// One PCIe round trip takes the control words and the next
// kLinkAheadEntries entries together (a read of host memory costs several
// microseconds in a VM, and the entries used to wait for the tail: a
// round trip more, and one per entry).  Entries beyond those, or one read
// while the host was still writing it, are read again after the tail.
DFCCL_NOINLINE void poll_host_link(const BlockEnv &env, bool busy, uint64_t now, uint64_t &seen_ns) {
  const dfccl_daemon_args *a = env.args;
  dfccl_daemon_state *st = a->state;
  const bool lazy = busy && a->nblocks > 1;
  if (lazy && now >= seen_ns && now - seen_ns < kLinkBusyPollNs) return;
  seen_ns = now;
  const uint64_t last = load_gpu(&st->link_poll_ns);
  if (now >= last && now - last < (lazy ? kLinkBusyPollNs : kLinkPollNs)) return;
  if (!try_lock_gpu(&st->link_busy)) return;
  store_gpu(&st->link_poll_ns, now);
  const uint64_t avail = load_gpu(&st->sq_avail);
  // sq_tail .. abort_epoch, and the entries at avail, avail + 1, ...: independent reads.
  uint64_t w[6];
  pack16 ahead[kLinkAheadEntries][kSqeWords];
  const char *ctrl = reinterpret_cast<const char *>(a->control);
  load_host_words(ctrl, w[0], w[1]);
  load_host_words(ctrl + 16, w[2], w[3]);
  load_host_words(ctrl + 32, w[4], w[5]);
#pragma unroll
  for (int e = 0; e < kLinkAheadEntries; ++e) {
    const char *src = reinterpret_cast<const char *>(&a->ring[(avail + e) & (a->ring_size - 1)]);
#pragma unroll
    for (int k = 0; k < kSqeWords; ++k) load_host_words(src + 16 * k, ahead[e][k].lo, ahead[e][k].hi);
  }
  fence_system();  // acquire: what the host wrote before the words read from here on
  const uint64_t tail = w[0];
  store_gpu(&st->base_window_ns, w[1]);
  store_gpu(&st->max_window_ns, w[2]);
  store_gpu(&st->idle_quit_ns, w[3]);
  store_gpu(&st->quit_request, w[4]);
  if (w[5] != load_gpu(&st->abort_epoch)) {
    for (uint32_t e = 0; e < a->max_endpoints; e += 4) {
      uint64_t lo, hi;
      load_host_words(a->endpoint_abort + e, lo, hi);
      store_pack(a->endpoint_abort_dev + e, pack16{lo, hi});
    }
    store_gpu(&st->abort_epoch, w[5]);
  }
  // New entries, as far as every block has pulled the device-ring entries
  // they would overwrite (a block lags only while a long run holds it).
  uint64_t upto = tail;
  for (uint32_t b = 0; b < a->nblocks; ++b) {
    const uint64_t limit = load_gpu(&st->sq_head[b]) + a->ring_size;
    if (limit < upto) upto = limit;
  }
  if (upto > avail) {
    uint64_t copied = avail;
#pragma unroll
    for (int e = 0; e < kLinkAheadEntries; ++e)
      if (copied == avail + e && take_early_entry(a, ahead[e], copied, upto)) ++copied;
    copy_entries(a, copied, upto);
    store_release_gpu(&st->sq_avail, upto);  // the copies before the count, for the pullers
    store_relaxed(&a->control->sq_copied, upto);
  }
  store_release_gpu(&st->link_busy, 0u);
}

}  // namespace dfccl
