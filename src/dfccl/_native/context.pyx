# cython: language_level=3
"""Host runtime of one daemon: the submission descriptor, the submission
ring, completion slots, daemon launches (and relaunches after an idle quit),
and retirement.

Data path, host side: Context.submit() writes an SQE, publishes it and
returns the Work (work.pyx) (submit); the daemon schedules and transfers; the
daemon writes done[slot] (complete), which Work.synchronize() observes (or,
for a collective nobody waits for, the context's watcher, which wakes the
progress thread), and Context._retire() moves the result into the Work and
gives the slot and the tag's record back.
"""

import threading
import time
import warnings

from cpython.pythread cimport (PyThread_type_lock, PyThread_allocate_lock, PyThread_free_lock,
                               PyThread_acquire_lock, PyThread_release_lock, NOWAIT_LOCK,
                               WAIT_LOCK)
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport calloc, free
from libc.string cimport memcpy, memset

from dfccl._native.abi cimport *
from dfccl._native.backend cimport Backend
from dfccl._native.work cimport NO_SLOT, Work

cdef extern from "pythread.h":
    ctypedef enum PyLockStatus:
        PY_LOCK_FAILURE = 0
        PY_LOCK_ACQUIRED = 1
    PyLockStatus PyThread_acquire_lock_timed(PyThread_type_lock lock, long long microseconds, int intr_flag) nogil

from dfccl._native.progress import progress as _progress
from dfccl.errors import BackendError, ClosedError, InvalidArgumentError, ResourceError


# Status codes of dfccl_result (abi.h), for Python.
STATUS_OK = DFCCL_STATUS_OK
STATUS_MISMATCH = DFCCL_STATUS_MISMATCH
STATUS_PEER_ABORTED = DFCCL_STATUS_PEER_ABORTED
STATUS_ABORTED = DFCCL_STATUS_ABORTED
STATUS_BAD_TASK = DFCCL_STATUS_BAD_TASK
STATUS_PEER_LOST = DFCCL_STATUS_PEER_LOST
NUM_KINDS = DFCCL_NUM_KINDS
NUM_DTYPES = DFCCL_NUM_DTYPES
NUM_OPS = DFCCL_NUM_OPS
NUM_PATHS = DFCCL_NUM_PATHS
# The rank status at the start of every arena (abi.h, dfccl_rank_status).
ARENA_STATUS_BYTES = DFCCL_ARENA_STATUS_BYTES
RANK_LIVE = DFCCL_RANK_LIVE
RANK_ABORTED = DFCCL_RANK_ABORTED
RANK_CLOSED = DFCCL_RANK_CLOSED
RANK_FAILED = DFCCL_RANK_FAILED

KIND_ALL_REDUCE = DFCCL_ALL_REDUCE
KIND_ALL_GATHER = DFCCL_ALL_GATHER
KIND_REDUCE_SCATTER = DFCCL_REDUCE_SCATTER
KIND_BROADCAST = DFCCL_BROADCAST
KIND_REDUCE = DFCCL_REDUCE
KIND_SEND = DFCCL_SEND
KIND_RECV = DFCCL_RECV
KIND_ALL_TO_ALL = DFCCL_ALL_TO_ALL
PATH_DIRECT = DFCCL_PATH_DIRECT
PATH_RING = DFCCL_PATH_RING
TASK_ONE_SHOT = DFCCL_TASK_ONE_SHOT
TASK_STAGED = DFCCL_TASK_STAGED
TASK_LL = DFCCL_TASK_LL
MAX_CHANNELS = DFCCL_MAX_CHANNELS
MAX_RANKS = DFCCL_MAX_RANKS
RECORD_HEADER_BYTES = DFCCL_RECORD_HEADER_BYTES


cdef size_t _chan_instance_offset():
    cdef dfccl_chan_state cs
    return <size_t>(<char *>&cs.instance - <char *>&cs)


# Where a channel state names the instance it published (host diagnostics
# probe as the daemon does).
CHAN_INSTANCE_OFFSET = _chan_instance_offset()
CHAN_STATE_BYTES = sizeof(dfccl_chan_state)


_MASK64 = (1 << 64) - 1


# The daemon's hashes (dfccl/hash.h) from the same C, for Python; they work
# on the low 64 bits of their arguments, like the C.
def mix64(x):
    """splitmix64's finaliser."""
    return dfccl_mix64(<uint64_t>(x & _MASK64))


def home_bucket(key, uint32_t capacity):
    """Where probing for a tag's record starts."""
    if capacity == 0:
        raise ValueError("capacity must be positive")
    return dfccl_home_bucket(<uint64_t>(key & _MASK64), capacity)


def instance_token(key, instance):
    """The daemon's name of one instance of a tag."""
    return dfccl_instance_token(<uint64_t>(key & _MASK64), <uint64_t>(instance & _MASK64))


def first_block(key, uint32_t endpoint, uint32_t nblocks):
    """The daemon block that runs channel 0 of the tag's instances on the
    endpoint (dfccl/hash.h; Context.submit sets it)."""
    if nblocks == 0:
        raise ValueError("nblocks must be positive")
    return dfccl_first_block(<uint64_t>(key & _MASK64), endpoint, nblocks)


# The progress thread's wake-up: a binary semaphore that C code without the
# GIL (a context's watcher) can release.  Taken at import: "nothing to do".
cdef PyThread_type_lock _progress_sem = PyThread_allocate_lock()
# What collectives pending when their context closed under a daemon that
# would not leave kept alive: that daemon may still touch them, and its
# memory is kept mapped too (Context.close), for the life of the process.
cdef list _kept_for_running_daemons = []
cdef uint32_t _progress_token = 0
PyThread_acquire_lock(_progress_sem, WAIT_LOCK)


cdef void signal_progress() noexcept nogil:
    """Wakes the progress thread (at most one wake-up outstanding)."""
    if dfccl_exchange_u32(&_progress_token, 1) == 0:
        PyThread_release_lock(_progress_sem)


def wake_progress():
    """Wakes the progress thread: callbacks or retirements are due."""
    signal_progress()


def wait_progress(double timeout):
    """The progress thread's sleep: returns True when woken, False after
    ``timeout`` seconds; without the GIL meanwhile."""
    cdef long long us = <long long>(timeout * 1e6)
    cdef bint woken
    with nogil:
        woken = PyThread_acquire_lock_timed(_progress_sem, us, 0) == PY_LOCK_ACQUIRED
        if woken:
            dfccl_exchange_u32(&_progress_token, 0)
    return woken


cdef inline void _acquire(PyThread_type_lock lock) noexcept:
    """Takes a context lock without holding the GIL while blocked: its holder
    may need the GIL to finish (any allocation can run the garbage collector,
    and with it Python code that lets other threads in)."""
    if not PyThread_acquire_lock(lock, NOWAIT_LOCK):
        with nogil:
            PyThread_acquire_lock(lock, WAIT_LOCK)


cdef inline uint64_t _align(uint64_t x, uint64_t a):
    return (x + a - 1) // a * a


# ---------------------------------------------------------------------------
# Task descriptors
# ---------------------------------------------------------------------------
cdef class TaskDescriptor:
    """One collective as the daemon runs it: a dfccl_task_desc (abi.h) less
    what each instance adds (slot, generation, instance number, tag record,
    staging), plus what the host needs to name and retire it.  Built once per
    bound plan, or once per plain call; Context.submit() turns it into a
    running instance and its Work."""

    cdef dfccl_task_desc desc
    cdef readonly str kind
    cdef readonly object tag
    cdef readonly int rank
    cdef readonly uint64_t key
    cdef readonly bint transient
    cdef readonly uint64_t staging_bytes
    cdef bint has_stream
    cdef uint64_t stream
    cdef readonly object owners
    cdef object tags
    cdef object layout
    cdef object instance_staging

    cdef object staging_layout(self):
        """How the collective's channels use its staging (TagTable.acquire_staged):
        equal for instances whose every channel uses the same part of it."""
        if self.layout is None:
            self.layout = (self.desc.kind, self.desc.dtype, self.desc.path, self.desc.flags, self.desc.nchannels,
                           self.desc.count, self.desc.slice_bytes, self.desc.fifo_slots, self.desc.send_reg != 0)
        return self.layout

    def __init__(self, *, str kind, object tag, int rank, uint64_t key, bint transient, object tags,
                 uint32_t endpoint, int kind_code, int dtype, int op, int path, int root, int nchannels,
                 uint64_t send_addr, uint64_t recv_addr, uint64_t count, uint32_t slice_bytes=0,
                 uint32_t fifo_slots=0, uint32_t flags=0, uint64_t staging_bytes=0, object stream=None,
                 object owners=None, uint64_t send_reg=0, uint64_t aux_offset=0, uint64_t aux_bytes=0):
        memset(&self.desc, 0, sizeof(dfccl_task_desc))
        self.desc.send_reg = send_reg
        self.desc.send_addr = send_addr
        self.desc.recv_addr = recv_addr
        self.desc.count = count
        self.desc.tag_key = key
        self.desc.endpoint = endpoint
        self.desc.slice_bytes = slice_bytes
        self.desc.fifo_slots = fifo_slots
        self.desc.flags = flags
        self.desc.root = root
        self.desc.nchannels = nchannels
        self.desc.kind = kind_code
        self.desc.dtype = dtype
        self.desc.op = op
        self.desc.path = path
        self.desc.aux_offset = aux_offset
        self.kind = kind
        self.tag = tag
        self.rank = rank
        self.key = key
        self.transient = transient
        self.tags = tags
        self.staging_bytes = staging_bytes
        self.layout = None
        self.has_stream = stream is not None
        self.stream = 0 if stream is None else <uint64_t>stream
        self.owners = owners
        # Staging this instance has alone (an all-to-all's split table): the
        # tag table takes it back when the instance retires.
        self.instance_staging = (aux_offset, aux_bytes) if aux_bytes else None

    @property
    def nchannels(self):
        return self.desc.nchannels

    @property
    def count(self):
        return self.desc.count

    @property
    def dtype(self):
        return self.desc.dtype

    @property
    def path(self):
        return self.desc.path

    @property
    def flags(self):
        return self.desc.flags

    def __repr__(self):
        return f"<dfccl.TaskDescriptor {self.kind} tag={self.tag!r} rank={self.rank} count={self.desc.count}>"


cdef int _override_fields(dfccl_task_desc *d, dict fields) except -1:
    """Tests only: writes named descriptor fields as given (no checks)."""
    for name, value in fields.items():
        if name == "kind": d.kind = <uint8_t>value
        elif name == "dtype": d.dtype = <uint8_t>value
        elif name == "op": d.op = <uint8_t>value
        elif name == "path": d.path = <uint8_t>value
        elif name == "nchannels": d.nchannels = <uint16_t>value
        elif name == "root": d.root = <uint16_t>value
        elif name == "endpoint": d.endpoint = <uint32_t>value
        elif name == "bucket": d.bucket = <uint32_t>value
        elif name == "slot": d.slot = <uint32_t>value
        elif name == "instance": d.instance = <uint64_t>value
        elif name == "slice_bytes": d.slice_bytes = <uint32_t>value
        elif name == "fifo_slots": d.fifo_slots = <uint32_t>value
        elif name == "count": d.count = <uint64_t>value
        elif name == "first_block": d.first_block = <uint32_t>value
        else:
            raise InvalidArgumentError(f"raw descriptor field {name!r} is not one a test may set")
    return 0


# ---------------------------------------------------------------------------
# Context
# ---------------------------------------------------------------------------
cdef enum:
    # How often the watcher of a busy context looks at the completion words
    # and the daemon's state (the relaunch backoff is measured in time, not
    # in looks).
    WATCH_POLL_NS = 100000
    # Longest waits the policy keeps per period.
    POLICY_WAITS = 4096
    # A daemon that leaves again and again with nothing retired in between
    # (its peers are absent) is brought back after a backoff that doubles each
    # time, up to this many doublings: it does not spin the device (or, in the
    # simulator, the CPU) at full duty for collectives that cannot move.
    WATCH_BACKOFF_DOUBLINGS = 4
    # How often the watcher of a busy context asks the device whether it has
    # failed (Backend.query_fault: one driver call).
    FAULT_POLL_NS = 100000000
    # How long the host waits for a quitting daemon to decide whether it
    # stays (it re-reads two host words: microseconds).
    DECIDE_NS = 50000000


cdef class Context:
    """The daemon of one device in this process, shared by every communicator
    (and every rank) this process runs on that device."""

    cdef readonly Backend backend
    cdef readonly uint32_t nblocks
    cdef readonly uint32_t nslots
    cdef readonly uint32_t max_endpoints
    cdef readonly bint link_block      # the daemon has a link block (link.cuh)
    cdef dfccl_control *ctrl
    cdef dfccl_sqe *ring
    cdef uint32_t *done
    cdef dfccl_result *results
    cdef uint32_t *ep_abort
    cdef uint64_t mapped_host
    cdef readonly uint64_t mapped_dev
    cdef readonly uint64_t done_dev
    cdef uint64_t armed_dev
    cdef uint32_t *waiting            # per slot: the daemon's live "waiting for" word (host-mapped)
    cdef uint8_t *stream_waited       # per slot: a stream waits for it and it is not seen complete
    cdef uint32_t n_stream_waited     # how many (mirrored in ctrl.stream_waits for the daemon)
    cdef uint64_t device_mem
    cdef uint64_t endpoints_dev
    cdef dfccl_daemon_args args
    cdef uint64_t tail
    cdef uint32_t ring_size
    cdef readonly uint64_t epoch
    cdef uint32_t *gens
    cdef uint32_t *outstanding
    cdef uint32_t *position
    cdef uint32_t n_outstanding
    cdef uint32_t *free_stack
    cdef uint32_t n_free
    cdef list slot_work
    cdef list free_endpoints
    cdef dict draining_endpoints      # id -> on_released: removed, the daemon still holds collectives of it
    cdef PyThread_type_lock lock
    cdef PyThread_type_lock launch_lock
    cdef PyThread_type_lock submit_lock
    cdef PyThread_type_lock watch_wake
    cdef uint32_t watch_token
    cdef readonly object policy
    cdef readonly bint closed
    cdef readonly int forked_from      # in a forked child: the parent's pid (0: this process's own)
    cdef readonly int device_fault     # the device's error code once it failed under the daemon (0: none)
    cdef uint32_t fault_word           # nonzero once device_fault is set: what a waiting synchronize() polls
    cdef bint fault_handled            # every Work pending at the fault has been failed
    cdef uint64_t fault_next_ns        # the watcher's next query_fault()
    cdef bint watch_stop
    cdef uint32_t *seen_done           # per slot: gen the watcher saw completed, unretired, last look
    cdef uint8_t *retire_soon          # per slot: retire at first sight (it has done-callbacks)
    # The policy's observations since its last adaptation (gathered in C at
    # retirement; policy.adapt() sees them once per period).
    cdef bint pol_adaptive
    cdef uint64_t pol_period_ns, pol_min_completions, pol_last_ns, pol_completions, pol_preemptions
    cdef uint64_t *pol_waits
    cdef uint32_t pol_nwaits
    cdef uint32_t watch_streak         # relaunches in a row after which nothing retired
    cdef uint64_t watch_retired_mark   # retired at the watcher's last relaunch
    cdef uint64_t retired_count        # works retired so far
    cdef object watcher
    cdef uint64_t exit_seen_ns
    cdef readonly uint64_t relaunch_backoff_ns
    cdef readonly uint64_t launches
    cdef readonly dict diagnostics
    cdef object __weakref__

    def __cinit__(self):
        self.lock = PyThread_allocate_lock()
        self.launch_lock = PyThread_allocate_lock()
        self.submit_lock = PyThread_allocate_lock()
        # A binary semaphore: taken here, released by _wake_watch.
        self.watch_wake = PyThread_allocate_lock()
        PyThread_acquire_lock(self.watch_wake, WAIT_LOCK)

    def __init__(self, Backend backend, *, int blocks, int slots, int max_endpoints, policy, int link_ahead=0,
                 bint link_block=False):
        cdef uint64_t off, size
        if slots & (slots - 1) or slots < 8:
            raise ValueError("slots must be a power of two >= 8")
        if blocks < 1 or blocks > DFCCL_MAX_CHANNELS:
            raise ValueError(f"blocks must be in 1..{DFCCL_MAX_CHANNELS}")
        if link_ahead < 0 or link_ahead > <int>DFCCL_LINK_AHEAD_MAX:
            raise ValueError(f"link_ahead must be in 0..{DFCCL_LINK_AHEAD_MAX}")
        self.backend = backend
        self.nblocks = blocks
        self.nslots = slots
        self.max_endpoints = max_endpoints
        self.policy = policy

        # Host-mapped words: control | ring | done | results | waiting | endpoint_abort
        # The ring has twice as many entries as there are slots: an entry is
        # rewritten only once the daemon's host link has copied it, and the
        # link copies only as far as every block has pulled (link.cuh).
        self.ring_size = 2 * slots
        abort_words = _align(max_endpoints, 4)  # the link copies 16 bytes at a time
        off = _align(sizeof(dfccl_control), 256)
        ring_off = off
        off = _align(off + self.ring_size * sizeof(dfccl_sqe), 256)
        done_off = off
        off = _align(off + slots * 4, 256)
        results_off = off
        off = _align(off + slots * sizeof(dfccl_result), 256)
        host_waiting_off = off
        off = _align(off + slots * 4, 256)
        abort_off = off
        size = _align(off + abort_words * 4, 4096)
        host, dev = backend.alloc_mapped(size)
        self.mapped_host = host
        self.mapped_dev = dev
        self.ctrl = <dfccl_control *><uintptr_t>host
        self.ring = <dfccl_sqe *><uintptr_t>(host + ring_off)
        self.done = <uint32_t *><uintptr_t>(host + done_off)
        self.results = <dfccl_result *><uintptr_t>(host + results_off)
        self.ep_abort = <uint32_t *><uintptr_t>(host + abort_off)
        self.waiting = <uint32_t *><uintptr_t>(host + host_waiting_off)
        self.done_dev = dev + done_off

        # Device memory: state | ctx[slot][block] | active[block][slot] | per-slot words | device ring |
        # abort flags | endpoints
        off = _align(sizeof(dfccl_daemon_state), 256)
        ctx_off = off
        off = _align(off + <uint64_t>slots * blocks * sizeof(dfccl_task_ctx), 256)
        active_off = off
        off = _align(off + <uint64_t>blocks * slots * 4, 256)
        counter_off = off
        off = _align(off + slots * 4, 256)
        error_off = off
        off = _align(off + slots * 4, 256)
        armed_off = off
        off = _align(off + slots * 4, 256)
        dev_ring_off = off
        off = _align(off + self.ring_size * sizeof(dfccl_task_desc), 256)
        abort_dev_off = off
        off = _align(off + abort_words * 4, 256)
        ep_off = off
        size = _align(off + <uint64_t>abort_words * sizeof(dfccl_endpoint), 4096)  # the daemon checks indices against abort_words
        self.device_mem = backend.alloc_device(size)
        base = self.device_mem
        self.endpoints_dev = base + ep_off
        self.armed_dev = base + armed_off

        self.args.control = <dfccl_control *><uintptr_t>dev
        self.args.ring = <dfccl_sqe *><uintptr_t>(dev + ring_off)
        self.args.dev_ring = <dfccl_task_desc *><uintptr_t>(base + dev_ring_off)
        self.args.armed = <uint32_t *><uintptr_t>(base + armed_off)
        self.args.done = <uint32_t *><uintptr_t>(dev + done_off)
        self.args.results = <dfccl_result *><uintptr_t>(dev + results_off)
        self.args.endpoint_abort = <uint32_t *><uintptr_t>(dev + abort_off)
        self.args.endpoint_abort_dev = <uint32_t *><uintptr_t>(base + abort_dev_off)
        self.args.state = <dfccl_daemon_state *><uintptr_t>base
        self.args.ctx = <dfccl_task_ctx *><uintptr_t>(base + ctx_off)
        self.args.active = <uint32_t *><uintptr_t>(base + active_off)
        self.args.slot_counter = <uint32_t *><uintptr_t>(base + counter_off)
        self.args.slot_error = <uint32_t *><uintptr_t>(base + error_off)
        self.args.slot_waiting = <uint32_t *><uintptr_t>(dev + host_waiting_off)
        self.args.endpoints = <dfccl_endpoint *><uintptr_t>(base + ep_off)
        self.args.ring_size = self.ring_size
        self.args.nslots = slots
        self.args.nblocks = blocks
        self.args.max_endpoints = abort_words
        self.args.link_ahead = link_ahead
        self.args.link_block = 1 if link_block else 0
        self.link_block = link_block
        self.args.empty_quit_ns = policy.empty_quit_ns
        self.args.epoch = 0

        self.ctrl.base_window_ns = policy.base_window_ns
        self.ctrl.max_window_ns = policy.max_window_ns
        self.ctrl.idle_quit_ns = policy.idle_quit_ns
        self._seed_policy_copies()
        self.relaunch_backoff_ns = policy.relaunch_backoff_ns

        self.gens = <uint32_t *>calloc(slots, sizeof(uint32_t))
        self.outstanding = <uint32_t *>calloc(slots, sizeof(uint32_t))
        self.position = <uint32_t *>calloc(slots, sizeof(uint32_t))
        self.free_stack = <uint32_t *>calloc(slots, sizeof(uint32_t))
        self.seen_done = <uint32_t *>calloc(slots, sizeof(uint32_t))
        self.retire_soon = <uint8_t *>calloc(slots, sizeof(uint8_t))
        self.stream_waited = <uint8_t *>calloc(slots, sizeof(uint8_t))
        self.pol_waits = <uint64_t *>calloc(POLICY_WAITS, sizeof(uint64_t))
        self.pol_adaptive = bool(policy.adaptive)
        self.pol_period_ns = policy.period_ns
        self.pol_min_completions = policy.min_completions
        if (self.gens == NULL or self.outstanding == NULL or self.position == NULL or self.free_stack == NULL
                or self.seen_done == NULL or self.retire_soon == NULL or self.stream_waited == NULL
                or self.pol_waits == NULL):
            raise MemoryError
        for i in range(slots):
            self.free_stack[i] = slots - 1 - i
        self.n_free = slots
        self.slot_work = [None] * slots
        self.free_endpoints = list(range(max_endpoints - 1, -1, -1))
        self.draining_endpoints = {}
        # endpoint id -> what explains its failures from the peers' records
        # (dfccl.diagnostics.EndpointDiagnostics), set by the communicator.
        self.diagnostics = {}
        _progress.register(self)
        self.watcher = threading.Thread(target=self._watch, name="dfccl-watcher", daemon=True)
        self.watcher.start()

    cdef int _seed_policy_copies(self) except -1:
        """The daemon reads the policy from the host link's copies in device
        memory; they hold the initial policy before the first launch."""
        cdef dfccl_daemon_state *st = <dfccl_daemon_state *>calloc(1, sizeof(dfccl_daemon_state))
        if st == NULL:
            raise MemoryError
        try:
            st.base_window_ns = self.ctrl.base_window_ns
            st.max_window_ns = self.ctrl.max_window_ns
            st.idle_quit_ns = self.ctrl.idle_quit_ns
            self.backend.copy_to_device(<uint64_t><uintptr_t>self.args.state, <uint64_t><uintptr_t>st,
                                        sizeof(dfccl_daemon_state))
        finally:
            free(st)
        return 0

    cdef void _abort_flags_changed(self) noexcept:
        """Tells the host link to copy the endpoints' abort flags again."""
        dfccl_fence_seq_cst()
        dfccl_store_release_u64(&self.ctrl.abort_epoch, self.ctrl.abort_epoch + 1)

    def __dealloc__(self):
        free(self.gens)
        free(self.outstanding)
        free(self.position)
        free(self.free_stack)
        free(self.seen_done)
        free(self.retire_soon)
        free(self.stream_waited)
        free(self.pol_waits)
        if self.lock != NULL:
            PyThread_free_lock(self.lock)
        if self.launch_lock != NULL:
            PyThread_free_lock(self.launch_lock)
        if self.submit_lock != NULL:
            PyThread_free_lock(self.submit_lock)

    # -- endpoints -----------------------------------------------------------
    def add_endpoint(self, int rank, int nranks, int table_capacity, int record_stride, uint64_t comm_key,
                     peer_tables, peer_arenas, uint64_t reg_table=0, uint64_t ll_offset=0,
                     uint32_t ll_max_bytes=0):
        """Registers one rank of a communicator with the daemon; returns its id.
        ``reg_table``: the peers' registered allocations as mapped here
        (registration.py); ``ll_offset`` / ``ll_max_bytes``: the LL region of
        every rank's arena (endpoint.py, ll_region_bytes)."""
        cdef dfccl_endpoint ep
        if not self.free_endpoints:
            self.reclaim_endpoints()
        if not self.free_endpoints:
            if self.draining_endpoints:
                raise ResourceError(f"too many communicators on {self.backend.name}:{self.backend.device} "
                                    f"(max_endpoints={self.max_endpoints}; {len(self.draining_endpoints)} of them "
                                    f"closed, but the daemon still runs collectives they abandoned)")
            raise ResourceError(f"too many communicators on {self.backend.name}:{self.backend.device} "
                                f"(max_endpoints={self.max_endpoints})")
        if nranks > DFCCL_MAX_RANKS:
            raise ResourceError(f"communicators are limited to {DFCCL_MAX_RANKS} ranks")
        idx = self.free_endpoints.pop()
        memset(&ep, 0, sizeof(dfccl_endpoint))
        ep.rank = rank
        ep.nranks = nranks
        ep.table_capacity = table_capacity
        ep.record_stride = record_stride
        ep.comm_key = comm_key
        ep.reg_table = reg_table
        ep.ll_offset = ll_offset
        ep.ll_max_bytes = ll_max_bytes
        for i in range(nranks):
            ep.peer_table[i] = peer_tables[i]
            ep.peer_arena[i] = peer_arenas[i]
        self.backend.copy_to_device(self.endpoints_dev + <uint64_t>idx * sizeof(dfccl_endpoint),
                                    <uint64_t><uintptr_t>&ep, sizeof(dfccl_endpoint))
        self.ep_abort[idx] = 0
        self._abort_flags_changed()
        return idx

    def remove_endpoint(self, int idx, on_released=None):
        """Unregisters endpoint ``idx``.  While the daemon still holds
        collectives of it (held_by_daemon: ones an abort abandoned on the
        host), its id stays taken, its device entry stays as it is and
        ``on_released`` (what frees the memory those collectives touch) waits:
        reused at once, the id would run them against another communicator's
        peers.  The endpoint drains; reclaim_endpoints() and close() finish
        it.  Once released, the entry is zeroed, so that a descriptor naming
        it is rejected (DFCCL_STATUS_BAD_TASK), and ``on_released()`` is
        called.  Returns whether it was released now."""
        if idx < 0 or idx >= <int>self.max_endpoints or idx in self.free_endpoints or idx in self.draining_endpoints:
            raise InvalidArgumentError(f"endpoint {idx} is not registered with this context")
        self.diagnostics.pop(idx, None)
        if not self.closed and self.held_by_daemon(idx) > 0:
            self.draining_endpoints[idx] = on_released
            return False
        self._release_endpoint(idx, on_released)
        return True

    def reclaim_endpoints(self):
        """Releases the removed endpoints the daemon has let go of
        (remove_endpoint); returns how many still drain."""
        for idx in list(self.draining_endpoints):
            if self.closed or self.held_by_daemon(idx) == 0:
                entry = self.draining_endpoints.pop(idx, self)   # another thread may be here too
                if entry is not self:
                    self._release_endpoint(idx, entry)
        return len(self.draining_endpoints)

    @property
    def draining(self):
        """The ids of removed endpoints whose collectives the daemon still
        holds (remove_endpoint)."""
        return sorted(self.draining_endpoints)

    def endpoint_entry(self, int idx):
        """(rank, nranks) of endpoint ``idx`` as the daemon reads them from
        device memory; (0, 0) for a released one."""
        cdef dfccl_endpoint ep
        if idx < 0 or idx >= <int>self.max_endpoints:
            raise InvalidArgumentError(f"endpoint {idx} is outside 0..{self.max_endpoints - 1}")
        if self.closed:
            raise ClosedError(f"context {self.backend.name}:{self.backend.device} is closed")
        self.backend.copy_from_device(<uint64_t><uintptr_t>&ep, self.endpoints_dev + <uint64_t>idx * sizeof(dfccl_endpoint),
                                      sizeof(dfccl_endpoint))
        return (ep.rank, ep.nranks)

    def _release_endpoint(self, int idx, on_released):
        cdef dfccl_endpoint ep
        if not self.closed and not self.device_fault:
            memset(&ep, 0, sizeof(dfccl_endpoint))
            self.backend.copy_to_device(self.endpoints_dev + <uint64_t>idx * sizeof(dfccl_endpoint),
                                        <uint64_t><uintptr_t>&ep, sizeof(dfccl_endpoint))
        self.free_endpoints.append(idx)
        if on_released is not None:
            on_released()

    def abort_endpoint(self, int idx, int lost_rank=-1):
        """Every pending and future collective of this endpoint fails with
        AbortedError (peers see PeerAbortedError), or, with ``lost_rank``,
        with PeerLostError naming that rank (whose process died)."""
        cdef uint32_t gen
        if lost_rank >= 0:
            dfccl_store_release_u32(&self.ep_abort[idx], DFCCL_EP_PEER_LOST + <uint32_t>lost_rank)
        else:
            dfccl_store_release_u32(&self.ep_abort[idx], DFCCL_EP_ABORTED)
        self._abort_flags_changed()
        if self.device_fault:
            return   # nothing runs on a failed device: fail_on_fault failed what was pending
        # Unarmed stream-ordered tasks would never run: arm them so they fail.
        _acquire(self.lock)
        try:
            pending = [(self.outstanding[i], self.gens[self.outstanding[i]]) for i in range(self.n_outstanding)]
        finally:
            PyThread_release_lock(self.lock)
        for slot, g in pending:
            gen = g
            self.backend.copy_to_device(self.armed_dev + 4 * <uint64_t>slot, <uint64_t><uintptr_t>&gen, 4)
        self._ensure_running()

    # -- submit --------------------------------------------------------------
    def submit(self, TaskDescriptor task, dict raw_fields=None):
        """Publishes one instance of ``task`` to the daemon (the host half of
        submit) and returns its Work.  Takes the tag's next instance and its
        record (and staging) from the endpoint's tag table; nothing waits for
        peers.  ``raw_fields`` (tests only) overwrites fields of the
        descriptor as the daemon receives it, after every host check: the
        way to show that the daemon rejects a corrupt one."""
        return self._submit(task, raw_fields, task.desc.send_addr, task.desc.recv_addr, task.has_stream,
                            task.stream, task.owners)

    def submit_at(self, TaskDescriptor task, uint64_t send_addr, uint64_t recv_addr, object stream,
                  object owners):
        """submit() of ``task`` on other buffers (and stream): the fast path of
        plain calls, which keep one descriptor per shape and change only
        where it reads and writes.  The caller has checked the buffers as
        submit()'s callers do (memory kind, device, size, overlap)."""
        if stream is None:
            return self._submit(task, None, send_addr, recv_addr, False, 0, owners)
        return self._submit(task, None, send_addr, recv_addr, True, <uint64_t>stream, owners)

    cdef Work _submit(self, TaskDescriptor task, dict raw_fields, uint64_t send_addr, uint64_t recv_addr,
                      bint has_stream, uint64_t stream, object owners):
        cdef Work work
        if self.closed:
            if self.forked_from:
                raise ClosedError(f"context {self.backend.name}:{self.backend.device} belongs to process "
                                  f"{self.forked_from}, which forked this process")
            raise ClosedError(f"context {self.backend.name}:{self.backend.device} is closed")
        if self.device_fault:
            raise self._fault_error()
        if task.desc.nchannels < 1 or task.desc.nchannels > self.nblocks:
            raise ValueError(f"nchannels {task.desc.nchannels} outside 1..{self.nblocks}")
        # One submission at a time per context: communicators on one device
        # share its ring, and threads may drive them concurrently (a tag's
        # instance, a slot and a ring entry are taken and published as one).
        _acquire(self.submit_lock)
        try:
            work = self._submit_locked(task, raw_fields, send_addr, recv_addr, has_stream, stream, owners)
        finally:
            PyThread_release_lock(self.submit_lock)
        # Dekker with the daemon's idle quit (schedule.cuh, should_quit).
        dfccl_fence_seq_cst()
        self._ensure_running()
        # The watcher polls while work is outstanding; it needs a wake-up only
        # when it may have gone to sleep (nothing was pending).
        if self.n_outstanding == 1:
            self._wake_watch()
        return work

    cdef Work _submit_locked(self, TaskDescriptor task, dict raw_fields, uint64_t send_addr, uint64_t recv_addr,
                             bint has_stream, uint64_t stream, object owners):
        """submit() under the submit lock: the tag's instance, a slot and the
        ring entry, published to the daemon."""
        cdef uint32_t slot, gen, bucket
        cdef uint64_t instance, staging, after
        cdef dfccl_task_desc *d
        cdef dfccl_sqe *e
        cdef Work work
        if self.n_free == 0:
            # Completed collectives nobody has retired yet free their slots first.
            self._retire_completed(False)
        if self.n_free == 0:
            raise ResourceError(
                f"{self.nslots} collectives are already outstanding on {self.backend.name}:{self.backend.device}; "
                "raise ContextOptions.max_outstanding or synchronize earlier ones (waiting here could deadlock)")
        bucket, instance, staging, after, keyed = task.tags.acquire_staged(
            task.key, task.transient, task.staging_bytes, task.staging_layout() if task.staging_bytes else None)
        work = Work.__new__(Work)
        work._ctx = self
        work._keepalive = owners
        work._tags = task.tags
        work._instance_staging = task.instance_staging
        work._key = task.key
        work.endpoint = task.desc.endpoint
        work.kind = task.kind
        work.tag = task.tag   # None for an untagged one: its instance says which (Work.name)
        work.rank = task.rank
        work.instance = instance
        _acquire(self.lock)
        slot = self.free_stack[self.n_free - 1]
        self.n_free -= 1
        PyThread_release_lock(self.lock)
        gen = self.gens[slot] + 1
        if gen == 0:
            gen = 1
        self.gens[slot] = gen
        self.seen_done[slot] = 0
        self.retire_soon[slot] = 0
        work._slot = slot
        work._gen = gen
        work._done = &self.done[slot]
        work._waiting = &self.waiting[slot]
        work._fault = &self.fault_word
        self.waiting[slot] = 0  # the daemon stores it only while it waits
        try:
            if self.tail >= self.ring_size:
                self._wait_ring_entry(self.tail - self.ring_size)
            e = &self.ring[self.tail & (self.ring_size - 1)]
            d = &e.desc
            memcpy(d, &task.desc, sizeof(dfccl_task_desc))
            d.send_addr = send_addr
            d.recv_addr = recv_addr
            d.instance = instance
            d.fifo_offset = staging
            d.bucket = bucket
            if not keyed:
                d.flags = d.flags | DFCCL_TASK_KEY_BUCKET
            d.slot = slot
            d.gen = gen
            d.after = after
            d.first_block = dfccl_first_block(task.key, task.desc.endpoint, self.nblocks)
            if task.staging_bytes:
                task.tags.note_slot(task.key, ((<uint64_t>slot + 1) << 32) | gen)
            if raw_fields:
                _override_fields(d, raw_fields)
            if has_stream:
                self.backend.stream_write32(stream, self.armed_dev + 4 * slot, gen)
            else:
                d.flags = d.flags | DFCCL_TASK_ARMED
            work.position = self.tail
            work.stream_ordered = has_stream
            # Lets the daemon take the entry in the round trip that reads the tail.
            e.seq = self.tail + 1
            e.check = dfccl_sqe_check(<const uint64_t *>d, e.seq)
        except BaseException:
            _acquire(self.lock)
            self.free_stack[self.n_free] = slot
            self.n_free += 1
            PyThread_release_lock(self.lock)
            task.tags.cancel(task.key)
            raise
        work._submitted_ns = dfccl_now_ns()
        _acquire(self.lock)
        self.slot_work[slot] = work
        self.position[slot] = self.n_outstanding
        self.outstanding[self.n_outstanding] = slot
        self.n_outstanding += 1
        PyThread_release_lock(self.lock)
        self.tail += 1
        dfccl_store_release_u64(&self.ctrl.sq_tail, self.tail)
        return work

    def held_by_daemon(self, uint32_t endpoint):
        """How many collectives of ``endpoint`` the daemon may still be running:
        in their slots, completion word not written, abandoned ones included
        (Context.abandon fails them on the host at once; the daemon lets go
        of them only when it writes their completion word).  Until this is
        zero the endpoint's memory must stay."""
        return sum(1 for w in self.pending_works(endpoint) if not (<Work>w)._device_done())

    def stream_reached(self, Work work, double timeout=0.5):
        """For a stream-ordered collective (``work.stream_ordered``) still in
        its slot: whether its stream has reached it, that is written its armed
        word (for a collective the daemon has taken up, ``submissions``, but
        not started: is it held up by its stream?).  None when it is not
        stream-ordered or no longer in its slot, or when the word could not
        be read within ``timeout`` seconds (the read can be held up behind a
        waiting stream, as every device read of an explanation)."""
        cdef uint32_t value = 0
        cdef uint32_t slot = work._slot
        cdef uint32_t gen = work._gen
        if work._ctx is not self or work._retired or not work.stream_ordered or slot >= self.nslots \
                or self.gens[slot] != gen:
            return None
        try:
            self.backend.read_device(<uint64_t><uintptr_t>&value, self.armed_dev + 4 * <uint64_t>slot, 4, timeout)
        except BackendError:
            return None
        return value == gen

    def pending_works(self, uint32_t endpoint):
        """The Works of ``endpoint`` that have not been retired yet."""
        _acquire(self.lock)
        try:
            out = []
            for i in range(self.n_outstanding):
                w = self.slot_work[self.outstanding[i]]
                if w is not None and (<Work>w).endpoint == endpoint:
                    out.append(w)
            return out
        finally:
            PyThread_release_lock(self.lock)

    def abandon(self, Work work):
        """Fails ``work`` now with AbortedError without waiting for the
        daemon (an abort that must return).  Its slot, tag record and buffers
        stay reserved until the daemon lets go of them; then the slot is
        retired as usual (nothing is reused under a running collective)."""
        cdef uint64_t now = dfccl_now_ns()
        _acquire(self.lock)
        try:
            if work._retired or work._slot == NO_SLOT or self.slot_work[work._slot] is not work:
                return False
            work._fail_on_host(now)
            work._abandoned = True
        finally:
            PyThread_release_lock(self.lock)
        work._error = work._make_error()
        if work._callbacks:
            callbacks, work._callbacks = work._callbacks, None
            _progress.run_callbacks(work, callbacks)
        return True

    @property
    def bad_tasks(self):
        """How many descriptors the daemon rejected (DFCCL_STATUS_BAD_TASK)."""
        cdef dfccl_daemon_state *st = self._copy_daemon_state()
        try:
            return st.bad_tasks
        finally:
            free(st)

    cdef dfccl_daemon_state *_copy_daemon_state(self) except NULL:
        """A host copy of the daemon's state in device memory; the caller frees it."""
        cdef dfccl_daemon_state *st = <dfccl_daemon_state *>calloc(1, sizeof(dfccl_daemon_state))
        if st == NULL:
            raise MemoryError
        try:
            self.backend.copy_from_device(<uint64_t><uintptr_t>st, <uint64_t><uintptr_t>self.args.state,
                                          sizeof(dfccl_daemon_state))
        except BaseException:
            free(st)
            raise
        return st

    cdef int _wait_ring_entry(self, uint64_t position) except -1:
        """Returns once the daemon's host link has copied the ring entry at
        ``position`` (the one about to be rewritten).  It lags that far only
        while one long run holds a block; this waits for it (at most a
        second, the daemon kept running) rather than overwrite what it has
        not read."""
        cdef uint64_t deadline = 0
        while dfccl_load_acquire_u64(&self.ctrl.sq_copied) <= position:
            if deadline == 0:
                deadline = dfccl_now_ns() + 1000000000
            elif dfccl_now_ns() > deadline:
                raise ResourceError(
                    f"the daemon on {self.backend.name}:{self.backend.device} has not taken submission {position} "
                    "for a second (a block is held by one long run); the submission ring cannot take more")
            self._ensure_running()
            with nogil:
                dfccl_sleep_ns(2000)

    cdef bint _leaving(self) noexcept nogil:
        """The daemon has not been launched, or its current launch is
        leaving or gone.  A launch that announced QUITTING is deciding
        (schedule.cuh, should_quit): this waits for its decision, so that no
        launch is queued behind a daemon that stays (on a hardware queue
        shared with an application stream, that launch would hold up the
        stream until the daemon leaves).  A decision that does not come
        within DECIDE_NS (a daemon that died deciding) counts as leaving."""
        cdef uint64_t state, st, deadline = 0
        if self.epoch == 0:
            return True
        while True:
            state = dfccl_load_acquire_u64(&self.ctrl.daemon_state)
            if (state >> DFCCL_DAEMON_EPOCH_SHIFT) != self.epoch:
                return False  # not started yet: it will see what the host wrote
            st = state & DFCCL_DAEMON_STATE_MASK
            if st != DFCCL_DAEMON_QUITTING:
                return st == DFCCL_DAEMON_LEAVING or st == DFCCL_DAEMON_EXITED
            if deadline == 0:
                deadline = dfccl_now_ns() + DECIDE_NS
            elif dfccl_now_ns() > deadline:
                return True
            dfccl_cpu_relax()

    cdef bint _exited(self) noexcept nogil:
        """Every block of the current launch has left."""
        cdef uint64_t state = dfccl_load_acquire_u64(&self.ctrl.daemon_state)
        return ((state >> DFCCL_DAEMON_EPOCH_SHIFT) == self.epoch
                and (state & DFCCL_DAEMON_STATE_MASK) == DFCCL_DAEMON_EXITED)

    cdef int _launch_locked(self) noexcept nogil:
        """Launches the daemon (the launch lock held); returns the backend's
        code, 0 on success."""
        cdef int rc
        self.epoch += 1
        self.args.epoch = <uint32_t>self.epoch
        self.exit_seen_ns = 0
        rc = self.backend.launch(&self.args)
        if rc == 0:
            self.launches += 1
        return rc

    cdef int _ensure_running(self) except -1:
        """Launches the daemon if it has not been launched or is leaving."""
        cdef int rc = 0
        if self.device_fault:
            raise self._fault_error()
        if not self._leaving():
            return 0
        with nogil:
            PyThread_acquire_lock(self.launch_lock, WAIT_LOCK)
            if self._leaving():
                rc = self._launch_locked()
            PyThread_release_lock(self.launch_lock)
        if rc != 0:
            # A launch on a failed device fails with its error: say that.
            if self._record_fault(self.backend.query_fault()):
                raise self._fault_error()
            raise self.backend.launch_error(rc)
        return 0

    def _watch(self):
        """The watcher (a thread per context).  While collectives are
        outstanding it looks every WATCH_POLL_NS at
          - the completion words: a collective seen completed at two looks in
            a row was not retired by a thread waiting for it (at the first
            look if it has done-callbacks), so the watcher wakes the
            progress thread to retire it;
          - the daemon: one that exited while a collective is not complete
            is brought back after the backoff that lets device
            synchronisations return.
        It never takes the GIL: a thread that blocks in a CUDA call while
        holding the GIL (a synchronising torch op waiting for a collective,
        say) must not keep the daemon away, or the collective it waits for
        never runs.  And a thread waiting for a collective never finds the
        GIL taken by a poll."""
        cdef uint64_t now
        cdef int rc = 0, code = 0
        cdef bint unfinished
        with nogil:
            while not self.watch_stop:
                if self.n_outstanding == 0:
                    self.watch_streak = 0
                    # Idle: sleep until a submission makes the context busy
                    # (_wake_watch), looking again at least every 50 ms.
                    if PyThread_acquire_lock_timed(self.watch_wake, 50000, 0) == PY_LOCK_ACQUIRED:
                        dfccl_exchange_u32(&self.watch_token, 0)
                    continue
                dfccl_sleep_ns(WATCH_POLL_NS)
                if self._look(&unfinished) != 0:
                    signal_progress()  # the progress thread retires them
                if self._check_fault():
                    break
                if self.epoch == 0:
                    continue
                if not self._exited():
                    continue
                if not unfinished:
                    # Only completed collectives wait for retirement (which
                    # may wait for the GIL): they do not need the daemon, and
                    # bringing it back would keep the GPU busy for nothing; a
                    # CUDA module load (lazy loading) in a thread holding the
                    # GIL waits for the GPU to be free.
                    self.exit_seen_ns = 0
                    continue
                # Work is left but the daemon quit (idle: peers absent, or
                # tasks not armed yet).  Stay off for a backoff so that device
                # syncs can return, then come back.
                now = dfccl_now_ns()
                if self.exit_seen_ns == 0:
                    self.exit_seen_ns = now
                elif now - self.exit_seen_ns >= self.relaunch_backoff_ns << self.watch_streak:
                    # Nothing retired since the last relaunch: the next
                    # backoff doubles (new submissions launch at once anyway).
                    if self.retired_count == self.watch_retired_mark:
                        if self.watch_streak < WATCH_BACKOFF_DOUBLINGS:
                            self.watch_streak += 1
                    else:
                        self.watch_streak = 0
                    self.watch_retired_mark = self.retired_count
                    PyThread_acquire_lock(self.launch_lock, WAIT_LOCK)
                    if not self.watch_stop and self._leaving():
                        rc = self._launch_locked()
                    PyThread_release_lock(self.launch_lock)
                    if rc != 0:
                        # The daemon cannot come back (a failed device, say):
                        # what is pending would never complete, so it fails
                        # as on a failed device (fail_on_fault).
                        code = self.backend.query_fault()
                        self._record_fault(code if code != 0 else rc)
                        break
        if rc != 0:
            warnings.warn(f"dfccl: relaunching the daemon on {self.backend.name}:{self.backend.device} failed: "
                          f"{self.backend.launch_error(rc)}; its pending collectives fail", RuntimeWarning)

    cdef bint _check_fault(self) noexcept nogil:
        """The watcher, every FAULT_POLL_NS while busy: whether the device
        has failed under the daemon.  A failed device runs no kernel again,
        so nothing pending will complete: the progress thread (and any
        synchronize() waiting, which polls fault_word) fails it all now."""
        cdef uint64_t now = dfccl_now_ns()
        if now < self.fault_next_ns:
            return False
        self.fault_next_ns = now + FAULT_POLL_NS
        return self._record_fault(self.backend.query_fault())

    cdef bint _record_fault(self, int code) noexcept nogil:
        """The device reported ``code`` (nonzero: it has failed): every
        pending Work is to fail (fail_on_fault, on the progress thread or a
        waiting synchronize()), and nothing more is submitted."""
        if code == 0:
            return False
        self.device_fault = code
        dfccl_store_release_u32(&self.fault_word, 1)
        signal_progress()
        return True

    def _fault_error(self):
        return BackendError(
            f"the device {self.backend.name}:{self.backend.device} failed under the dfccl daemon: "
            f"{self.backend.fault_name(self.device_fault)}.  A kernel of this process faulted (an illegal address "
            "from a bad pointer, say: a collective's buffer that is not valid device memory, or another library's "
            "kernel); the device runs nothing more in this process, so every pending collective failed and new ones "
            "are refused: restart the process", driver_code=self.device_fault)

    cdef list _fail_unretired(self, object err, bint completed_too):
        """Fails on the host, with ``err``, every outstanding Work not
        retired yet (and, unless ``completed_too``, not completed by the
        daemon either: those retire as usual); returns them.  Reads no device
        word when ``completed_too``.  The caller holds the lock if others may
        run."""
        cdef Work work
        cdef uint64_t now = dfccl_now_ns()
        cdef list failed = []
        for i in range(self.n_outstanding):
            work = <Work>self.slot_work[self.outstanding[i]]
            if work is None or work._retired:
                continue
            if not completed_too and self._completed(self.outstanding[i]):
                continue
            work._fail_on_host(now)
            work._error = err
            failed.append(work)
        return failed

    def fail_on_fault(self):
        """Fails every pending Work with the device's error (BackendError),
        once the watcher has found the device failed; their slots stay taken
        (nothing will be reused).  Idempotent; a no-op before a fault."""
        cdef Work work
        cdef list failed
        if not dfccl_load_acquire_u32(&self.fault_word):
            return
        err = self._fault_error()
        _acquire(self.lock)
        try:
            if self.fault_handled:
                return
            self.fault_handled = True
            failed = self._fail_unretired(err, False)
            for work in failed:
                work._abandoned = True   # the slot is the daemon's until it lets go
        finally:
            PyThread_release_lock(self.lock)
        for work in failed:
            if work._callbacks:
                callbacks, work._callbacks = work._callbacks, None
                _progress.run_callbacks(work, callbacks)

    cdef inline bint _completed(self, uint32_t s) noexcept nogil:
        """Slot ``s`` holds a collective the daemon has completed."""
        return dfccl_load_acquire_u32(&self.done[s]) == self.gens[s]

    cdef inline bint _due(self, uint32_t s) noexcept nogil:
        """A completed slot the progress thread should retire: the watcher
        saw it completed at its previous look as well, or it is wanted soon."""
        return self.retire_soon[s] or self.seen_done[s] == self.gens[s]

    cdef uint32_t _look(self, bint *unfinished) noexcept nogil:
        """The watcher's look at the completion words: returns how many
        completed slots are due for retirement, marks the others seen, and
        sets ``unfinished`` when some collective has not completed."""
        cdef uint32_t i, s, due = 0
        unfinished[0] = False
        PyThread_acquire_lock(self.lock, WAIT_LOCK)
        for i in range(self.n_outstanding):
            s = self.outstanding[i]
            if not self._completed(s):
                unfinished[0] = True
                continue
            self._drop_stream_wait(s)
            if self._due(s):
                due += 1
            else:
                self.seen_done[s] = self.gens[s]
        PyThread_release_lock(self.lock)
        return due

    cdef int _retire_completed(self, bint due_only) except -1:
        """Retires completed slots: every one, or (the progress thread) those
        the watcher's _look found due."""
        cdef uint32_t i, s
        cdef list finished = []
        _acquire(self.lock)
        for i in range(self.n_outstanding):
            s = self.outstanding[i]
            if self._completed(s) and (not due_only or self._due(s)):
                finished.append(s)
        PyThread_release_lock(self.lock)
        for s in finished:
            self._retire(s)
        return 0

    cdef int _observe(self, Work work) except -1:
        """One retired collective, for the preemption policy (policy.py)."""
        cdef uint64_t now = work._retired_ns
        cdef uint32_t i
        self.pol_completions += 1
        self.pol_preemptions += work._result.preemptions
        if self.pol_nwaits < POLICY_WAITS:
            self.pol_waits[self.pol_nwaits] = work._result.max_wait_ns
            self.pol_nwaits += 1
        if self.pol_completions < self.pol_min_completions or now - self.pol_last_ns < self.pol_period_ns:
            return 0
        waits = [self.pol_waits[i] for i in range(self.pol_nwaits)]
        base = self.policy.adapt(self.pol_completions, self.pol_preemptions, waits)
        self.pol_last_ns = now
        self.pol_completions = self.pol_preemptions = 0
        self.pol_nwaits = 0
        if base is not None:
            self.ctrl.base_window_ns = base
        return 0

    def forget_after_fork(self, int parent_pid):
        """In a forked child: this context is the parent's.  Its daemon, its
        threads and (on GPUs) its pinned memory do not exist here, so the
        child must neither use nor free it: it counts as closed, its locks
        are new (another thread may have held them at the fork), and every
        Work still pending fails now with ClosedError, touching no memory the
        child may not have.  Done-callbacks are dropped (the parent runs
        them).  The backend is runtime.py's to forget."""
        cdef Work work
        self.forked_from = parent_pid
        self.closed = True
        self.watch_stop = True
        self.lock = PyThread_allocate_lock()
        self.launch_lock = PyThread_allocate_lock()
        self.submit_lock = PyThread_allocate_lock()
        self.watch_wake = PyThread_allocate_lock()
        if self.lock == NULL or self.launch_lock == NULL or self.submit_lock == NULL or self.watch_wake == NULL:
            raise MemoryError
        PyThread_acquire_lock(self.watch_wake, WAIT_LOCK)
        err = ClosedError(f"this collective belongs to process {parent_pid}, which forked this process: a "
                          "forked child cannot use its parent's collectives or communicators")
        # The child has one thread: no lock.  Completion words may not be
        # mapped here (pinned memory is not inherited): none is read.
        for work in self._fail_unretired(err, True):
            work._callbacks = None
        self.n_outstanding = 0
        self.diagnostics = {}
        self.draining_endpoints = {}

    def _retire_due(self):
        """The progress thread: retires what the watcher found due (and, once
        the device failed, fails what is pending)."""
        if self.fault_word and not self.fault_handled:
            self.fail_on_fault()
        if self.n_outstanding:
            self._retire_completed(True)

    def _retire_soon(self, uint32_t slot, uint32_t gen):
        """A Work with done-callbacks: due for retirement (and its callbacks)
        at the watcher's first look after completion."""
        _acquire(self.lock)
        if self.gens[slot] == gen:
            self.retire_soon[slot] = 1
        PyThread_release_lock(self.lock)

    cdef void _wake_watch(self) noexcept nogil:
        """Wakes an idle watcher (at most one token outstanding)."""
        if dfccl_exchange_u32(&self.watch_token, 1) == 0:
            PyThread_release_lock(self.watch_wake)

    cdef int _stop_watch(self) except -1:
        """Stops the watcher and waits for it (idempotent)."""
        self.watch_stop = True
        self._wake_watch()
        if self.watcher is not None and self.watcher.is_alive() and self.watcher is not threading.current_thread():
            self.watcher.join()
        return 0

    def _stream_wait(self, uint64_t stream, uint32_t slot, uint32_t gen):
        """Makes ``stream`` wait for the collective in ``slot``, once it
        holds the daemon for it (_hold_for_stream)."""
        self._hold_for_stream(slot, gen)
        self.backend.stream_wait32(stream, self.done_dev + 4 * slot, gen)

    def _hold_for_stream_of(self, Work work):
        """The first half of ``work.wait(stream)`` alone: what the simulator,
        which has no streams, tests of it."""
        self._hold_for_stream(work._slot, work._gen)

    @property
    def stream_waits(self):
        """Incomplete collectives some stream waits for (the daemon stays
        while there are any)."""
        return dfccl_load_acquire_u64(&self.ctrl.stream_waits)

    cdef int _hold_for_stream(self, uint32_t slot, uint32_t gen) except -1:
        """Counts the collective in ``slot`` among those streams wait for
        (ctrl.stream_waits), so that the daemon does not leave before it
        completes, and makes sure the daemon runs: a launch queued after the
        wait might never run (a hardware queue shared with the stream, the
        wait ahead of it).  The count drops when the watcher or retirement
        sees it complete."""
        cdef bint counted = False
        _acquire(self.lock)
        if self.gens[slot] == gen and self.slot_work[slot] is not None and not self.stream_waited[slot] \
                and not self._completed(slot):
            self.stream_waited[slot] = 1
            self.n_stream_waited += 1
            dfccl_store_release_u64(&self.ctrl.stream_waits, self.n_stream_waited)
            counted = True
        PyThread_release_lock(self.lock)
        if counted:
            # Dekker with the daemon's idle quit (schedule.cuh, should_quit).
            dfccl_fence_seq_cst()
            self._ensure_running()
        return 0

    cdef inline void _drop_stream_wait(self, uint32_t s) noexcept nogil:
        """Under the lock: slot ``s`` no longer holds the daemon for a stream."""
        if self.stream_waited[s]:
            self.stream_waited[s] = 0
            self.n_stream_waited -= 1
            dfccl_store_release_u64(&self.ctrl.stream_waits, self.n_stream_waited)

    # -- complete ------------------------------------------------------------
    def _retire(self, uint32_t slot, Work expected=None):
        """Moves a completed slot's result into its Work and frees the slot.
        Idempotent: whoever sees the completion first retires it."""
        cdef Work work
        cdef uint64_t now = dfccl_now_ns()
        _acquire(self.lock)
        try:
            obj = self.slot_work[slot]
            if obj is None or (expected is not None and obj is not expected):
                return
            work = <Work>obj
            if dfccl_load_acquire_u32(&self.done[slot]) != work._gen:
                return
            self._unlink(slot)
            if not work._abandoned:
                work._finish(&self.results[slot], now)
        finally:
            PyThread_release_lock(self.lock)
        self._after_retire(work)

    cdef void _unlink(self, uint32_t slot) noexcept:
        """Under the lock: takes ``slot`` off the outstanding list and frees it."""
        cdef uint32_t last = self.outstanding[self.n_outstanding - 1]
        self._drop_stream_wait(slot)
        self.slot_work[slot] = None
        self.outstanding[self.position[slot]] = last
        self.position[last] = self.position[slot]
        self.n_outstanding -= 1
        self.retired_count += 1
        self.free_stack[self.n_free] = slot
        self.n_free += 1

    cdef int _after_retire(self, Work work) except -1:
        """Outside the lock: the tag's bookkeeping, the policy, callbacks."""
        held, work._keepalive = work._keepalive, None
        if work._abandoned:
            # Failed earlier (abandon); the daemon has let go of it only now.
            if work._tags is not None:
                work._tags.release(work._key, True, work._instance_staging, owners=held)
                work._tags = None
            return 0
        # A mismatch is explained from every rank's record when first asked
        # for (_get_error), by when the peers have published theirs.
        if work._status != DFCCL_STATUS_MISMATCH:
            work._error = work._make_error()
        if work._tags is not None:
            work._tags.release(work._key, work._status != DFCCL_STATUS_OK, work._instance_staging, owners=held)
            work._tags = None
        if self.pol_adaptive:
            self._observe(work)
        if work._callbacks:
            callbacks, work._callbacks = work._callbacks, None
            _progress.run_callbacks(work, callbacks)
        return 0

    @property
    def outstanding_count(self):
        return self.n_outstanding

    @property
    def submissions(self):
        """(published, taken): submission-queue entries the host has published
        and those the daemon's host link has copied to the device.  Taken
        lagging published while the daemon runs means it has not looked at
        the host since."""
        return (dfccl_load_acquire_u64(&self.ctrl.sq_tail), dfccl_load_acquire_u64(&self.ctrl.sq_copied))

    @property
    def daemon_state(self):
        """(epoch, state) as the daemon last published it; state is one of
        'running', 'quitting' (deciding whether to leave), 'leaving',
        'exited' ('idle' before the first launch)."""
        cdef uint64_t v = dfccl_load_acquire_u64(&self.ctrl.daemon_state)
        names = {0: "idle", 1: "running", 2: "quitting", 3: "exited", 4: "leaving"}
        return (v >> DFCCL_DAEMON_EPOCH_SHIFT, names.get(v & DFCCL_DAEMON_STATE_MASK, "?"))

    def daemon_profile(self):
        """Where each daemon block's time went since the context was created
        (cuda/include/dfccl/abi.h, dfccl_block_profile): one dict per block
        with passes, runs and the nanoseconds spent pulling, picking,
        restoring, inside runs, saving and idle; and, from a daemon built with
        DFCCL_STEP_PROFILE=1 (zero otherwise), the step profile
        (dfccl_step_profile: LL runs and the time in each of their steps,
        completing).  Read from device memory while the daemon runs, so the
        figures of a busy block may be a pass apart from one another."""
        cdef dfccl_daemon_state *st = self._copy_daemon_state()
        cdef dfccl_block_profile *p
        cdef dfccl_step_profile *q
        try:
            out = []
            for b in range(self.nblocks):
                p = &st.profile[b]
                q = &st.steps[b]
                out.append({"passes": p.passes, "runs": p.runs, "pull_ns": p.pull_ns, "pick_ns": p.pick_ns,
                            "restore_ns": p.restore_ns, "run_ns": p.run_ns, "save_ns": p.save_ns,
                            "idle_ns": p.idle_ns, "ll_runs": q.ll_runs, "ll_credit_ns": q.ll_credit_ns,
                            "ll_push_ns": q.ll_push_ns, "ll_recv_ns": q.ll_recv_ns,
                            "ll_finish_ns": q.ll_finish_ns, "complete_ns": q.complete_ns,
                            "ll_publish_ns": q.ll_publish_ns, "ll_move_ns": q.ll_move_ns})
            return out
        finally:
            free(st)

    def daemon_sms(self):
        """The SM each daemon block ran on at its last launch (``%smid``), one
        entry per block; None for a block not launched yet, and on the
        simulator.  Blocks that talk through memory on nearby SMs see shorter
        round trips, so this is where to look when timings differ between
        runs."""
        cdef dfccl_daemon_state *st = self._copy_daemon_state()
        try:
            return [st.block_sm[b] - 1 if st.block_sm[b] != 0 else None for b in range(self.nblocks)]
        finally:
            free(st)

    def close(self, timeout=10.0):
        """Stops the daemon (aborting whatever is still pending: those Works
        complete with AbortedError) and frees the context's memory."""
        cdef Work work
        cdef uint32_t slot
        if self.closed:
            return
        self.closed = True
        self._stop_watch()
        _progress.unregister(self)
        for idx in range(self.max_endpoints):
            self.ep_abort[idx] = 1
        self._abort_flags_changed()
        dfccl_store_release_u64(&self.ctrl.quit_request, 1)
        dfccl_fence_seq_cst()
        deadline = time.monotonic() + timeout
        # A failed device never reports the daemon's exit, and its memory
        # cannot be freed: do not wait, keep it.
        exited = not self.device_fault
        if self.epoch != 0 and exited:
            while True:
                if self._exited():
                    break
                if time.monotonic() > deadline:
                    exited = False
                    break
                time.sleep(1e-4)
        # Every Work still pending is retired now, with its result if the
        # daemon finished it, else as aborted: nothing may read this context's
        # memory after it is freed.
        retired = []
        _acquire(self.lock)
        try:
            while self.n_outstanding:
                slot = self.outstanding[self.n_outstanding - 1]
                work = <Work>self.slot_work[slot]
                self._unlink(slot)
                if work._abandoned:
                    pass
                elif exited and dfccl_load_acquire_u32(&self.done[slot]) == work._gen:
                    work._finish(&self.results[slot], dfccl_now_ns())
                else:
                    if not exited:
                        # A daemon that did not leave may still touch its buffers.
                        _kept_for_running_daemons.append(work._keepalive)
                    work._fail_closed(dfccl_now_ns())
                retired.append(work)
        finally:
            PyThread_release_lock(self.lock)
        for work in retired:
            self._after_retire(work)
        if not exited:
            # The daemon did not leave: keep its memory mapped rather than
            # free it under a running kernel.
            return
        # The daemon has left: what draining endpoints kept can go now.
        self.reclaim_endpoints()
        self.backend.synchronize()
        self.backend.free_device(self.device_mem)
        self.backend.free_mapped(self.mapped_host)
        self.device_mem = 0
        self.mapped_host = 0
