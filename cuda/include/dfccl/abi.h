/*
 * dfccl ABI: the memory layouts shared by the host runtime (Cython), the daemon
 * kernel (nvcc) and the simulator (host C++).  Plain C so that all three read
 * the same definitions; every structure has a fixed size checked below.
 *
 * Where things live (see docs/architecture.md):
 *   host-mapped memory (pinned, device-visible): dfccl_control, the submission
 *     ring of dfccl_sqe, and the per-slot words armed/done/result.
 *   device memory (private to one context): dfccl_daemon_state, the per
 *     (slot, block) dfccl_task_ctx, per-block active lists, endpoint table.
 *   arena (device memory that peers may map): tag tables of dfccl_chan_state
 *     records and the staging FIFOs of the ring path.
 */
#ifndef DFCCL_ABI_H
#define DFCCL_ABI_H

#if defined(__CUDACC_RTC__)
/* NVRTC has no <stdint.h>: the fixed-width types the daemon uses. */
typedef signed char int8_t;
typedef short int16_t;
typedef int int32_t;
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
typedef long long int64_t;
#else
#include <stdint.h>
#endif

#define DFCCL_ABI_VERSION 1

#define DFCCL_MAX_CHANNELS 32   /* blocks of one daemon, channels of one collective */
#define DFCCL_MAX_RANKS 64      /* ranks of one communicator */
#define DFCCL_PEER_CACHE 8      /* peer record locations cached per (task, block) */

/* ---- what a collective is ---------------------------------------------- */
enum dfccl_kind {
  DFCCL_ALL_REDUCE = 0,
  DFCCL_ALL_GATHER = 1,
  DFCCL_REDUCE_SCATTER = 2,
  DFCCL_BROADCAST = 3,
  DFCCL_REDUCE = 4,
  /* point to point and all-to-all (cuda/daemon/transfer_p2p.cuh); root holds
     the peer rank of a send or recv */
  DFCCL_SEND = 5,
  DFCCL_RECV = 6,
  DFCCL_ALL_TO_ALL = 7,
  DFCCL_NUM_KINDS = 8
};

enum dfccl_dtype {
  DFCCL_INT8 = 0, DFCCL_UINT8 = 1, DFCCL_INT32 = 2, DFCCL_UINT32 = 3,
  DFCCL_INT64 = 4, DFCCL_UINT64 = 5, DFCCL_FLOAT16 = 6, DFCCL_FLOAT32 = 7,
  DFCCL_FLOAT64 = 8, DFCCL_BFLOAT16 = 9, DFCCL_NUM_DTYPES = 10
};

enum dfccl_op {
  DFCCL_SUM = 0, DFCCL_PROD = 1, DFCCL_MIN = 2, DFCCL_MAX = 3, DFCCL_AVG = 4,
  DFCCL_NUM_OPS = 5
};

/* Data path of one collective (docs/architecture.md, "Two data paths"). */
enum dfccl_path {
  DFCCL_PATH_DIRECT = 0,  /* peers read each other's buffers in place */
  DFCCL_PATH_RING = 1,    /* chunks move through per-tag FIFOs, credit flow control */
  DFCCL_NUM_PATHS = 2
};

/* Completion status written into dfccl_result.status. */
enum dfccl_status {
  DFCCL_STATUS_OK = 0,
  DFCCL_STATUS_MISMATCH = 1,      /* a peer submitted this tag with another signature */
  DFCCL_STATUS_PEER_ABORTED = 2,  /* a peer gave up this instance; detail = that rank */
  DFCCL_STATUS_ABORTED = 3,       /* the host aborted the communicator */
  DFCCL_STATUS_BAD_TASK = 4,      /* the descriptor failed a device-side sanity check */
  DFCCL_STATUS_PEER_LOST = 5      /* a peer's process died; detail = that rank */
};

/* dfccl_control's per-endpoint abort words (endpoint_abort): 0 = live,
 * DFCCL_EP_ABORTED = the host aborted this rank, DFCCL_EP_PEER_LOST + r =
 * the host found rank r's process dead (every pending collective of the
 * endpoint fails with DFCCL_STATUS_PEER_LOST, detail r). */
#define DFCCL_EP_ABORTED 1u
#define DFCCL_EP_PEER_LOST 0x100u

/* dfccl_task_desc.flags */
#define DFCCL_TASK_ONE_SHOT 1u      /* direct all-reduce small enough for one phase; taken
                                       only if every rank is out of place */
#define DFCCL_TASK_ARMED 2u         /* may run at once (not stream-ordered) */
#define DFCCL_TASK_STAGED 4u        /* direct path across processes: peers read copies of this
                                       rank's buffers in its arena (fifo_offset), not the
                                       buffers themselves, which they cannot map */
#define DFCCL_TASK_SEND_REGISTERED 8u /* staged: peers read the input in place, through their mapping
                                         of its registered allocation (send_reg), not a copy */

/* Registered buffers (staged direct path).  A rank publishes a registered
 * input as a word with DFCCL_REG_BIT set, the allocation's registration slot
 * and the offset in it; a peer translates it through its endpoint's
 * reg_table[rank * DFCCL_REG_SLOTS + slot] (that allocation as mapped in
 * the peer's process).  Other staged words are offsets in the owner's arena. */
#define DFCCL_REG_SLOTS 256u
#define DFCCL_REG_BIT (1ull << 63)
#define DFCCL_REG_SLOT_SHIFT 40
#define DFCCL_REG_OFFSET_MASK ((1ull << DFCCL_REG_SLOT_SHIFT) - 1ull)
#define DFCCL_TASK_LL 16u           /* eager low-latency protocol (cuda/daemon/transfer_ll.cuh): every
                                       rank stores its contribution into every peer's receive area
                                       in flagged 16-byte lines; one channel, path DIRECT */
#define DFCCL_TASK_KEY_BUCKET 32u   /* the bucket may never have held a tag here: the daemon writes the
                                       tag's key into it when it pulls the task (submit.cuh,
                                       claim_fresh_bucket); set until an instance in it retired */
#define DFCCL_TASK_GRAPH 64u        /* one replay of a collective captured in a CUDA graph
                                       (cuda/daemon/graph.cuh): pushed by the graph's arm node, not
                                       the host; its slot belongs to the graph node */
#define DFCCL_TASK_FOLLOWS 128u     /* `after` names another collective of this daemon that this one
                                       runs after (the part before it of a hierarchical collective),
                                       not an earlier instance of its tag: if that one failed, this
                                       one fails at its first run without moving data and marks its
                                       record, so its peers fail too (PEER_ABORTED from this rank).
                                       The host keeps that slot's result until this one retired */

/* ---- CUDA graphs (docs/architecture.md, "CUDA graphs") ------------------ */
/* A replay's completion word: the replay count with this bit set, so that
 * the captured wait (cuStreamWaitValue32 AND this bit) is the same for
 * every replay; the arm node zeroes the word first. */
#define DFCCL_GRAPH_GEN_BIT 0x80000000u

/* ---- submission --------------------------------------------------------- */
/* One submission-queue entry.  The host fills it in the ring, then publishes it
 * by advancing dfccl_control.sq_tail with release semantics. */
typedef struct dfccl_task_desc {
  uint64_t send_addr;     /* input buffer, this process's address space */
  uint64_t recv_addr;     /* output buffer (== send_addr when in place) */
  uint64_t count;         /* elements: see docs/architecture.md, "Counts" */
  uint64_t tag_key;       /* 64-bit hash of (communicator, tag) */
  uint64_t instance;      /* this rank's k-th use of the tag, from 1 */
  uint64_t send_reg;      /* DFCCL_TASK_SEND_REGISTERED: the input's registered word; else zero */
  uint64_t fifo_offset;   /* ring path: this rank's receive FIFO in its arena, with its shape in
                             the high bits as in a fifo word (DFCCL_FIFO_*: 0 there = slice_bytes
                             x fifo_slots per channel); staged direct path: its staging (input
                             copy, then output copy) */
  uint32_t endpoint;      /* index into the endpoint table */
  uint32_t bucket;        /* this rank's tag record index */
  uint32_t slot;          /* completion slot */
  uint32_t gen;           /* slot generation: done[slot] == gen on completion */
  uint32_t slice_bytes;   /* ring path: the planned slice (bytes per FIFO slot), equal on every rank */
  uint32_t fifo_slots;    /* ring path: planned slots per channel of a FIFO */
  uint32_t flags;         /* DFCCL_TASK_* */
  uint16_t root;
  uint16_t nchannels;     /* blocks taking part; blocks >= nchannels skip it */
  uint8_t kind, dtype, op, path;
  uint32_t first_block;   /* the daemon block that runs channel 0; channel c runs on block
                             (first_block + c) % nblocks (Daemon.submit spreads tags and the
                             ranks of one device over the blocks) */
  uint64_t aux_offset;    /* all-to-all: this instance's split table in its arena
                             (dfccl_a2a_table); zero otherwise */
  uint64_t after;         /* ((slot + 1) << 32) | gen of a collective that must be complete on every
                             channel before this one runs on any: an earlier instance of this tag
                             (they share the tag's staging but lay it out differently: tags.py)
                             or, with DFCCL_TASK_FOLLOWS, the part before it of a hierarchical
                             collective; zero = none */
} dfccl_task_desc;  /* 112 bytes */

/* One entry of the host's submission ring: the descriptor, its position and
 * a check word.  The daemon's host link reads the next entries in the same
 * PCIe round trip as the tail, before it knows they are published; an entry
 * counts only if its position is below that tail, seq says it belongs to
 * this lap of the ring and check matches (dfccl_sqe_check, hash.h), so a
 * stale or half-written one is never taken: it is read again after the
 * tail, as every entry used to be. */
typedef struct dfccl_sqe {
  dfccl_task_desc desc;
  uint64_t seq;           /* ring position + 1 */
  uint64_t check;         /* dfccl_sqe_check(desc, seq) */
} dfccl_sqe;  /* 128 bytes */

/* What a captured collective's arm node carries, bound at capture: the
 * descriptor (its instance is the tag's first, taken at capture) and the
 * binding, a number the host never gives twice per context.  Each replay
 * counts itself in graph_count[slot] (binding << 32 | replays): replay k
 * runs instance desc.instance + k - 1 with gen DFCCL_GRAPH_GEN_BIT | k. */
typedef struct dfccl_graph_arm {
  dfccl_task_desc desc;
  uint64_t binding;
} dfccl_graph_arm;  /* 120 bytes */

/* Host <-> daemon control words, in host-mapped memory.  Host-written and
 * device-written words sit on separate 128-byte lines.  On the device only
 * the host link (cuda/daemon/link.cuh) reads the host-written line; the
 * daemon's blocks read its copies in device memory. */
typedef struct dfccl_control {
  /* host -> device (the first 48 bytes are read together) */
  uint64_t sq_tail;          /* SQEs published */
  uint64_t base_window_ns;   /* adaptive base of the preemption window */
  uint64_t max_window_ns;    /* cap of any window */
  uint64_t idle_quit_ns;     /* quit after this long without progress */
  uint64_t quit_request;     /* nonzero: daemon exits at its next scheduler pass */
  uint64_t abort_epoch;      /* bumped after every change of endpoint_abort */
  uint64_t stream_waits;     /* incomplete collectives some stream waits for:
                                the daemon does not leave while nonzero */
  uint64_t host_pad[9];
  /* device -> host */
  uint64_t daemon_state;     /* (epoch << DFCCL_DAEMON_EPOCH_SHIFT) | DFCCL_DAEMON_* */
  uint64_t sq_copied;        /* SQEs copied into the device ring: the host may
                                rewrite ring entries below this */
  uint64_t graph_arms;       /* replays armed (graph.cuh): the host watcher
                                relaunches a daemon that left when it moves */
  uint64_t graph_failed;     /* nonzero once a replay failed since the host
                                last looked (it zeroes it) */
  uint64_t dev_pad[12];
} dfccl_control;

/* QUITTING: deciding (it re-reads the host's words); then RUNNING (it
   stays) or LEAVING (it will exit, and is relaunched by the host if need
   be); EXITED once every block is gone. */
#define DFCCL_DAEMON_RUNNING 1u
#define DFCCL_DAEMON_QUITTING 2u
#define DFCCL_DAEMON_EXITED 3u
#define DFCCL_DAEMON_LEAVING 4u
#define DFCCL_DAEMON_EPOCH_SHIFT 3
#define DFCCL_DAEMON_STATE_MASK 7u

/* Per-slot result, written by the device before done[slot] = gen. */
typedef struct dfccl_result {
  uint32_t status;        /* dfccl_status */
  int32_t detail;         /* peer rank for MISMATCH / PEER_ABORTED, else -1 */
  uint32_t preemptions;   /* summed over channels */
  uint32_t resumes;
  uint64_t queued_ns;     /* max over channels: pulled -> first run */
  uint64_t running_ns;    /* max over channels: time inside runs */
  uint64_t wall_ns;       /* max over channels: first run -> done */
  uint32_t waiting_on;    /* last peer a preempted run waited for (+1; 0 = none) */
  uint32_t nchannels;
  uint64_t max_wait_ns;   /* longest wait that ended with the peer arriving */
  uint64_t reserved;
} dfccl_result;  /* 64 bytes */

/* ---- device-private state ----------------------------------------------- */
/* Per-(slot, block) saved context: descriptor copy + exact resume point. */
typedef struct dfccl_task_ctx {
  dfccl_task_desc desc;
  uint32_t state;         /* DFCCL_CTX_* */
  uint32_t step;          /* algorithm step to resume at */
  uint32_t fails;         /* consecutive runs with no progress */
  uint32_t sticky;        /* last run made progress: the gang has formed */
  uint64_t pos[4];        /* algorithm counters (loop, peer index, sent, received) */
  uint64_t pulled_ns, first_run_ns, running_ns, finish_ns;
  uint64_t max_wait_ns;   /* longest successful wait (peer skew) */
  uint32_t preemptions, resumes;
  uint32_t waiting_on;    /* +1 rank of the peer the last wait was for */
  uint32_t status;
  int32_t detail;
  uint32_t nbr_slots;     /* ring: FIFO slots of the next rank */
  uint64_t nbr_fifo;      /* ring: address of the next rank's FIFO for this channel */
  uint64_t peer_rec[DFCCL_PEER_CACHE]; /* cached addresses of peers' records */
  uint64_t peer_send[DFCCL_PEER_CACHE]; /* direct path: their published buffers */
  uint64_t peer_recv[DFCCL_PEER_CACHE];
  uint32_t successor;     /* slot + 1 of the next instance of this tag on this
                             block, chained behind this one (0: none) */
  uint32_t channel;       /* the task's channel this block runs */
} dfccl_task_ctx;

#define DFCCL_CTX_FREE 0u
#define DFCCL_CTX_PULLED 1u   /* in the active list, not yet armed */
#define DFCCL_CTX_ARMED 2u    /* may run */
#define DFCCL_CTX_DONE 3u
#define DFCCL_CTX_DOOMED 4u   /* may run, and fails at once: the collective it follows failed */

/* Where one daemon block's time goes (its leader adds, the host reads the
 * totals: Daemon.daemon_profile).  Accumulated across launches. */
typedef struct dfccl_block_profile {
  uint64_t passes;        /* scheduler passes */
  uint64_t runs;          /* task runs (a run ends done, failed or preempted) */
  uint64_t pull_ns;       /* pulling submissions, policy refresh */
  uint64_t pick_ns;       /* quit check and picking the next task */
  uint64_t restore_ns;    /* from the pick to the start of the run */
  uint64_t run_ns;        /* inside runs (their waits included) */
  uint64_t save_ns;       /* saving the context, completing */
  uint64_t idle_ns;       /* nothing runnable */
} dfccl_block_profile;  /* 64 bytes */

/* Where runs spend their time, step by step, per block: counted only by a
 * daemon built with DFCCL_STEP_PROFILE=1 (setup.py), zero otherwise. */
typedef struct dfccl_step_profile {
  uint64_t ll_runs;       /* LL instances finished */
  uint64_t ll_credit_ns;  /* LL PUSH: waiting for credit */
  uint64_t ll_push_ns;    /* LL PUSH: stores into the peers' areas, the record's LL words */
  uint64_t ll_recv_ns;    /* LL RECV: polling this rank's areas for the peers' lines */
  uint64_t ll_finish_ns;  /* LL FINISH: unpacking, reducing, acknowledging (ll_move_ns included) */
  uint64_t complete_ns;   /* any task: completing a channel (result, completion word) */
  uint64_t ll_publish_ns; /* LL: publishing the record (before RECV's wait, or inside ll_move_ns) */
  uint64_t ll_move_ns;    /* of LL FINISH: the movers' reduce or gather, barrier to barrier */
} dfccl_step_profile;  /* 64 bytes */

/* Daemon-wide state in device memory. */
typedef struct dfccl_daemon_state {
  uint64_t quit_epoch;       /* set by block 0: all blocks leave */
  uint64_t last_progress_ns; /* any block, on progress */
  uint64_t blocks_exited;    /* counts blocks leaving one launch */
  /* the host link's copies of the host-written control words */
  uint64_t sq_avail;         /* SQEs copied into the device ring */
  uint64_t link_poll_ns;     /* when the host words were last read */
  uint64_t base_window_ns, max_window_ns, idle_quit_ns, quit_request;
  uint64_t abort_epoch;      /* last abort_epoch mirrored */
  uint32_t link_busy;        /* a block is reading the host words */
  uint32_t link_pad;
  uint64_t bad_tasks;        /* descriptors rejected with DFCCL_STATUS_BAD_TASK */
  uint64_t graph_seq;        /* replays armed: a block scans graph_mask when it moves */
  uint64_t graph_pending;    /* replays armed and not complete: the daemon does not leave */
  uint64_t pad[2];
  uint64_t sq_head[DFCCL_MAX_CHANNELS];    /* per block: SQEs consumed */
  uint32_t active_len[DFCCL_MAX_CHANNELS]; /* per block, stored by its leader whenever it changes
                                              (block 0 reads them all before an empty quit) */
  uint32_t cursor[DFCCL_MAX_CHANNELS];     /* per block round-robin position */
  dfccl_block_profile profile[DFCCL_MAX_CHANNELS];
  dfccl_step_profile steps[DFCCL_MAX_CHANNELS];
  uint32_t block_sm[DFCCL_MAX_CHANNELS];   /* per block: 1 + the SM it ran on at its last launch
                                              (0: not launched, or the simulator) */
} dfccl_daemon_state;

/* One rank of one communicator hosted on this context. */
typedef struct dfccl_endpoint {
  uint32_t rank, nranks;
  uint32_t table_capacity;  /* tag records in each rank's table */
  uint32_t record_stride;   /* DFCCL_RECORD_BYTES, which the daemon uses; filled for images
                               built before that constant (DFCCL_DAEMON_IMAGE loads one) */
  uint64_t comm_key;
  uint64_t reg_table;       /* device, [nranks][DFCCL_REG_SLOTS]: peers' registered allocations as
                               mapped here (0: none); 0 when the communicator has no staged path */
  uint64_t ll_offset;       /* LL region in each rank's arena (docs/architecture.md, "LL") */
  uint32_t ll_max_bytes;    /* LL payload per (sender, receiver); 0 = no LL region */
  uint32_t ll_pad;
  uint64_t net_remote;      /* bit p: rank p is on another host, reached through the network proxy
                               (net.h); its peer_table / peer_arena are this rank's mirror of it */
  uint64_t net_queues;      /* this rank's net queues (net.h), one per daemon block; 0 = no remote peer */
  uint64_t peer_table[DFCCL_MAX_RANKS]; /* each rank's tag table, as mapped here */
  uint64_t peer_arena[DFCCL_MAX_RANKS]; /* each rank's arena base, as mapped here */
  uint64_t owner_words;     /* device, [table_capacity] dfccl_owner_bucket: what only this rank's
                               daemon reads and writes of its records (zeroed at creation) */
} dfccl_endpoint;

/* Everything the daemon needs, passed by pointer at launch. */
typedef struct dfccl_daemon_args {
  dfccl_control *control;          /* host-mapped */
  dfccl_sqe *ring;                 /* host-mapped, ring_size entries (written by the host) */
  dfccl_task_desc *dev_ring;       /* device, ring_size entries (the host link's copy) */
  uint32_t *armed;                 /* device, per slot: written by streams (cuStreamWriteValue32) */
  uint32_t *done;                  /* host-mapped, per slot */
  dfccl_result *results;           /* host-mapped, per slot */
  dfccl_daemon_state *state;       /* device */
  dfccl_task_ctx *ctx;             /* device, [slot][block] */
  uint32_t *active;                /* device, [block][nslots] */
  uint32_t *slot_counter;          /* device, per slot: channel parts finished */
  uint32_t *slot_error;            /* device, per slot: first error status */
  uint32_t *slot_waiting;          /* host-mapped, per slot: +1 rank the task waits for (live; the host zeroes it at submission) */
  dfccl_endpoint *endpoints;       /* device */
  uint32_t *endpoint_abort;        /* host-mapped, per endpoint: nonzero = aborted */
  uint32_t *endpoint_abort_dev;    /* device: the host link's copy */
  uint32_t ring_size;              /* power of two */
  uint32_t nslots;
  uint32_t nblocks;
  uint32_t epoch;                  /* launch epoch */
  uint32_t max_endpoints;
  uint32_t link_ahead;             /* ring entries the host link reads with the control words,
                                      before the tail (0..DFCCL_LINK_AHEAD_MAX) */
  uint32_t link_block;             /* nonzero: the launch has one more block, index nblocks, that
                                      only reads the host link (link.cuh, host_link_block) */
  uint64_t empty_quit_ns;          /* with every block's list empty, quit after this long
                                      without progress (idle_quit_ns applies while work waits) */
  dfccl_task_desc *graph_desc;     /* device, per slot: the replay a graph's arm node pushed */
  uint64_t *graph_count;           /* device, per slot: (binding << 32) | replays armed */
  uint32_t *graph_mask;            /* device, a bit per slot: a replay armed, not complete */
} dfccl_daemon_args;

#define DFCCL_LINK_AHEAD_MAX 3u

/* ---- arena: rank status ------------------------------------------------- */
/* The first DFCCL_ARENA_STATUS_BYTES of every rank's arena: written by the
 * owner's host, read by the peers' daemons (whether a rank they wait for will
 * ever come) and hosts (liveness).  The tag table follows it. */
typedef struct dfccl_rank_status {
  uint64_t state;         /* DFCCL_RANK_* */
  uint64_t heartbeat;     /* bumped by the owner's host while it lives */
  uint64_t pid;           /* owner's process */
  uint64_t pad[5];
} dfccl_rank_status;  /* 64 bytes */

#define DFCCL_ARENA_STATUS_BYTES 256u
#define DFCCL_RANK_LIVE 0u
#define DFCCL_RANK_ABORTED 1u   /* abort(): pending collectives failed, no new ones */
#define DFCCL_RANK_CLOSED 2u    /* close(): no new collectives */
#define DFCCL_RANK_FAILED 3u    /* its device failed: in its host status page only (the device takes no write) */

/* ---- arena: tag records ------------------------------------------------- */
/* A tag record is a 128-byte header followed by one dfccl_chan_state per
 * channel.  Every field a peer reads is written by the owner; every field the
 * owner waits on is written by a peer (flags live at the waiter). */
typedef struct dfccl_record_header {
  uint64_t key;           /* tag key; 0 = never used */
  /* unused: daemon images built before dfccl_owner_bucket kept its words
     here (cache_key, peer_rec, ll_key, ll_inst), and the layout stays */
  uint64_t owner_legacy[1 + DFCCL_PEER_CACHE + 3];
  uint64_t pad[3];
} dfccl_record_header;

typedef struct dfccl_chan_state {
  /* owner-written, peers read (published for one instance) */
  uint64_t ready;         /* token(key, instance) once the fields below are valid */
  uint64_t signature;     /* kind|dtype|op|root|nchannels|nranks */
  uint64_t count;
  uint64_t send_addr;     /* direct path (staged: offset in the owner's arena) */
  uint64_t recv_addr;     /* direct path (staged: offset in the owner's arena) */
  uint64_t fifo;          /* ring path: this channel's FIFO as a fifo word (DFCCL_FIFO_*);
                             direct path: 1 if this rank's collective is in place */
  uint64_t chain_legacy_token; /* unused (dfccl_owner_bucket.chain now; the layout stays) */
  uint64_t slice_bytes;   /* ring path: the planned slice, must match the peers' */
  /* peer-written, owner waits on */
  uint64_t recv_posted;   /* ring: (instance << 32) | slices posted into our FIFO */
  uint64_t send_credit;   /* ring: (instance << 32) | slices the next rank consumed */
  uint64_t phase1;        /* direct: peers done with phase 1 (atomic add) */
  uint64_t phase2;        /* direct: peers done with phase 2 (atomic add) */
  uint64_t abort_token;   /* token of an instance a neighbour aborted */
  uint64_t abort_info;    /* (status << 32) | reporting rank */
  uint64_t chain_legacy_slot;  /* unused (dfccl_owner_bucket.chain now; the layout stays) */
  uint64_t instance;      /* owner-written with `ready`: the instance it names (a rank that
                             left after publishing an instance took part in it) */
} dfccl_chan_state;  /* 128 bytes */

/* What only the owner's daemon reads and writes of one of its records, in
 * device memory (dfccl_endpoint.owner_words, one per bucket): where a rank's
 * arena is host memory (peers on other hosts), each access there is a PCIe
 * round trip, and these are on every instance's path. */
typedef struct dfccl_owner_chain {
  uint64_t token;         /* token of the latest instance of the tag pulled on this channel */
  uint64_t slot;          /* slot + 1 of that instance */
} dfccl_owner_chain;

typedef struct dfccl_owner_bucket {
  /* where the peers' records of this bucket's tag were last met (as mapped
     here), valid while cache_key is the tag's key */
  uint64_t cache_key;
  uint64_t peer_rec[DFCCL_PEER_CACHE];
  /* LL sender side, across the tags that hold the bucket: the tag whose
     lines its areas hold last, and per parity the last instance pushed
     there (0: none since that tag came) */
  uint64_t ll_key;
  uint64_t ll_inst[2];
  uint64_t pad[4];
  dfccl_owner_chain chain[DFCCL_MAX_CHANNELS];  /* per channel (submit.cuh, chain_behind_pending) */
} dfccl_owner_bucket;

#define DFCCL_OWNER_BUCKET_BYTES 640u

#define DFCCL_RECORD_HEADER_BYTES 128u
/* One tag record: its header and a channel state per possible channel.  A
 * constant, so that the daemon finds a record's bucket from its address with
 * a multiplication instead of a 64-bit division routine. */
#define DFCCL_CHAN_STATE_BYTES 128u
#define DFCCL_RECORD_BYTES (DFCCL_RECORD_HEADER_BYTES + DFCCL_MAX_CHANNELS * DFCCL_CHAN_STATE_BYTES)

/* ---- arena: all-to-all split table -------------------------------------- */
/* One per all-to-all instance, at dfccl_task_desc.aux_offset in the owner's
 * arena, written by the owner's host before it submits, read by the owner's
 * and the peers' daemons.  n = nranks, all counts and offsets in elements:
 *   uint64_t send_off[n], send_count[n], recv_off[n], recv_count[n];
 *   uint64_t done[nchannels][n];  peer p stores the instance token into
 *                                 done[c][p] once its channel c has read all
 *                                 it takes from this rank
 * then, 256-byte aligned at DFCCL_A2A_COPY_OFFSET, the copy of the send
 * buffer that peers read when they cannot map it (DFCCL_TASK_STAGED). */
#define DFCCL_A2A_WORDS(nranks, nchannels) (4ull * (nranks) + (uint64_t)(nchannels) * (nranks))
#define DFCCL_A2A_COPY_OFFSET(nranks, nchannels) ((DFCCL_A2A_WORDS(nranks, nchannels) * 8ull + 255ull) / 256ull * 256ull)
/* A fifo word names one channel's receive FIFO in its owner's arena and its
 * shape: bits 0..39 the offset, 40..47 the slot size in 16-byte units, 48..63
 * the slots.  A zero size is the collective's slice_bytes and zero slots its
 * fifo_slots (the planned FIFO).  Every rank may own a FIFO of another shape
 * (a smaller one when its staging is short: docs/architecture.md, "Staging
 * budget"); the ring runs with the smallest slot size of all ranks as its
 * slice, and each rank's FIFO holds at least two of those. */
#define DFCCL_FIFO_OFFSET_MASK ((1ull << 40) - 1ull)
#define DFCCL_FIFO_UNIT_SHIFT 40
#define DFCCL_FIFO_UNIT_BYTES 16u
#define DFCCL_FIFO_UNIT_MAX 255u
#define DFCCL_FIFO_SLOTS_SHIFT 48
#define DFCCL_FIFO_SLOTS_MAX 65535u
/* The low bits of the word a staged direct rank publishes (its staging as
 * the FIFO of the ring the collective falls back to): in place, and no
 * staged copies (its staging was short: every rank runs the ring).  The
 * host sets DFCCL_FIFO_NO_STAGE in such a rank's dfccl_task_desc.fifo_offset. */
#define DFCCL_FIFO_IN_PLACE 1ull
#define DFCCL_FIFO_NO_STAGE 2ull
#define DFCCL_FIFO_FLAG_MASK 3ull

#if !defined(__CUDACC_RTC__)
#ifdef __cplusplus
static_assert(sizeof(dfccl_task_desc) == 112, "dfccl_task_desc layout");
static_assert(sizeof(dfccl_sqe) == 128, "dfccl_sqe layout");
static_assert(sizeof(dfccl_graph_arm) == 120, "dfccl_graph_arm layout");
static_assert(sizeof(dfccl_result) == 64, "dfccl_result layout");
static_assert(sizeof(dfccl_block_profile) == 64, "dfccl_block_profile layout");
static_assert(sizeof(dfccl_step_profile) == 64, "dfccl_step_profile layout");
static_assert(sizeof(dfccl_chan_state) == DFCCL_CHAN_STATE_BYTES, "dfccl_chan_state layout");
static_assert(sizeof(dfccl_rank_status) == 64, "dfccl_rank_status layout");
static_assert(sizeof(dfccl_record_header) == DFCCL_RECORD_HEADER_BYTES, "record header");
static_assert(sizeof(dfccl_owner_bucket) == DFCCL_OWNER_BUCKET_BYTES, "dfccl_owner_bucket layout");
static_assert(sizeof(dfccl_endpoint) == 64 + 2 * 8 * DFCCL_MAX_RANKS + 8, "dfccl_endpoint layout");
#endif
#endif

#endif /* DFCCL_ABI_H */
