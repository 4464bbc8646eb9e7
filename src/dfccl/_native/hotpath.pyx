# cython: language_level=3
"""The host hot path's submission, in C: a bound collective's next instance
of its tag, a completion slot and a ring entry, published to the daemon.
What follows a submission (test, wait on the host or on a stream, release,
the retirement primitives) is completion.pyx's.

submit() runs without the GIL and returns a dfccl_api_code
(cuda/include/dfccl/dfccl_api.h).  The rare paths take the GIL: the tag
table's (a tag without its bucket, staging to reserve), out of slots,
errors (their messages come from the Python objects), a stream that
captures a CUDA graph, the simulator's streams, tests' raw fields.

Concurrency: one submission at a time per daemon (submit_lock: a tag's
instance, a slot and a ring entry are taken and published as one); the
slots and the outstanding list are under the daemon's lock; a tag's state
under its table's lock.  A thread never blocks on these locks while it
holds the GIL (their holders may run Python code, which lets other threads
take it); only submit_lock is held while the rare paths wait for the GIL."""

from cpython.pythread cimport PyThread_acquire_lock, PyThread_release_lock, WAIT_LOCK
from cpython.ref cimport PyObject
from libc.stdint cimport uint32_t, uint64_t

from dfccl._native.abi cimport *
from dfccl._native.device cimport Device
from dfccl._native.core cimport SLOT_BUSY, daemon_core, plan_t, slot_rec, tag_grant
from dfccl._native.descriptor cimport TaskDescriptor, fill_instance, override_fields
from dfccl._native.launch cimport ensure_running, record_error, refusal, wake_watch
from dfccl._native.tag_instances cimport tag_acquire_fast, tag_core_incref, tag_note_slot

from dfccl.errors import ResourceError

__all__ = []   # C only: submit (hotpath.pxd)
cdef enum:
    # How long a submission waits for the daemon to copy the ring entry it
    # is about to rewrite.
    RING_WAIT_NS = 1000000000




cdef int _make_room(daemon_core *c) noexcept with gil:
    """No free slot: completed collectives nobody has retired yet free theirs
    first; ResourceError if none does."""
    try:
        (<object>c.py_daemon)._make_room()
        return 0
    except BaseException as exc:
        return record_error(exc)


cdef int _acquire_slow(plan_t *p, tag_grant *g) noexcept with gil:
    """The tag table decides (a bucket to claim, staging to reserve)."""
    cdef TaskDescriptor task = <TaskDescriptor>p.descriptor
    try:
        task.tags.acquire_c(p.key, p.transient, p.staging_bytes, &p.layout, p.has_layout, g)
        p.tag = task.tags.state_of(p.key)
        return 0
    except BaseException as exc:
        return record_error(exc)


cdef void _cancel_slow(plan_t *p) noexcept with gil:
    (<TaskDescriptor>p.descriptor).tags.cancel(p.key)


cdef int _write_slow(daemon_core *c, PyObject *raw, dfccl_task_desc *d, bint has_stream, uint64_t stream,
                     uint64_t addr, uint32_t gen) noexcept with gil:
    """Tests' raw fields, and stream writes that need the GIL (or failed)."""
    try:
        if raw != NULL:
            override_fields(d, <dict>raw)
        if has_stream:
            (<Device>c.device).stream_write32(stream, addr, gen)
        return 0
    except BaseException as exc:
        return record_error(exc)


cdef int _ring_full(uint64_t position) noexcept with gil:
    return record_error(ResourceError(f"the daemon has not taken submission {position} for a second (a block is "
                                      "held by one long run); the submission ring cannot take more"))


cdef int _wait_ring_entry(daemon_core *c, uint64_t position) noexcept nogil:
    """Returns once the daemon's host link has copied the ring entry at
    ``position`` (the one about to be rewritten).  It lags that far only
    while one long run holds a block; this waits for it (at most a second,
    the daemon kept running) rather than overwrite what it has not read."""
    cdef uint64_t deadline = 0
    cdef int rc
    while dfccl_load_acquire_u64(&c.ctrl.sq_copied) <= position:
        if deadline == 0:
            deadline = dfccl_now_ns() + RING_WAIT_NS
        elif dfccl_now_ns() > deadline:
            return _ring_full(position)
        rc = ensure_running(c)
        if rc < 0:
            return rc
        dfccl_sleep_ns(2000)
    return 0


cdef int _write_entry(daemon_core *c, plan_t *p, uint32_t slot, uint32_t gen, const tag_grant *g, uint64_t send_addr,
                      uint64_t recv_addr, bint has_stream, uint64_t stream, PyObject *raw) noexcept nogil:
    """Fills the next ring entry (not yet published)."""
    cdef dfccl_sqe *e
    cdef dfccl_task_desc *d
    cdef int rc = 0
    if c.tail >= c.ring_size:
        rc = _wait_ring_entry(c, c.tail - c.ring_size)
        if rc < 0:
            return rc
    e = &c.ring[c.tail & (c.ring_size - 1)]
    d = &e.desc
    fill_instance(d, p, g, send_addr, recv_addr, slot)
    d.gen = gen
    d.after = g.after
    if p.follows != 0:
        # A chain's part (chained) or an order: the collective named ran
        # after this tag's earlier instances here, so it stands for g.after
        # too.  A part's predecessor is the part before it, which runs after
        # its tag's last collective, which ran after the last call's parts
        # (hierarchy.py, Hierarchy.submit).
        d.after = p.follows
        if p.chained:
            d.flags = d.flags | DFCCL_TASK_FOLLOWS
    if p.staging_bytes:
        tag_note_slot(p.tags, p.tag, ((<uint64_t>slot + 1) << 32) | gen)
    if has_stream:
        # The stream arms it: a write into device memory when it gets there.
        if raw != NULL or (<Device>c.device).try_stream_write32(stream, c.armed_dev + 4 * slot, gen) != 0:
            rc = _write_slow(c, raw, d, True, stream, c.armed_dev + 4 * slot, gen)
    else:
        if raw != NULL:
            rc = _write_slow(c, raw, d, False, 0, 0, 0)
        d.flags = d.flags | DFCCL_TASK_ARMED
    if rc < 0:
        return rc
    # Lets the daemon take the entry in the round trip that reads the tail.
    e.seq = c.tail + 1
    e.check = dfccl_sqe_check(<const uint64_t *>d, e.seq)
    return 0


cdef int _submit_locked(daemon_core *c, plan_t *p, uint64_t send_addr, uint64_t recv_addr, bint has_stream,
                        uint64_t stream, bint by_work, PyObject *raw, submitted_t *out) noexcept nogil:
    """submit() under the submit lock."""
    cdef tag_grant g
    cdef uint32_t slot, gen
    cdef slot_rec *r
    cdef int rc
    if c.n_free == 0:
        rc = _make_room(c)
        if rc < 0:
            return rc
    if not tag_acquire_fast(p.tags, p.tag, p.key, p.staging_bytes, &p.layout, p.has_layout, &g):
        rc = _acquire_slow(p, &g)
        if rc < 0:
            return rc
    PyThread_acquire_lock(c.lock, WAIT_LOCK)
    c.n_free -= 1
    slot = c.free_stack[c.n_free]
    PyThread_release_lock(c.lock)
    r = &c.slots[slot]
    gen = r.gen + 1
    if gen == 0 or gen == DFCCL_GRAPH_GEN_BIT:
        gen += 1   # a handle of generation DFCCL_GRAPH_GEN_BIT names a captured collective
    rc = _write_entry(c, p, slot, gen, &g, send_addr, recv_addr, has_stream, stream, raw)
    if rc < 0:
        PyThread_acquire_lock(c.lock, WAIT_LOCK)
        c.free_stack[c.n_free] = slot
        c.n_free += 1
        PyThread_release_lock(c.lock)
        _cancel_slow(p)
        return rc
    c.waiting[slot] = 0  # the daemon stores it only while it waits
    tag_core_incref(p.tags)
    PyThread_acquire_lock(c.lock, WAIT_LOCK)
    r.gen = gen
    r.seen_done = 0
    r.endpoint = p.desc.endpoint
    r.status = DFCCL_STATUS_OK
    r.detail = -1
    r.state = SLOT_BUSY
    r.by_work = by_work
    r.released = r.abandoned = r.stream_waited = r.retire_soon = 0
    r.followed = p.followed
    r.follows = <uint32_t>(p.follows >> 32) if p.chained else 0
    r.follows_gen = <uint32_t>p.follows
    r.work = NULL
    r.tags = p.tags
    r.tag = p.tag
    r.key = p.key
    r.aux_offset = p.aux_offset
    r.aux_bytes = p.aux_bytes
    r.position = c.n_outstanding
    c.outstanding[c.n_outstanding] = slot
    c.n_outstanding += 1
    PyThread_release_lock(c.lock)
    out.slot = slot
    out.gen = gen
    out.instance = g.instance
    out.position = c.tail
    c.tail += 1
    dfccl_store_release_u64(&c.ctrl.sq_tail, c.tail)
    return 0


cdef enum:
    NOT_CAPTURING = 1   # _capture_for_handle: the stream does not capture, submit as usual


cdef int _capture_for_handle(daemon_core *c, plan_t *p, uint64_t send_addr, uint64_t recv_addr, uint64_t stream,
                             submitted_t *out) noexcept with gil:
    """A C handle's collective on a stream that captures a CUDA graph is
    captured as the Python API's are (Daemon.capture_for_handle): the
    handle names the captured collective (gen DFCCL_GRAPH_GEN_BIT), which a
    stream under the same capture can wait for; it has no completion on
    the host.  NOT_CAPTURING when the stream does not capture."""
    try:
        if not (<Device>c.device).stream_capturing(stream):
            return NOT_CAPTURING
        slot, instance = (<object>c.py_daemon).capture_for_handle(<object>p.descriptor, send_addr, recv_addr, stream)
        out.slot = slot
        out.gen = DFCCL_GRAPH_GEN_BIT
        out.instance = instance
        out.position = 0
        return 0
    except BaseException as exc:
        return record_error(exc)


cdef int _graph_failed(daemon_core *c, uint32_t endpoint) noexcept with gil:
    """A replay of one of ``endpoint``'s captured collectives failed: its
    error, raised by this call."""
    try:
        (<object>c.py_daemon).check_graphs(endpoint)
        return 0
    except BaseException as exc:
        return record_error(exc)


cdef int check_graph_failures(daemon_core *c, uint32_t endpoint) noexcept nogil:
    """The next call of a rank raises a failed replay of its captured
    collectives (-1, its error kept for this thread): every submission,
    from Python or C, captured or not, checks here first.  Two loads while
    nothing failed (the flag is in host memory the daemon writes)."""
    if c.ctrl.graph_failed != 0 or c.n_graph_errors != 0:
        return _graph_failed(c, endpoint)
    return 0


cdef int submit(daemon_core *c, plan_t *p, uint64_t send_addr, uint64_t recv_addr, bint has_stream, uint64_t stream,
                bint by_work, PyObject *raw, submitted_t *out) noexcept nogil:
    """Publishes one instance of ``p`` to the daemon at the given buffers
    and stream; ``out`` names it (``out.gen`` 0: nothing was published).
    ``by_work``: a Python Work will own the slot (Daemon attaches it);
    else a C handle does.  ``raw`` (tests only): fields to overwrite."""
    cdef int rc
    out.gen = 0
    if c.closed or c.device_fault or p.tags.closed or p.desc.nchannels < 1 or p.desc.nchannels > c.nblocks:
        return refusal(c, p.desc.nchannels, p.tags.closed)
    rc = check_graph_failures(c, p.desc.endpoint)
    if rc < 0:
        return rc
    if has_stream and not by_work and (<Device>c.device).try_stream_capturing(stream) != 0:
        # Capturing (or the query failed, which the slow path raises).  A
        # Work's submission under capture never gets here (Daemon._submit).
        rc = _capture_for_handle(c, p, send_addr, recv_addr, stream, out)
        if rc != NOT_CAPTURING:
            return rc
    PyThread_acquire_lock(c.submit_lock, WAIT_LOCK)
    rc = _submit_locked(c, p, send_addr, recv_addr, has_stream, stream, by_work, raw, out)
    PyThread_release_lock(c.submit_lock)
    if rc < 0:
        return rc
    # Dekker with the daemon's idle quit (schedule.cuh, should_quit).
    dfccl_fence_seq_cst()
    rc = ensure_running(c)
    # The watcher polls while work is outstanding; it needs a wake-up only
    # when it may have gone to sleep (nothing was pending).
    if c.n_outstanding == 1:
        wake_watch(c)
    return rc
