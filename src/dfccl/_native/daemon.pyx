# cython: language_level=3
"""A device's daemon in this process: the Daemon.  It lays out the memory
the host and the daemon share (control words, submission ring, completion
slots and results) and the daemon's device memory, registers communicator
ranks (endpoints), submits for Python (a Work per collective), and closes.

Its parts live in their own modules: the C state and launches (launch.pyx),
the hot path that submits, tests and waits (hotpath.pyx, which the C API of
capi.pyx calls too), retirement and the watcher (retire.pyx), its
communicator ranks (endpoints.pyx, DaemonEndpoints), what it shows
(inspection.pyx, DaemonBase), and the descriptor it submits
(descriptor.pyx).  Data path, host side: submit() publishes a ring entry
and returns the Work (work.pyx); the daemon schedules and transfers, then
writes done[slot], which Work.synchronize() observes (or, for a collective
nobody waits for, the watcher, which wakes the progress thread); retirement
moves the result into the Work and gives the slot and the tag's instance
back."""

import threading
import time
import warnings

from dfccl.termination import block_async_signals

from cpython.pythread cimport PyThread_allocate_lock, PyThread_acquire_lock, PyThread_release_lock, WAIT_LOCK
from cpython.ref cimport PyObject, Py_INCREF
from libc.stdint cimport uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport calloc, free
from libc.string cimport memcpy

from dfccl._native.abi cimport *
from dfccl._native.device cimport Device
from dfccl._native.core cimport SLOT_BUSY, SLOT_FREE, SLOT_GRAPH, daemon_core, plan_t, slot_rec, tag_grant
from dfccl._native.descriptor cimport TaskDescriptor
from dfccl._native.hotpath cimport hold_for_stream, stream_wait, submit, submitted_t
from dfccl._native.endpoints cimport DaemonEndpoints
from dfccl._native.launch cimport core_decref, core_new, exited, take_error, wake_watch
from dfccl._native.retire cimport (abandon_handles, abandon_work, adapt_policy, close_slots, fail_unretired, lock_gil,
                                   retire_completed, retire_work, run_callbacks, watch)
from dfccl._native.work cimport Work

from dfccl._native.progress import progress as _progress
from dfccl._native.retire import warn_relaunch_failed
from dfccl.errors import BackendError, ClosedError, NotSupportedError, ResourceError

# What collectives pending when their Daemon closed under a daemon kernel
# that would not leave kept alive: that kernel may still touch them, and its
# memory is kept mapped too (Daemon.close), for the life of the process.
cdef list _kept_for_running_daemons = []


class _CapturedNode:
    """A collective captured in a CUDA graph (Daemon._capture): what it
    holds until the graph is destroyed (``released`` turns 1)."""

    __slots__ = ("slot", "key", "tags", "released", "kind", "tag", "rank", "endpoint", "first_instance", "owners",
                 "aux", "failed", "reported")

    def __init__(self, slot, key, tags, released, kind, tag, rank, endpoint, first_instance, owners, aux):
        self.slot, self.key, self.tags, self.released = slot, key, tags, released
        self.kind, self.tag, self.rank, self.endpoint = kind, tag, rank, endpoint
        self.first_instance, self.owners = first_instance, owners
        self.aux = aux          # (offset, bytes) of staging it has alone (an all-to-all's split table), or None
        self.failed = None      # the error of its last failed replay
        self.reported = 0       # the completion word of that replay


cdef inline uint64_t _align(uint64_t x, uint64_t a):
    return (x + a - 1) // a * a


cdef class Daemon(DaemonEndpoints):
    """The daemon of one device in this process, shared by every communicator
    (and every rank) this process runs on that device."""

    cdef uint64_t mapped_host
    cdef readonly uint64_t mapped_dev
    cdef uint64_t device_mem
    cdef readonly object policy
    cdef readonly bint link_block      # the daemon has a link block (link.cuh)
    cdef object watcher
    cdef dict _graphs             # slot -> _CapturedNode: collectives captured in CUDA graphs
    cdef list _graph_errors       # failed replays seen and not raised yet
    cdef uint64_t _bindings       # captures so far: each binds a slot under a new number
    cdef object __weakref__

    def __init__(self, Device device, *, int blocks, int slots, int max_endpoints, policy, int link_ahead=0,
                 bint link_block=False):
        cdef daemon_core *c
        cdef uint64_t off, size
        if slots & (slots - 1) or slots < 8:
            raise ValueError("slots must be a power of two >= 8")
        if blocks < 1 or blocks > DFCCL_MAX_CHANNELS:
            raise ValueError(f"blocks must be in 1..{DFCCL_MAX_CHANNELS}")
        if link_ahead < 0 or link_ahead > <int>DFCCL_LINK_AHEAD_MAX:
            raise ValueError(f"link_ahead must be in 0..{DFCCL_LINK_AHEAD_MAX}")
        c = self.c = core_new(slots, blocks)
        self.device = device
        c.device = <PyObject *>device
        c.py_daemon = <PyObject *>self
        self.max_endpoints = max_endpoints
        self.policy = policy

        # Host-mapped words: control | ring | done | results | waiting | endpoint_abort
        # The ring has twice as many entries as there are slots: an entry is
        # rewritten only once the daemon's host link has copied it, and the
        # link copies only as far as every block has pulled (link.cuh).
        c.ring_size = 2 * slots
        abort_words = _align(max_endpoints, 4)  # the link copies 16 bytes at a time
        off = _align(sizeof(dfccl_control), 256)
        ring_off = off
        off = _align(off + c.ring_size * sizeof(dfccl_sqe), 256)
        done_off = off
        off = _align(off + slots * 4, 256)
        results_off = off
        off = _align(off + slots * sizeof(dfccl_result), 256)
        host_waiting_off = off
        off = _align(off + slots * 4, 256)
        abort_off = off
        size = _align(off + abort_words * 4, 4096)
        host, dev = device.alloc_mapped(size)
        self.mapped_host = host
        self.mapped_dev = dev
        c.ctrl = <dfccl_control *><uintptr_t>host
        c.ring = <dfccl_sqe *><uintptr_t>(host + ring_off)
        c.done = <uint32_t *><uintptr_t>(host + done_off)
        c.results = <dfccl_result *><uintptr_t>(host + results_off)
        c.ep_abort = <uint32_t *><uintptr_t>(host + abort_off)
        c.waiting = <uint32_t *><uintptr_t>(host + host_waiting_off)
        c.done_dev = dev + done_off

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
        off = _align(off + c.ring_size * sizeof(dfccl_task_desc), 256)
        graph_desc_off = off
        off = _align(off + slots * sizeof(dfccl_task_desc), 256)
        graph_count_off = off
        off = _align(off + slots * 8, 256)
        graph_mask_off = off
        off = _align(off + (slots + 31) // 32 * 4, 256)
        abort_dev_off = off
        off = _align(off + abort_words * 4, 256)
        ep_off = off
        size = _align(off + <uint64_t>abort_words * sizeof(dfccl_endpoint), 4096)  # the daemon checks indices against abort_words
        self.device_mem = device.alloc_device(size)
        base = self.device_mem
        self.endpoints_dev = base + ep_off
        c.armed_dev = base + armed_off

        c.args.control = <dfccl_control *><uintptr_t>dev
        c.args.ring = <dfccl_sqe *><uintptr_t>(dev + ring_off)
        c.args.dev_ring = <dfccl_task_desc *><uintptr_t>(base + dev_ring_off)
        c.args.armed = <uint32_t *><uintptr_t>(base + armed_off)
        c.args.done = <uint32_t *><uintptr_t>(dev + done_off)
        c.args.results = <dfccl_result *><uintptr_t>(dev + results_off)
        c.args.endpoint_abort = <uint32_t *><uintptr_t>(dev + abort_off)
        c.args.endpoint_abort_dev = <uint32_t *><uintptr_t>(base + abort_dev_off)
        c.args.state = <dfccl_daemon_state *><uintptr_t>base
        c.args.ctx = <dfccl_task_ctx *><uintptr_t>(base + ctx_off)
        c.args.active = <uint32_t *><uintptr_t>(base + active_off)
        c.args.slot_counter = <uint32_t *><uintptr_t>(base + counter_off)
        c.args.slot_error = <uint32_t *><uintptr_t>(base + error_off)
        c.args.slot_waiting = <uint32_t *><uintptr_t>(dev + host_waiting_off)
        c.args.endpoints = <dfccl_endpoint *><uintptr_t>(base + ep_off)
        c.args.graph_desc = <dfccl_task_desc *><uintptr_t>(base + graph_desc_off)
        c.args.graph_count = <uint64_t *><uintptr_t>(base + graph_count_off)
        c.args.graph_mask = <uint32_t *><uintptr_t>(base + graph_mask_off)
        c.args.ring_size = c.ring_size
        c.args.nslots = slots
        c.args.nblocks = blocks
        c.args.max_endpoints = abort_words
        c.args.link_ahead = link_ahead
        c.args.link_block = 1 if link_block else 0
        self.link_block = link_block
        c.args.empty_quit_ns = policy.empty_quit_ns
        c.args.epoch = 0

        c.ctrl.base_window_ns = policy.base_window_ns
        c.ctrl.max_window_ns = policy.max_window_ns
        c.ctrl.idle_quit_ns = policy.idle_quit_ns
        self._seed_policy_copies()
        c.relaunch_backoff_ns = policy.relaunch_backoff_ns
        c.pol_adaptive = bool(policy.adaptive)
        c.pol_period_ns = policy.period_ns
        c.pol_min_completions = policy.min_completions

        self._graphs = {}
        self._graph_errors = []
        self.free_endpoints = list(range(max_endpoints - 1, -1, -1))
        self.draining_endpoints = {}
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
            st.base_window_ns = self.c.ctrl.base_window_ns
            st.max_window_ns = self.c.ctrl.max_window_ns
            st.idle_quit_ns = self.c.ctrl.idle_quit_ns
            self.device.copy_to_device(<uint64_t><uintptr_t>self.c.args.state, <uint64_t><uintptr_t>st,
                                       sizeof(dfccl_daemon_state))
        finally:
            free(st)
        return 0

    def __dealloc__(self):
        # C handles may outlive this object: their state stays, closed.
        if self.c != NULL:
            self.c.closed = 1
            self.c.py_daemon = NULL
            self.c.device = NULL
            core_decref(self.c)
            self.c = NULL

    def abandon_handles(self, uint32_t endpoint):
        """C API handles of ``endpoint`` the daemon has not completed fail now
        as aborted (an abort that must return); returns how many."""
        return abandon_handles(self.c, endpoint)

    # -- submit --------------------------------------------------------------
    def submit(self, TaskDescriptor task, dict raw_fields=None):
        """Publishes one instance of ``task`` to the daemon (the host half of
        submit) and returns its Work.  Takes the tag's next instance and its
        record (and staging) from the endpoint's tag table; nothing waits for
        peers.  ``raw_fields`` (tests only) overwrites fields of the
        descriptor as the daemon receives it, after every host check: the
        way to show that the daemon rejects a corrupt one."""
        return self._submit(task, raw_fields, task.plan.desc.send_addr, task.plan.desc.recv_addr,
                            task.plan.has_stream, task.plan.stream, task.owners)

    def submit_at(self, TaskDescriptor task, uint64_t send_addr, uint64_t recv_addr, object stream,
                  object owners):
        """submit() of ``task`` on other buffers (and stream): the fast path of
        plain calls, which keep one descriptor per shape and change only
        where it reads and writes.  The caller has checked the buffers as
        submit()'s callers do (memory kind, device, size, overlap)."""
        if stream is None:
            return self._submit(task, None, send_addr, recv_addr, False, 0, owners)
        return self._submit(task, None, send_addr, recv_addr, True, <uint64_t>stream, owners)

    def c_plan(self, TaskDescriptor task):
        """The address of ``task``'s plan for the C API (dfccl_api.h: a
        const dfccl_plan *), bound to this daemon; valid while ``task``
        lives (or while the C side retains it)."""
        self._bind(task)
        return <uintptr_t>&task.plan

    cdef void _bind(self, TaskDescriptor task):
        task.daemon = self
        task.plan.core = self.c
        task.plan.desc.first_block = dfccl_first_block(task.key, task.plan.block_offset, self.c.nblocks)

    cdef Work _submit(self, TaskDescriptor task, dict raw_fields, uint64_t send_addr, uint64_t recv_addr,
                      bint has_stream, uint64_t stream, object owners):
        cdef submitted_t out
        cdef PyObject *raw = <PyObject *>raw_fields if raw_fields else NULL
        cdef uint64_t now = dfccl_now_ns()
        cdef int rc
        cdef Work work = None
        if task.plan.core != self.c:
            self._bind(task)
        if self.c.ctrl.graph_failed != 0 or self.c.n_graph_errors != 0:
            self.check_graphs()
        if has_stream and self.device.stream_capturing(stream):
            return self._capture(task, send_addr, recv_addr, stream, owners)
        with nogil:
            rc = submit(self.c, &task.plan, send_addr, recv_addr, has_stream, stream, True, raw, &out)
        if out.gen != 0:
            work = self._attach(task, &out, has_stream, owners, now)
            if task.flight is not None:
                task.flight.append((work, task.plan.desc.count, task.plan.desc.dtype))
        if rc < 0:
            raise take_error()
        return work

    cdef Work _attach(self, TaskDescriptor task, submitted_t *out, bint has_stream, object owners, uint64_t now):
        """The Work of the slot just submitted: until it is attached, nobody
        retires the slot."""
        cdef Work work = Work.__new__(Work)
        cdef slot_rec *r = &self.c.slots[out.slot]
        work._daemon = self
        work._keepalive = owners
        work._key = task.key
        work.endpoint = task.plan.desc.endpoint
        work.kind = task.kind
        work.tag = task.tag   # None for an untagged one: its instance says which (Work.name)
        work.rank = task.rank
        work.instance = out.instance
        work.position = out.position
        work.stream_ordered = has_stream
        work._slot = out.slot
        work._gen = out.gen
        work._done = &self.c.done[out.slot]
        work._waiting = &self.c.waiting[out.slot]
        work._fault = &self.c.fault_word
        work._submitted_ns = now
        lock_gil(self.c)
        if r.state == SLOT_BUSY and r.gen == out.gen:
            Py_INCREF(work)
            r.work = <PyObject *>work
        else:
            work._fail_closed(dfccl_now_ns())   # the daemon closed under the submission
        PyThread_release_lock(self.c.lock)
        return work

    # -- CUDA graphs (docs/architecture.md, "CUDA graphs") -------------------
    cdef Work _capture(self, TaskDescriptor task, uint64_t send_addr, uint64_t recv_addr, uint64_t stream,
                       object owners):
        """``task`` captured on ``stream`` (_bind_capture), as a captured Work."""
        cdef Work work
        node = self._bind_capture(task, send_addr, recv_addr, stream, owners)
        work = Work.__new__(Work)
        work._daemon = self
        work._keepalive = owners
        work._key = node.key
        work.endpoint = node.endpoint
        work.kind = task.kind
        work.tag = task.tag
        work.rank = task.rank
        work.instance = node.first_instance
        work.stream_ordered = True
        work.captured = True
        work._slot = node.slot
        work._gen = DFCCL_GRAPH_GEN_BIT
        work._submitted_ns = dfccl_now_ns()
        return work

    def capture_for_handle(self, TaskDescriptor task, uint64_t send_addr, uint64_t recv_addr, uint64_t stream):
        """A C API submission of ``task`` on ``stream`` while it captures a
        CUDA graph (hotpath.submit): captured as the Python API's are; its
        buffers are the caller's to keep valid while the graph lives.
        Returns (slot, first instance) for the handle."""
        if task.plan.core != self.c:
            self._bind(task)
        node = self._bind_capture(task, send_addr, recv_addr, stream, None)
        return node.slot, node.first_instance

    cdef object _bind_capture(self, TaskDescriptor task, uint64_t send_addr, uint64_t recv_addr, uint64_t stream,
                              object owners):
        """``task`` issued on ``stream`` while it captures a CUDA graph: binds
        it once (a tag of its own, its record and staging, a slot) and
        captures its arm node and the wait for it, so that every replay runs
        the tag's next instance (cuda/daemon/graph.cuh).  An all-to-all's
        split table (``task.plan.aux_offset``, written before the capture
        and never by a replay) becomes the graph's: every replay reads the
        counts captured, and its done flags carry each replay's token.
        Returns its _CapturedNode."""
        cdef plan_t plan
        cdef tag_grant g
        cdef dfccl_graph_arm arm
        cdef dfccl_task_desc *d = &arm.desc
        cdef uint32_t slot
        cdef uint32_t *released
        cdef daemon_core *c = self.c
        if c.closed or c.device_fault or task.plan.tags.closed:
            raise self._refusal(task.plan.desc.nchannels) if not task.plan.tags.closed else ClosedError(
                "the communicator rank of this collective is closed or aborted")
        self._reap_graphs()
        memcpy(&plan, &task.plan, sizeof(plan_t))
        plan.key = task.tags.graph_key(task.key)
        plan.desc.tag_key = plan.key
        plan.desc.first_block = dfccl_first_block(plan.key, plan.block_offset, c.nblocks)
        task.tags.acquire_c(plan.key, False, plan.staging_bytes, &plan.layout, plan.has_layout, &g)
        try:
            slot = self._take_graph_slot()
        except BaseException:
            task.tags.release(plan.key, False, None, False)
            raise
        memcpy(d, &plan.desc, sizeof(dfccl_task_desc))
        d.send_addr = send_addr
        d.recv_addr = recv_addr
        d.instance = g.instance
        d.fifo_offset = g.offset | g.shape
        d.bucket = <uint32_t>g.bucket
        d.flags = d.flags | DFCCL_TASK_ARMED | DFCCL_TASK_GRAPH | (0 if g.keyed else DFCCL_TASK_KEY_BUCKET)
        d.slot = slot
        d.gen = 0
        d.after = 0   # a tag of its own: no earlier instance laid its staging out
        self._bindings += 1
        arm.binding = self._bindings
        released = <uint32_t *>calloc(1, sizeof(uint32_t))
        if released == NULL:
            self._free_graph_slot(slot)
            task.tags.release(plan.key, False, None, False)
            raise MemoryError
        # No replay pending yet: the word each replay's arm waits on first.
        dfccl_store_release_u32(&c.done[slot], DFCCL_GRAPH_GEN_BIT)
        try:
            # The previous replay complete (a graph that never waits for its
            # collective still runs one replay of it at a time), then the arm.
            self.device.stream_wait_mask32(stream, c.done_dev + 4 * slot, DFCCL_GRAPH_GEN_BIT)
            self.device.stream_graph_arm(stream, &c.args, &arm)
            self.device.retain_for_capture(stream, released)
        except BaseException:
            # The capture is broken anyway (CUDA invalidates it); nothing was bound.
            free(released)
            self._free_graph_slot(slot)
            task.tags.release(plan.key, False, None, False)
            raise
        node = self._graphs[slot] = _CapturedNode(slot, plan.key, task.tags, <uintptr_t>released, task.kind,
                                                  task.tag, task.rank, task.plan.desc.endpoint, g.instance, owners,
                                                  (plan.aux_offset, plan.aux_bytes) if plan.aux_bytes else None)
        c.n_graph_slots += 1
        wake_watch(c)   # it watches graph_arms from now on
        return node

    cdef uint32_t _take_graph_slot(self) except? 0xffffffff:
        """A completion slot for a captured collective, held until its graph
        is destroyed (never on the outstanding list: nothing retires it)."""
        cdef daemon_core *c = self.c
        cdef uint32_t slot
        if c.n_free == 0:
            self._make_room()
        lock_gil(c)
        try:
            if c.n_free == 0:
                raise ResourceError(f"no completion slot is free on {self.device.where} for a "
                                    "captured collective (raise DaemonOptions.max_outstanding)")
            c.n_free -= 1
            slot = c.free_stack[c.n_free]
            c.slots[slot].state = SLOT_GRAPH
        finally:
            PyThread_release_lock(c.lock)
        return slot

    cdef void _free_graph_slot(self, uint32_t slot):
        cdef daemon_core *c = self.c
        lock_gil(c)
        c.slots[slot].state = SLOT_FREE
        c.free_stack[c.n_free] = slot
        c.n_free += 1
        PyThread_release_lock(c.lock)

    def _reap_graphs(self):
        """Frees what captured collectives of destroyed graphs held: the
        slot, the tag's record and staging, an all-to-all's split table (a
        failed tag keeps them, as any failed tag does)."""
        for slot, node in list(self._graphs.items()):
            # Destroyed, and its last replay complete (the daemon may still
            # run a replay whose graph finished without waiting for it).
            if (<uint32_t *><uintptr_t>node.released)[0] != 1:
                continue
            if not (dfccl_load_acquire_u32(&self.c.done[<uint32_t>slot]) & DFCCL_GRAPH_GEN_BIT):
                continue
            del self._graphs[slot]
            free(<void *><uintptr_t>node.released)
            # ran: a replay reached the daemon (the word moved past the one set at capture)
            node.tags.release(node.key, node.failed is not None, node.aux,
                              self.c.done[<uint32_t>slot] != DFCCL_GRAPH_GEN_BIT)
            self._free_graph_slot(slot)
            self.c.n_graph_slots -= 1
        return len(self._graphs)

    def held_by_daemon(self, uint32_t endpoint):
        """DaemonBase.held_by_daemon, and the endpoint's collectives
        captured in graphs that are alive: a replay may still run them."""
        self._reap_graphs()
        return DaemonEndpoints.held_by_daemon(self, endpoint) + sum(
            1 for n in self._graphs.values() if n.endpoint == endpoint)

    @property
    def captured(self):
        """Collectives captured in CUDA graphs that are still alive, as dicts
        (kind, tag, rank, endpoint, slot, and the error of its last failed
        replay or None).  Every completion word is read, flagged or not:
        the daemon flags a failure just after publishing it, so a stream
        that a failed replay released may run ahead of the flag."""
        self._scan_graphs(every=True)
        self._reap_graphs()
        return [{"kind": n.kind, "tag": n.tag, "rank": n.rank, "endpoint": n.endpoint, "slot": n.slot,
                 "error": None if n.failed is None else str(n.failed)} for n in self._graphs.values()]

    def _graph_stream_wait(self, uint64_t stream, uint32_t slot):
        """Work.wait(stream) of a captured collective: ``stream`` must be
        capturing (into the same graph) and waits for each replay."""
        if not self.device.stream_capturing(stream):
            raise NotSupportedError("wait: a collective captured in a CUDA graph can only be waited for by a stream "
                                    "that captures into the same graph")
        self.device.stream_wait_mask32(stream, self.c.done_dev + 4 * slot, DFCCL_GRAPH_GEN_BIT)

    def check_graphs(self):
        """Raises the error of a replay of a captured collective that failed
        since the last call (the daemon flags it in ctrl.graph_failed); the
        collective's later replays run as usual.  Every failure seen is in
        ``captured``."""
        self._scan_graphs()
        if self._graph_errors:
            first = self._graph_errors[0]
            self._graph_errors = []
            self.c.n_graph_errors = 0
            raise first

    def _scan_graphs(self, every=False):
        """Records the replays that failed since the daemon last flagged
        one (each captured collective's last error, and the errors for
        check_graphs to raise); ``every``: whether or not one is flagged."""
        cdef daemon_core *c = self.c
        cdef uint32_t word
        cdef Work w
        if dfccl_load_acquire_u64(&c.ctrl.graph_failed) == 0 and not every:
            return
        dfccl_store_release_u64(&c.ctrl.graph_failed, 0)
        dfccl_fence_seq_cst()
        for node in self._graphs.values():
            word = dfccl_load_acquire_u32(&c.done[node.slot])
            if not (word & DFCCL_GRAPH_GEN_BIT) or c.results[node.slot].status == DFCCL_STATUS_OK:
                continue
            if node.reported == word:
                continue
            node.reported = word
            replay = word & ~DFCCL_GRAPH_GEN_BIT
            w = Work.completed(node.kind, node.tag, node.rank)
            w._daemon = self
            w.endpoint = node.endpoint
            w.instance = node.first_instance + replay - 1
            w._status = c.results[node.slot].status
            w._detail = c.results[node.slot].detail
            cause = w._make_error()
            err = type(cause)(f"replay {replay} of a captured collective failed: {cause}", rank=node.rank,
                              tag=node.tag)
            node.failed = err
            self._graph_errors.append(err)
        c.n_graph_errors = len(self._graph_errors)

    def _refusal(self, int nchannels):
        """Why a submission is refused (hotpath.submit's checks)."""
        where = self.device.where
        if self.c.closed:
            if self.c.forked_from:
                return ClosedError(f"daemon {where} belongs to process {self.c.forked_from}, which forked this "
                                   "process")
            return ClosedError(f"daemon {where} is closed")
        if self.c.device_fault:
            return self._fault_error()
        return ValueError(f"nchannels {nchannels} outside 1..{self.c.nblocks}")

    def _make_room(self):
        """No free slot: completed collectives nobody has retired yet free
        theirs first (waiting instead could deadlock)."""
        retire_completed(self.c, self.policy, False)
        if self.c.n_free == 0:
            raise ResourceError(
                f"{self.c.nslots} collectives are already outstanding on {self.device.where}; "
                "raise DaemonOptions.max_outstanding or synchronize earlier ones (waiting here could deadlock)")

    # -- complete ------------------------------------------------------------
    def _retire(self, uint32_t slot, uint32_t gen):
        """Retires the Work in ``slot`` (generation ``gen``) if the daemon
        completed it.  Idempotent: whoever sees the completion first does."""
        retire_work(self.c, self.policy, slot, gen)

    def _retire_due(self):
        """The progress thread: retires what the watcher found due (and, once
        the device failed, fails what is pending)."""
        if self.c.fault_word and not self.c.fault_handled:
            self.fail_on_fault()
        if self.c.n_outstanding:
            retire_completed(self.c, self.policy, True)
        if self.c.pol_due:
            adapt_policy(self.c, self.policy)

    def _retire_soon(self, uint32_t slot, uint32_t gen):
        """A Work with done-callbacks: due for retirement (and its callbacks)
        at the watcher's first look after completion."""
        lock_gil(self.c)
        if self.c.slots[slot].gen == gen:
            self.c.slots[slot].retire_soon = 1
        PyThread_release_lock(self.c.lock)

    def _stream_wait(self, uint64_t stream, uint32_t slot, uint32_t gen):
        """Makes ``stream`` wait for the collective in ``slot``, once it
        holds the daemon for it."""
        cdef int rc
        with nogil:
            rc = stream_wait(self.c, slot, gen, stream)
        if rc < 0:
            raise take_error()

    def _hold_for_stream_of(self, Work work):
        """The first half of ``work.wait(stream)`` alone: what the simulator,
        which has no streams, tests of it."""
        cdef int rc
        with nogil:
            rc = hold_for_stream(self.c, work._slot, work._gen)
        if rc < 0:
            raise take_error()

    def abandon(self, Work work):
        """Fails ``work`` now with AbortedError without waiting for the
        daemon (an abort that must return).  Its slot, tag record and buffers
        stay reserved until the daemon lets go of them; then the slot is
        retired as usual (nothing is reused under a running collective)."""
        return abandon_work(self.c, work)

    def _fault_error(self):
        return BackendError(
            f"the device {self.device.where} failed under the dfccl daemon: "
            f"{self.device.fault_name(self.c.device_fault)}.  A kernel of this process faulted (an illegal address "
            "from a bad pointer, say: a collective's buffer that is not valid device memory, or another library's "
            "kernel); the device runs nothing more in this process, so every pending collective failed and new ones "
            "are refused: restart the process", driver_code=self.c.device_fault)

    def fail_on_fault(self):
        """Fails every pending collective with the device's error
        (BackendError), once the watcher has found the device failed; their
        slots stay taken (nothing will be reused).  Idempotent; a no-op
        before a fault."""
        cdef Work work
        cdef list failed
        if not dfccl_load_acquire_u32(&self.c.fault_word):
            return
        err = self._fault_error()
        lock_gil(self.c)
        try:
            if self.c.fault_handled:
                return
            self.c.fault_handled = 1
            failed = fail_unretired(self.c, err, False)
            for work in failed:
                work._abandoned = True   # the slot is the daemon's until it lets go
        finally:
            PyThread_release_lock(self.c.lock)
        for work in failed:
            run_callbacks(work)

    def forget_after_fork(self, int parent_pid):
        """In a forked child: this Daemon is the parent's.  Its kernel, its
        threads and (on GPUs) its pinned memory do not exist here, so the
        child must neither use nor free it: it counts as closed, its locks
        are new (another thread may have held them at the fork), and every
        Work still pending fails now with ClosedError, touching no memory the
        child may not have.  Done-callbacks are dropped (the parent runs
        them).  The Device is runtime.py's to forget."""
        cdef daemon_core *c = self.c
        cdef Work work
        c.forked_from = parent_pid
        c.closed = 1
        c.watch_stop = 1
        c.lock = PyThread_allocate_lock()
        c.launch_lock = PyThread_allocate_lock()
        c.submit_lock = PyThread_allocate_lock()
        c.watch_wake = PyThread_allocate_lock()
        if c.lock == NULL or c.launch_lock == NULL or c.submit_lock == NULL or c.watch_wake == NULL:
            raise MemoryError
        PyThread_acquire_lock(c.watch_wake, WAIT_LOCK)
        err = ClosedError(f"this collective belongs to process {parent_pid}, which forked this process: a "
                          "forked child cannot use its parent's collectives or communicators")
        # The child has one thread: no lock.  Completion words may not be
        # mapped here (pinned memory is not inherited): none is read.
        for work in fail_unretired(c, err, True):
            work._callbacks = None
        c.n_outstanding = 0
        self.diagnostics = {}
        self.draining_endpoints = {}

    # -- the watcher ---------------------------------------------------------
    def _watch(self):
        """The watcher thread (retire.pyx, watch)."""
        cdef int rc
        block_async_signals()
        with nogil:
            rc = watch(self.c)
        if rc != 0:
            warn_relaunch_failed(self.device, rc)

    cdef int _stop_watch(self) except -1:
        """Stops the watcher and waits for it (idempotent)."""
        self.c.watch_stop = 1
        wake_watch(self.c)
        if self.watcher is not None and self.watcher.is_alive() and self.watcher is not threading.current_thread():
            self.watcher.join()
        return 0

    # -- close ---------------------------------------------------------------
    def close(self, timeout=10.0):
        """Stops the daemon (aborting whatever is still pending: those Works
        complete with AbortedError, C handles report it) and frees the
        daemon's memory."""
        cdef daemon_core *c = self.c
        if c.closed:
            return
        if self._reap_graphs():
            # Their arm nodes name this context's memory: a replay after close
            # would write memory that is gone.  The words their graphs set
            # when destroyed stay allocated for that moment.
            warnings.warn(f"dfccl: closing the daemon on {self.device.where} while CUDA graphs "
                          f"holding {len(self._graphs)} captured collectives are alive: destroy them first; "
                          "replaying them after this is an error", RuntimeWarning, stacklevel=2)
            self._graphs = {}
        c.closed = 1
        self._stop_watch()
        _progress.unregister(self)
        for idx in range(self.max_endpoints):
            c.ep_abort[idx] = 1
        self._abort_flags_changed()
        dfccl_store_release_u64(&c.ctrl.quit_request, 1)
        dfccl_fence_seq_cst()
        deadline = time.monotonic() + timeout
        # A failed device never reports the daemon's exit, and its memory
        # cannot be freed: do not wait, keep it.
        daemon_exited = not c.device_fault
        if c.epoch != 0 and daemon_exited:
            while not exited(c):
                if time.monotonic() > deadline:
                    daemon_exited = False
                    break
                time.sleep(1e-4)
        _kept_for_running_daemons.extend(close_slots(c, daemon_exited))
        if not daemon_exited:
            # The daemon did not leave: keep its memory mapped rather than
            # free it under a running kernel.
            return
        # The daemon has left: what draining endpoints kept can go now.
        self.reclaim_endpoints()
        self.device.synchronize()
        self.device.free_device(self.device_mem)
        self.device.free_mapped(self.mapped_host)
        self.device_mem = 0
        self.mapped_host = 0
