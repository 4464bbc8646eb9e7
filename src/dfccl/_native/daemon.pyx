# cython: language_level=3
"""A device's daemon in this process: the Daemon.  It sets the daemon up
(its memory, daemon_memory.pyx), registers communicator ranks (endpoints),
submits for Python (a Work per collective), and closes.

Its parts live in their own modules, lowest first: the C state and
launches (launch.pyx), the submission (hotpath.pyx) and what follows it
(completion.pyx: test, wait, stream waits, the C API's handles), which the
C API of capi.pyx calls too, retirement and the watcher (retire.pyx), what
it shows (inspection.pyx, DaemonBase), its communicator ranks
(endpoints.pyx, DaemonEndpoints), its collectives captured in CUDA graphs
(graphs.pyx, GraphCaptures), and the descriptor it submits
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
from dfccl._native.cuda_driver import relax_thread_capture_mode

from cpython.pythread cimport PyThread_allocate_lock, PyThread_acquire_lock, PyThread_release_lock, WAIT_LOCK
from cpython.ref cimport PyObject, Py_INCREF
from libc.stdint cimport uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport calloc, free

from dfccl._native.abi cimport *
from dfccl._native.device cimport Device
from dfccl._native.core cimport SLOT_BUSY, daemon_core, slot_rec
from dfccl._native.descriptor cimport TaskDescriptor
from dfccl._native.completion cimport hold_for_stream, stream_wait
from dfccl._native.hotpath cimport check_graph_failures, submit, submitted_t
from dfccl._native.daemon_memory cimport daemon_memory, lay_out
from dfccl._native.endpoints cimport DaemonEndpoints
from dfccl._native.graphs cimport GraphCaptures, new_graph_captures
from dfccl._native.launch cimport core_decref, core_new, exited, take_error, wake_watch
from dfccl._native.retire cimport (abandon_handles, abandon_work, adapt_policy, close_slots, fail_unretired, lock_gil,
                                   retire_completed, retire_work, run_callbacks, watch)
from dfccl._native.work cimport Work

from dfccl._native.progress import progress as _progress
from dfccl._native.retire import warn_relaunch_failed
from dfccl.errors import BackendError, ClosedError, InvalidArgumentError, NotSupportedError, ResourceError

__all__ = ["Daemon"]

# What collectives pending when their Daemon closed under a daemon kernel
# that would not leave kept alive: that kernel may still touch them, and its
# memory is kept mapped too (Daemon.close), for the life of the process.
cdef list _kept_for_running_daemons = []


cdef class Daemon(DaemonEndpoints):
    """The daemon of one device in this process, shared by every communicator
    (and every rank) this process runs on that device."""

    cdef uint64_t mapped_host
    cdef readonly uint64_t mapped_dev
    cdef uint64_t device_mem
    cdef readonly object policy
    cdef readonly bint link_block      # the daemon has a link block (link.cuh)
    cdef object watcher
    cdef GraphCaptures graphs     # its collectives captured in CUDA graphs (graphs.pyx)
    cdef object __weakref__

    def __init__(self, Device device, *, int blocks, int slots, int max_endpoints, policy, int link_ahead=0,
                 bint link_block=False):
        cdef daemon_core *c
        cdef daemon_memory mem
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

        lay_out(c, device, slots, blocks, max_endpoints, &mem)
        self.mapped_host = mem.mapped_host
        self.mapped_dev = mem.mapped_dev
        self.device_mem = mem.device_mem
        self.endpoints_dev = mem.endpoints_dev
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

        self.graphs = new_graph_captures(c, device, policy)
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
    def submit(self, TaskDescriptor task, dict raw_fields=None, Work after=None, bint followed=False,
               Work order_after=None):
        """Publishes one instance of ``task`` to the daemon (the host half of
        submit) and returns its Work.  Takes the tag's next instance and its
        record (and staging) from the endpoint's tag table; nothing waits for
        peers.

        The parts of a hierarchical collective (hierarchy.py) chain: one
        submitted with ``followed`` keeps its slot until the collective
        submitted next with it as ``after`` retired (or ``unfollow``); the
        daemon runs that one only after it completed, and fails it,
        telling its peers, if it failed (DFCCL_TASK_FOLLOWS).  A task given
        ``after`` needs a tag whose instances all lay their staging out
        alike (the daemon takes one predecessor per collective).
        ``order_after``: instead, any collective of this daemon that ran
        after this tag's earlier instances here; the daemon runs this one
        after it, whatever became of it (a tag's order across a
        hierarchical collective and the others of its tag, hierarchy.py).

        ``raw_fields`` (tests only) overwrites fields of the descriptor as
        the daemon receives it, after every host check: the way to show that
        the daemon rejects a corrupt one."""
        cdef slot_rec *r
        cdef bint ok
        if after is not None:
            ok = after._daemon is self and not after.captured
            if ok:
                lock_gil(self.c)
                r = &self.c.slots[after._slot]
                ok = r.state == SLOT_BUSY and r.gen == after._gen and r.followed
                PyThread_release_lock(self.c.lock)
            if not ok:
                raise InvalidArgumentError("submit: `after` must be a collective of this daemon submitted with "
                                           "followed=True that no other collective follows yet")
            # For this submission only: the plan is the descriptor's, and the
            # submit lock makes this thread's submission the one that reads it.
            task.plan.follows = ((<uint64_t>after._slot + 1) << 32) | after._gen
            task.plan.chained = 1
        elif order_after is not None and not order_after._retired:
            if order_after._daemon is not self or order_after.captured:
                raise InvalidArgumentError("submit: `order_after` must be a collective submitted to this daemon")
            task.plan.follows = ((<uint64_t>order_after._slot + 1) << 32) | order_after._gen
        task.plan.followed = followed
        try:
            return self._submit(task, raw_fields, task.plan.desc.send_addr, task.plan.desc.recv_addr,
                                task.plan.has_stream, task.plan.stream, task.owners)
        finally:
            task.plan.follows = 0
            task.plan.chained = 0
            task.plan.followed = 0

    def unfollow(self, Work work):
        """``work`` was submitted with followed=True and nothing will follow
        it after all (the next part's submission failed): its slot may go."""
        lock_gil(self.c)
        if self.c.slots[work._slot].gen == work._gen:
            self.c.slots[work._slot].followed = 0
        PyThread_release_lock(self.c.lock)

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
        if has_stream and self.device.stream_capturing(stream):
            # A capture publishes nothing, so it checks for failed replays here.
            if check_graph_failures(self.c, task.plan.desc.endpoint) < 0:
                raise take_error()
            # An order (order_after) does not apply: a captured collective
            # has a tag of its own.  A chain's part has no meaning alone.
            if task.plan.chained or task.plan.followed:
                raise NotSupportedError("a collective that follows another cannot be captured in a CUDA graph "
                                        "(each replay would need its predecessor's)")
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
        cdef Work work = self._new_work(task, owners, out.instance, out.slot, out.gen, has_stream, now)
        cdef slot_rec *r = &self.c.slots[out.slot]
        work.position = out.position
        work._done = &self.c.done[out.slot]
        work._waiting = &self.c.waiting[out.slot]
        work._fault = &self.c.fault_word
        lock_gil(self.c)
        if r.state == SLOT_BUSY and r.gen == out.gen:
            Py_INCREF(work)
            r.work = <PyObject *>work
        else:
            work._fail_closed(dfccl_now_ns())   # the daemon closed under the submission
        PyThread_release_lock(self.c.lock)
        return work

    cdef Work _new_work(self, TaskDescriptor task, object owners, uint64_t instance, uint32_t slot, uint32_t gen,
                        bint stream_ordered, uint64_t now):
        """A Work of ``task``'s instance in ``slot``: what submitted and
        captured collectives have alike."""
        cdef Work work = Work.__new__(Work)
        work._daemon = self
        work._keepalive = owners
        work._key = task.key
        work.endpoint = task.plan.desc.endpoint
        work.kind = task.kind
        work.tag = task.tag   # None for an untagged one: its instance says which (Work.name)
        work.rank = task.rank
        work.instance = instance
        work.stream_ordered = stream_ordered
        work._slot = slot
        work._gen = gen
        work._submitted_ns = now
        return work

    # -- CUDA graphs (docs/architecture.md, "CUDA graphs") -------------------
    cdef Work _capture(self, TaskDescriptor task, uint64_t send_addr, uint64_t recv_addr, uint64_t stream,
                       object owners):
        """``task`` captured on ``stream`` (_bind_capture), as a captured Work."""
        cdef Work work
        node = self._bind_capture(task, send_addr, recv_addr, stream, owners)
        work = self._new_work(task, owners, node.first_instance, node.slot, DFCCL_GRAPH_GEN_BIT, True, dfccl_now_ns())
        work.captured = True
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
        """``task`` bound and captured on ``stream`` (GraphCaptures.bind),
        unless this daemon or the collective's rank refuses it."""
        if self.c.closed or self.c.device_fault or task.plan.tags.closed:
            raise self._refusal(task.plan.desc.nchannels) if not task.plan.tags.closed else ClosedError(
                "the communicator rank of this collective is closed or aborted")
        return self.graphs.bind(task, send_addr, recv_addr, stream, owners)

    def _reap_graphs(self):
        """GraphCaptures.reap: how many captured collectives are alive."""
        return self.graphs.reap()

    def held_by_daemon(self, uint32_t endpoint):
        """DaemonBase.held_by_daemon, and the endpoint's collectives
        captured in graphs that are alive: a replay may still run them."""
        held = self.graphs.held_by(endpoint)
        return DaemonEndpoints.held_by_daemon(self, endpoint) + held

    @property
    def captured(self):
        """Collectives captured in CUDA graphs that are still alive, as dicts
        (kind, tag, rank, endpoint, slot, and the error of its last failed
        replay or None)."""
        return self.graphs.captured()

    def _graph_stream_wait(self, uint64_t stream, uint32_t slot):
        """Work.wait(stream) of a captured collective (GraphCaptures.stream_wait)."""
        self.graphs.stream_wait(stream, slot)

    def check_graphs(self, uint32_t endpoint):
        """Raises the error of a replay of one of ``endpoint``'s captured
        collectives that failed since its last call (GraphCaptures.check);
        every failure seen is in ``captured``."""
        self.graphs.check(endpoint)

    def remove_endpoint(self, int idx, on_released=None):
        """DaemonEndpoints.remove_endpoint; the failed replays of its
        captured collectives that were not raised yet are dropped."""
        released = DaemonEndpoints.remove_endpoint(self, idx, on_released)   # refuses an unknown idx
        self.graphs.forget_errors(idx)
        return released

    def _refusal(self, int nchannels):
        """Why a submission is refused (hotpath.submit's checks, launch.refusal)."""
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
        relax_thread_capture_mode()
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
        alive = self.graphs.close()
        if alive:
            warnings.warn(f"dfccl: closing the daemon on {self.device.where} while CUDA graphs "
                          f"holding {alive} captured collectives are alive: destroy them first; "
                          "replaying them after this is an error", RuntimeWarning, stacklevel=2)
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
