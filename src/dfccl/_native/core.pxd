# The host runtime's C state, shared by its modules: structures only.
#   tag_table: tag_core / tag_state (a rank's tags; the table owns them)
#   descriptor: plan_t (a collective bound to its buffers)
#   hotpath, completion, retire, inspect, graphs, daemon: daemon_core / slot_rec (a device's
#     daemon: slots, ring, launches; the daemon owns them)
# Both shared structures are reference counted, so that a slot or a C
# handle in flight keeps what it points at, whatever Python frees.
from cpython.pythread cimport PyThread_type_lock
from cpython.ref cimport PyObject
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t

from dfccl._native.abi cimport (dfccl_control, dfccl_daemon_args, dfccl_result, dfccl_sqe, dfccl_task_desc)


cdef enum:
    NO_SLOT = 0xffffffff


# ---- tags -------------------------------------------------------------------
# How an instance's channels use its tag's staging (kind, dtype, path,
# registered input, channels | count | flags, slice | FIFO slots): instances
# whose layouts are equal use the same part of it on every channel.
cdef struct tag_layout:
    uint64_t w[4]


cdef struct tag_state:
    uint64_t key
    int64_t bucket             # -1: none bound
    uint64_t submitted         # instances taken (the last instance number)
    uint64_t pending           # taken and not released
    int64_t fifo               # staging shared by the tag's instances; -1: none
    uint64_t fifo_bytes
    uint64_t last_slot_gen     # ((slot + 1) << 32) | gen of the latest instance with staging
    uint32_t retired_fifos     # smaller FIFOs pending instances still use (listed by the table)
    uint8_t live               # the table holds it under `key` (else free for reuse)
    uint8_t poisoned           # an instance failed: bucket and staging stay bound for good
    uint8_t transient          # forgotten once nothing is pending
    uint8_t idle               # on the idle list
    uint8_t has_layout
    tag_layout layout
    tag_state *idle_prev
    tag_state *idle_next       # also the free list's link


cdef struct tag_core:
    uint32_t refs              # the table, and every slot holding one of its instances
    uint32_t capacity
    uint8_t closed             # its communicator rank closed or aborted: nothing more is submitted
    PyThread_type_lock lock
    uint64_t *owner            # per bucket: the key bound to it (0: free)
    uint8_t *keyed             # per bucket: the daemon has surely written a key there
    uint64_t used              # buckets of tags with pending instances (or poisoned)
    uint64_t nidle
    tag_state *idle_head       # bound tags with nothing pending, oldest first
    tag_state *idle_tail
    tag_state *free_states
    tag_state **chunks         # every state ever allocated, CHUNK at a time
    uint32_t nchunks
    PyObject *py_table         # the TagTable (borrowed; NULL once it is gone): the rare paths


cdef struct tag_grant:
    int64_t bucket
    uint64_t instance
    uint64_t offset
    uint64_t shape             # the FIFO's shape bits of a fifo word (abi.h, DFCCL_FIFO_*; 0: as planned)
    uint64_t after
    uint8_t keyed


# ---- a bound collective -----------------------------------------------------
cdef struct plan_t:
    dfccl_task_desc desc       # what every instance shares (first_block included)
    uint32_t block_offset      # added to the tag's hash to place channel 0 (dfccl_first_block)
    daemon_core *core          # the daemon it was bound to (set by the daemon)
    tag_core *tags
    tag_state *tag             # the tag's state when last seen (checked at every use)
    PyObject *descriptor       # the TaskDescriptor that owns this (borrowed)
    uint64_t key
    uint64_t staging_bytes
    uint64_t aux_offset        # staging this instance has alone (an all-to-all's split table)
    uint64_t aux_bytes
    uint64_t stream
    uint64_t follows           # ((slot + 1) << 32) | gen of a collective of this daemon this instance runs
                               # after (a hierarchical collective's part before it: hierarchy.py); 0: none
    uint8_t chained            # `follows` is the part before in one hierarchical collective: fail if it
                               # failed (DFCCL_TASK_FOLLOWS); else only an order (the last collective of
                               # the tag before this one, hierarchy.py)
    uint8_t followed           # a collective will follow this instance (its slot is kept for it)
                               # (the three set for one submission by Daemon.submit, never kept)
    tag_layout layout
    uint8_t has_stream
    uint8_t transient
    uint8_t has_layout


# ---- a device's daemon ------------------------------------------------------
cdef enum slot_state:
    SLOT_FREE = 0
    SLOT_BUSY = 1              # submitted and not retired
    SLOT_RETIRED = 2           # retired; a C handle not released yet holds it
    SLOT_GRAPH = 3             # a collective captured in a CUDA graph holds it while the graph lives


cdef struct slot_rec:
    uint32_t gen
    uint32_t seen_done         # gen the watcher saw completed, unretired, at its last look
    uint32_t endpoint
    uint32_t position          # index in daemon_core.outstanding while busy
    uint32_t status            # dfccl_status once retired (or failed on the host)
    int32_t detail
    uint8_t state              # slot_state
    uint8_t by_work            # a Python Work retires it (else a C handle)
    uint8_t released           # its C handle was released before it retired
    uint8_t abandoned          # failed on the host; the daemon still holds it
    uint8_t stream_waited      # a stream waits for it and it is not seen complete
    uint8_t retire_soon        # retire at first sight (it has done-callbacks)
    uint8_t followed           # a collective runs after this one (DFCCL_TASK_FOLLOWS): not unlinked before
                               # that one is, so that the daemon reads this one's result, not a successor's
    uint32_t follows           # slot + 1 of the followed collective this one runs after (0: none) ...
    uint32_t follows_gen       # ... and its generation
    PyObject *work             # the Work (a strong reference); NULL until attached
    tag_core *tags             # a reference, dropped when the tag's instance is released
    tag_state *tag
    uint64_t key
    uint64_t aux_offset
    uint64_t aux_bytes


cdef struct daemon_core:
    uint32_t refs              # the Daemon, and every C handle not released
    uint32_t nblocks
    uint32_t nslots
    uint32_t ring_size
    uint8_t closed
    uint8_t fault_handled      # every collective pending at the fault has been failed
    uint8_t watch_stop
    uint8_t pol_adaptive
    uint8_t pol_due            # the policy has a period's observations to adapt to
    int forked_from            # in a forked child: the parent's pid
    int device_fault           # the device's error code once it failed under the daemon
    uint32_t fault_word        # nonzero once device_fault is set: what waiters poll
    dfccl_control *ctrl
    dfccl_sqe *ring
    uint32_t *done
    dfccl_result *results
    uint32_t *waiting          # per slot: the daemon's live "waiting for" word
    uint32_t *ep_abort
    uint64_t armed_dev
    uint64_t done_dev
    dfccl_daemon_args args
    uint64_t tail
    uint64_t epoch
    uint64_t launches
    uint64_t exit_seen_ns
    slot_rec *slots
    uint32_t *outstanding
    uint32_t n_outstanding
    uint32_t *free_stack
    uint32_t n_free
    uint32_t n_stream_waited   # mirrored in ctrl.stream_waits for the daemon
    uint32_t n_graph_slots     # slots held by captured collectives: the watcher watches graph_arms
    uint32_t n_graph_errors    # failed replays seen and not raised yet (Daemon.check_graphs)
    uint64_t graph_arms_launched   # ctrl.graph_arms when the daemon was last launched
    PyThread_type_lock lock          # slots and the outstanding list
    PyThread_type_lock launch_lock
    PyThread_type_lock submit_lock   # one submission at a time: a tag's instance, a slot, an entry
    PyThread_type_lock watch_wake
    uint32_t watch_token
    uint32_t watch_streak            # relaunches in a row after which nothing retired
    uint64_t watch_retired_mark
    uint64_t retired_count
    uint64_t relaunch_backoff_ns
    uint64_t fault_next_ns
    uint64_t pol_period_ns
    uint64_t pol_min_completions
    uint64_t pol_last_ns
    uint64_t pol_completions
    uint64_t pol_preemptions
    uint64_t *pol_waits
    uint32_t pol_nwaits
    PyObject *device           # the Device (borrowed; NULL once the Daemon is gone)
    PyObject *py_daemon        # the Daemon (borrowed; NULL once it is gone): the rare paths
