/*
 * Peers on other hosts (docs/multi-node.md): what the daemon and the network
 * proxy of a rank share.  A remote peer's arena cannot be mapped, so the
 * rank keeps a *mirror* of it (same layout, host memory the daemon maps):
 * the daemon reads the peer's records and rank status there, and writes
 * what it would have stored into the peer's arena (ring slices, posted and
 * credit words, abort marks) there too, then posts an entry into its
 * block's net queue saying what the proxy must carry to the peer's real
 * arena.  The proxy (a native host thread) sends it over UCX; the peer's
 * proxy lands the bytes in its arena, then stores the word, in the order
 * the entries were posted.  What the owner publishes in its own record
 * (NET_RECORD) and its rank status go to every remote peer's mirror of it;
 * what peers read of its arena besides (an all-to-all's split table and
 * send copy, NET_SHARE) goes to the mirror of the one peer that reads it.
 * LL lines (NET_LINES) carry their own flags instead of a word, so the
 * peer's proxy lands them 8 bytes at a time: a line's halves {data, flag}
 * are never seen torn.
 *
 * One queue per (rank, daemon block): one producer (the block's leader),
 * one consumer (the proxy), so head and tail are plain counters.
 */
#ifndef DFCCL_NET_H
#define DFCCL_NET_H

#include "dfccl/abi.h"  /* the fixed-width types, NVRTC included */

/* Entries per queue (a power of two).  A ring or p2p step posts at most two,
 * an LL instance 2 per remote peer and one, an all-to-all's publication 2
 * per remote peer and one (2 * 63 + 1). */
#define DFCCL_NET_QUEUE_ENTRIES 256u

/* Entry kinds. */
#define DFCCL_NET_PUT 1u     /* `len` bytes at `offset` of the peer's mirror -> its arena, then `word`
                                at `word_offset` (none when word_offset is DFCCL_NET_NO_WORD) */
#define DFCCL_NET_RECORD 2u  /* this rank's record channel at `offset` of its own arena (header at
                                `word_offset`): what the owner publishes there -> every remote peer's mirror */
#define DFCCL_NET_SHARE 3u   /* `len` bytes at `offset` of this rank's own arena -> the same offset of `peer`'s
                                mirror of it (what that peer reads there; no word) */
#define DFCCL_NET_LINES 4u   /* `len` bytes of LL lines at `offset` of the peer's mirror -> its arena, landed
                                8 bytes at a time (no word: each line's flags say it is there) */

#define DFCCL_NET_NO_WORD 0xffffffffffffffffull

typedef struct dfccl_net_entry {
  uint32_t kind;
  uint32_t peer;          /* NET_PUT: the rank it goes to */
  uint64_t offset;
  uint64_t len;           /* bytes */
  uint64_t word_offset;
  uint64_t word;
  uint64_t pad[3];
} dfccl_net_entry;  /* 64 bytes */

typedef struct dfccl_net_queue {
  uint64_t tail;          /* entries posted (the daemon's leader; released after the entry) */
  uint64_t pad0[7];
  uint64_t head;          /* entries taken (the proxy) */
  uint64_t pad1[7];
  dfccl_net_entry entries[DFCCL_NET_QUEUE_ENTRIES];
} dfccl_net_queue;

#ifdef __cplusplus
static_assert(sizeof(dfccl_net_entry) == 64, "dfccl_net_entry layout");
static_assert((DFCCL_NET_QUEUE_ENTRIES & (DFCCL_NET_QUEUE_ENTRIES - 1)) == 0, "queue entries: a power of two");
static_assert(DFCCL_NET_QUEUE_ENTRIES >= 2 * DFCCL_MAX_RANKS, "an all-to-all's publication fits a queue");
#endif

#endif /* DFCCL_NET_H */
