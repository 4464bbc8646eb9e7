# cython: language_level=3
"""A submitted collective's completion, in C: whether the daemon completed
a slot, unlinking it from the outstanding list and giving its tag instance
back (retire.pyx retires Works with these), a stream's wait for it, and the
C API's handles (test, wait, stream_wait, release).  hotpath.pyx submits.

Every function here runs without the GIL and returns a dfccl_api_code
(cuda/include/dfccl/dfccl_api.h), or a plain answer where it cannot fail.
The rare paths take the GIL: the tag table's (staging to give back, a
transient tag to forget), errors, a captured collective's stream wait,
stream waits that failed.  Locks as in hotpath.pyx: slots and the
outstanding list under the daemon's lock, a tag's state under its table's."""

from cpython.pythread cimport PyThread_acquire_lock, PyThread_release_lock, WAIT_LOCK
from cpython.ref cimport PyObject
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t

from dfccl._native.abi cimport *
from dfccl._native.device cimport Device
from dfccl._native.core cimport SLOT_BUSY, SLOT_FREE, SLOT_GRAPH, SLOT_RETIRED, daemon_core, slot_rec
from dfccl._native.launch cimport (POLICY_WAITS, core_decref, ensure_running, fault_failure, record_error, refusal,
                                   signal_progress)
from dfccl._native.tag_instances cimport tag_core_decref, tag_release_fast
from dfccl._native.tag_table cimport TagTable

from dfccl.errors import InvalidArgumentError

__all__ = []   # C only (completion.pxd)

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
    if r.follows:
        # The daemon has read the followed one's result: it may go.
        if c.slots[r.follows - 1].gen == r.follows_gen:
            c.slots[r.follows - 1].followed = 0
        r.follows = 0
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
    daemon completed it, (for a Work's) its Work is attached and no pending
    collective follows it (its follower's unlink lets it go)."""
    cdef slot_rec *r = &c.slots[s]
    if r.state != SLOT_BUSY or r.gen != gen or (r.by_work and r.work == NULL) or r.followed:
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
    """Polls the completion word, pausing between polls as every host wait
    does (dfccl_wait_pause: spin, yield, then short sleeps).  Gives up after
    ``timeout_ns`` (< 0: never), on a device fault, or when the handle is
    failed on the host (abort, close)."""
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
        dfccl_wait_pause(now - start)
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
            return refusal(c, 1, False)
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
        return refusal(c, 1, False)
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
