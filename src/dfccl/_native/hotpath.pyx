# cython: language_level=3
"""The host hot path, in C: submit a bound collective (the tag's next
instance, a completion slot, a ring entry, published to the daemon), test
it, wait for it on the host or on a stream, release it, and retire it.

Every function here runs without the GIL and returns a dfccl_api_code
(cuda/include/dfccl/dfccl_api.h).  The rare paths take the GIL: the tag
table's (a tag without its bucket, staging to reserve or give back), out
of slots, errors (their messages come from the Python objects), the
simulator's streams, tests' raw fields.

Concurrency: one submission at a time per daemon (submit_lock: a tag's
instance, a slot and a ring entry are taken and published as one); the
slots and the outstanding list are under the daemon's lock; a tag's state
under its table's lock.  A thread never blocks on these locks while it
holds the GIL (their holders may run Python code, which lets other threads
take it); only submit_lock is held while the rare paths wait for the GIL."""

from cpython.pythread cimport PyThread_acquire_lock, PyThread_release_lock, WAIT_LOCK
from cpython.ref cimport PyObject
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t
from libc.string cimport memcpy

from dfccl._native.abi cimport *
from dfccl._native.device cimport Device
from dfccl._native.core cimport (SLOT_BUSY, SLOT_FREE, SLOT_GRAPH, SLOT_RETIRED, daemon_core, plan_t, slot_rec,
                                tag_grant)
from dfccl._native.descriptor cimport TaskDescriptor, override_fields
from dfccl._native.launch cimport (POLICY_WAITS, core_decref, ensure_running, fault_failure, record_error,
                                   signal_progress, wake_watch)
from dfccl._native.tag_table cimport (TagTable, tag_acquire_fast, tag_core_decref, tag_core_incref, tag_note_slot,
                                      tag_release_fast)

from dfccl.errors import ClosedError, InvalidArgumentError, ResourceError

cdef enum:
    # How long a host wait spins before it yields the CPU between polls
    # (never a sleep: a timed sleep overshoots by tens of microseconds).
    SPIN_BEFORE_YIELD_NS = 50000
    # How long a submission waits for the daemon to copy the ring entry it
    # is about to rewrite.
    RING_WAIT_NS = 1000000000


# ---------------------------------------------------------------------------
# submit
# ---------------------------------------------------------------------------
cdef int _refusal(daemon_core *c, int nchannels, bint comm_closed) noexcept with gil:
    """Why a collective (of ``nchannels`` channels) cannot be submitted here:
    the daemon closed or failed, its communicator rank closed or aborted,
    bad channels."""
    try:
        if c.py_daemon == NULL:
            return record_error(ClosedError("the daemon of this collective is closed and gone"))
        if comm_closed and not c.closed and not c.device_fault:
            return record_error(ClosedError("the communicator rank of this collective is closed or aborted"))
        return record_error((<object>c.py_daemon)._refusal(nchannels))
    except BaseException as exc:
        return record_error(exc)


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
    memcpy(d, &p.desc, sizeof(dfccl_task_desc))
    d.send_addr = send_addr
    d.recv_addr = recv_addr
    d.instance = g.instance
    d.fifo_offset = g.offset | g.shape
    d.bucket = <uint32_t>g.bucket
    if not g.keyed:
        d.flags = d.flags | DFCCL_TASK_KEY_BUCKET
    d.slot = slot
    d.gen = gen
    d.after = g.after
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


cdef int _graph_failed(daemon_core *c) noexcept with gil:
    """A replay of a captured collective failed: its error, raised by this call."""
    try:
        (<object>c.py_daemon).check_graphs()
        return 0
    except BaseException as exc:
        return record_error(exc)


cdef int submit(daemon_core *c, plan_t *p, uint64_t send_addr, uint64_t recv_addr, bint has_stream, uint64_t stream,
                bint by_work, PyObject *raw, submitted_t *out) noexcept nogil:
    """Publishes one instance of ``p`` to the daemon at the given buffers
    and stream; ``out`` names it (``out.gen`` 0: nothing was published).
    ``by_work``: a Python Work will own the slot (Daemon attaches it);
    else a C handle does.  ``raw`` (tests only): fields to overwrite."""
    cdef int rc
    out.gen = 0
    if c.closed or c.device_fault or p.tags.closed or p.desc.nchannels < 1 or p.desc.nchannels > c.nblocks:
        return _refusal(c, p.desc.nchannels, p.tags.closed)
    if c.n_graph_slots != 0:
        # Captured collectives exist: a replay's failure is raised here.
        if c.ctrl.graph_failed != 0 or c.n_graph_errors != 0:
            rc = _graph_failed(c)
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


# ---------------------------------------------------------------------------
# retire
# ---------------------------------------------------------------------------
cdef bint completed(daemon_core *c, uint32_t s) noexcept nogil:
    """Slot ``s`` holds a collective the daemon has completed."""
    return dfccl_load_acquire_u32(&c.done[s]) == c.slots[s].gen


cdef void drop_stream_wait(daemon_core *c, uint32_t s) noexcept nogil:
    """Under the lock: slot ``s`` no longer holds the daemon for a stream."""
    if c.slots[s].stream_waited:
        c.slots[s].stream_waited = 0
        c.n_stream_waited -= 1
        dfccl_store_release_u64(&c.ctrl.stream_waits, c.n_stream_waited)


cdef void unlink(daemon_core *c, uint32_t s, const dfccl_result *result, retired_t *out) noexcept nogil:
    """Under the lock: takes busy slot ``s`` off the outstanding list with
    ``result``; frees it unless a C handle not released yet holds it.
    ``out`` takes its Work and its tag instance."""
    cdef slot_rec *r = &c.slots[s]
    cdef uint32_t last = c.outstanding[c.n_outstanding - 1]
    drop_stream_wait(c, s)
    c.outstanding[r.position] = last
    c.slots[last].position = r.position
    c.n_outstanding -= 1
    c.retired_count += 1
    out.result = result[0]
    out.work = r.work
    out.tags = r.tags
    out.tag = r.tag
    out.key = r.key
    out.aux_offset = r.aux_offset
    out.aux_bytes = r.aux_bytes
    out.abandoned = r.abandoned
    out.failed = r.abandoned or result.status != DFCCL_STATUS_OK
    r.work = NULL
    r.tags = NULL
    if not r.abandoned:
        r.status = result.status
        r.detail = result.detail
    if r.by_work or r.released:
        r.state = SLOT_FREE
        c.free_stack[c.n_free] = s
        c.n_free += 1
    else:
        r.state = SLOT_RETIRED


cdef void _observe(daemon_core *c, const dfccl_result *res, uint64_t now) noexcept nogil:
    """Under the lock: one retired collective, for the preemption policy
    (policy.py), which adapts once per period (Daemon._adapt_policy)."""
    c.pol_completions += 1
    c.pol_preemptions += res.preemptions
    if c.pol_nwaits < POLICY_WAITS:
        c.pol_waits[c.pol_nwaits] = res.max_wait_ns
        c.pol_nwaits += 1
    if c.pol_completions >= c.pol_min_completions and now - c.pol_last_ns >= c.pol_period_ns:
        c.pol_due = 1


cdef bint unlink_completed(daemon_core *c, uint32_t s, uint32_t gen, uint64_t now, retired_t *out) noexcept nogil:
    """Under the lock: unlinks slot ``s`` if it holds generation ``gen``, the
    daemon completed it and (for a Work's) its Work is attached."""
    cdef slot_rec *r = &c.slots[s]
    if r.state != SLOT_BUSY or r.gen != gen or (r.by_work and r.work == NULL):
        return False
    if dfccl_load_acquire_u32(&c.done[s]) != gen:
        return False
    unlink(c, s, &c.results[s], out)
    if c.pol_adaptive and not out.abandoned:
        _observe(c, &out.result, now)
    return True


cdef int _release_tag_slow(retired_t *r, PyObject *owners) noexcept with gil:
    try:
        if r.tags.py_table != NULL:
            (<TagTable>r.tags.py_table).release(r.key, r.failed, (r.aux_offset, r.aux_bytes) if r.aux_bytes else None,
                                                True, <object>owners if owners != NULL else None)
        return 0
    except BaseException as exc:
        return record_error(exc)


cdef int release_tag(retired_t *r, PyObject *owners) noexcept nogil:
    """Outside the daemon's lock: gives the retired instance back to its
    tag table (its own path when it frees staging or keeps ``owners``)."""
    cdef int rc = 0
    if r.tags == NULL:
        return 0
    if r.aux_bytes or (r.failed and owners != NULL) or not tag_release_fast(r.tags, r.tag, r.failed):
        rc = _release_tag_slow(r, owners)
    tag_core_decref(r.tags)
    r.tags = NULL
    return rc


cdef int retire_handle_slot(daemon_core *c, uint32_t s, uint32_t gen) noexcept nogil:
    """Retires a C handle's slot if the daemon completed it: 1 if this call
    did, 0 if not (pending, or retired already)."""
    cdef retired_t r
    cdef bint done
    cdef int rc
    PyThread_acquire_lock(c.lock, WAIT_LOCK)
    done = unlink_completed(c, s, gen, dfccl_now_ns(), &r)
    PyThread_release_lock(c.lock)
    if not done:
        return 0
    rc = release_tag(&r, NULL)
    if c.pol_due:
        signal_progress()   # the policy adapts on the progress thread
    return rc if rc < 0 else 1


cdef int hold_for_stream(daemon_core *c, uint32_t s, uint32_t gen) noexcept nogil:
    """Counts slot ``s`` among the collectives streams wait for
    (ctrl.stream_waits), so that the daemon does not leave before it
    completes, and makes sure the daemon runs: a launch queued after the
    wait might never run (a hardware queue shared with the stream, the wait
    ahead of it).  The count drops when the watcher or retirement sees it
    complete."""
    cdef slot_rec *r = &c.slots[s]
    cdef bint counted = False
    PyThread_acquire_lock(c.lock, WAIT_LOCK)
    if r.gen == gen and r.state == SLOT_BUSY and not r.stream_waited and not completed(c, s):
        r.stream_waited = 1
        c.n_stream_waited += 1
        dfccl_store_release_u64(&c.ctrl.stream_waits, c.n_stream_waited)
        counted = True
    PyThread_release_lock(c.lock)
    if not counted:
        return 0
    # Dekker with the daemon's idle quit (schedule.cuh, should_quit).
    dfccl_fence_seq_cst()
    return ensure_running(c)


# ---------------------------------------------------------------------------
# C handles
# ---------------------------------------------------------------------------
cdef int _captured_handle(const char *what) noexcept with gil:
    return record_error(InvalidArgumentError(
        f"{what.decode()}: the handle names a collective captured in a CUDA graph, which has no completion on the "
        "host: it runs at each replay of its graph.  Make a stream under the same capture wait for it "
        "(stream_wait), and wait for the graph's stream after a replay"))


cdef int _check_handle(daemon_core *c, uint32_t s, uint32_t gen) noexcept nogil:
    cdef slot_rec *r
    if s < c.nslots:
        r = &c.slots[s]
        if r.gen == gen and not r.by_work and not r.released and r.state != SLOT_FREE:
            return 0
    return _bad_handle(s, gen)


cdef int _bad_handle(uint32_t s, uint32_t gen) noexcept with gil:
    return record_error(InvalidArgumentError(f"handle (slot {s}, generation {gen}) names no collective of this "
                                             "daemon (released already, or never returned by submit)"))


cdef int _device_failed(daemon_core *c) noexcept with gil:
    try:
        if c.py_daemon != NULL:
            (<object>c.py_daemon).fail_on_fault()
    except BaseException as exc:
        return record_error(exc)
    return fault_failure(c)


cdef int handle_test(daemon_core *c, uint32_t s, uint32_t gen, uint32_t *status, int32_t *detail) noexcept nogil:
    cdef slot_rec *r = &c.slots[s]
    cdef uint32_t st
    cdef int rc
    if gen == DFCCL_GRAPH_GEN_BIT:
        return _captured_handle(b"test")
    rc = _check_handle(c, s, gen)
    if rc < 0:
        return rc
    if r.state == SLOT_BUSY:
        if dfccl_load_acquire_u32(&c.done[s]) != gen:
            if dfccl_load_acquire_u32(&c.fault_word):
                return _device_failed(c)   # the device failed: it never completes
            if not r.abandoned:
                return DFCCL_API_PENDING
        else:
            rc = retire_handle_slot(c, s, gen)
            if rc < 0:
                return rc
    PyThread_acquire_lock(c.lock, WAIT_LOCK)
    st = r.status
    if status != NULL:
        status[0] = st
    if detail != NULL:
        detail[0] = r.detail
    PyThread_release_lock(c.lock)
    return DFCCL_API_OK if st == DFCCL_STATUS_OK else DFCCL_API_FAILED


cdef int handle_wait(daemon_core *c, uint32_t s, uint32_t gen, int64_t timeout_ns, uint32_t *status,
                     int32_t *detail) noexcept nogil:
    """Spins on the completion word, then yields the CPU between polls; never
    sleeps.  Gives up after ``timeout_ns`` (< 0: never), on a device fault,
    or when the handle is failed on the host (abort, close)."""
    cdef slot_rec *r = &c.slots[s]
    cdef uint64_t start, now
    cdef uint32_t spins = 0
    cdef int rc
    if gen == DFCCL_GRAPH_GEN_BIT:
        return _captured_handle(b"wait")
    rc = _check_handle(c, s, gen)
    if rc < 0:
        return rc
    start = dfccl_now_ns()
    while r.state == SLOT_BUSY and not r.abandoned and dfccl_load_acquire_u32(&c.done[s]) != gen:
        spins += 1
        if (spins & 15) != 0:
            dfccl_cpu_relax()
            continue
        if dfccl_load_acquire_u32(&c.fault_word):
            break
        now = dfccl_now_ns()
        if timeout_ns >= 0 and now - start >= <uint64_t>timeout_ns:
            break
        if now - start >= SPIN_BEFORE_YIELD_NS:
            dfccl_yield()
    return handle_test(c, s, gen, status, detail)


cdef int _stream_wait_slow(daemon_core *c, uint64_t stream, uint64_t addr, uint32_t value) noexcept with gil:
    try:
        (<Device>c.device).stream_wait32(stream, addr, value)
        return 0
    except BaseException as exc:
        return record_error(exc)


cdef int _captured_stream_wait(daemon_core *c, uint32_t s, uint64_t stream) noexcept with gil:
    """A stream under the same capture waits for each replay of the captured
    collective in slot ``s`` (Daemon._graph_stream_wait)."""
    try:
        if c.py_daemon == NULL or c.closed:
            return _refusal(c, 1, False)
        if s >= c.nslots or c.slots[s].state != SLOT_GRAPH:
            return record_error(InvalidArgumentError(
                f"stream_wait: the captured collective of this handle (slot {s}) is gone: its graph was destroyed"))
        (<object>c.py_daemon)._graph_stream_wait(stream, s)
        return 0
    except BaseException as exc:
        return record_error(exc)


cdef int handle_stream_wait(daemon_core *c, uint32_t s, uint32_t gen, uint64_t stream) noexcept nogil:
    cdef int rc
    if gen == DFCCL_GRAPH_GEN_BIT:
        return _captured_stream_wait(c, s, stream)
    rc = _check_handle(c, s, gen)
    if rc < 0:
        return rc
    return stream_wait(c, s, gen, stream)


cdef int stream_wait(daemon_core *c, uint32_t s, uint32_t gen, uint64_t stream) noexcept nogil:
    """Makes ``stream`` wait for slot ``s`` (cuStreamWaitValue32 on its
    completion word), once it holds the daemon for it."""
    cdef int rc
    if c.closed:
        return _refusal(c, 1, False)
    rc = hold_for_stream(c, s, gen)
    if rc < 0:
        return rc
    if (<Device>c.device).try_stream_wait32(stream, c.done_dev + 4 * s, gen) != 0:
        return _stream_wait_slow(c, stream, c.done_dev + 4 * s, gen)
    return 0


cdef int handle_release(daemon_core *c, uint32_t s, uint32_t gen) noexcept nogil:
    """The handle's owner is done with it: its slot is freed now if it has
    retired, else when it retires.  Drops the handle's reference to ``c``.
    A captured collective's slot is its graph's: its handle only lets go."""
    cdef slot_rec *r = &c.slots[s]
    cdef int rc
    if gen == DFCCL_GRAPH_GEN_BIT:
        core_decref(c)
        return 0
    rc = _check_handle(c, s, gen)
    if rc < 0:
        return rc
    PyThread_acquire_lock(c.lock, WAIT_LOCK)
    if r.state == SLOT_RETIRED:
        r.state = SLOT_FREE
        c.free_stack[c.n_free] = s
        c.n_free += 1
    else:
        r.released = 1
    PyThread_release_lock(c.lock)
    core_decref(c)
    return 0
