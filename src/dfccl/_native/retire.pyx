# cython: language_level=3
"""Retirement and the watcher.

A completed collective is retired once: its slot leaves the outstanding list
(freed, or kept for a C handle not released yet), its result reaches its
Work, its tag instance goes back to the tag table, the preemption policy
sees it, and its done-callbacks run.  Whoever sees the completion first
retires it: the thread waiting for it (Work.synchronize, the C API's test
and wait), the submitter that runs out of slots, or the progress thread
after the watcher found it.  A C handle's slot is retired in C
(completion.retire_handle_slot); a Work's needs the GIL to fill the Work.

The watcher (a thread per daemon, never holding the GIL) looks at the
completion words and the daemon every WATCH_POLL_NS while collectives are
outstanding: a collective it sees completed at two looks in a row was not
retired by a thread waiting for it (at the first look if it has
done-callbacks), so it wakes the progress thread (progress.py) to retire
it; a daemon that exited while a collective is not complete is brought
back after the backoff that lets device synchronisations return."""

import warnings

from cpython.pythread cimport PyThread_acquire_lock, PyThread_release_lock, NOWAIT_LOCK, WAIT_LOCK
from cpython.ref cimport PyObject, Py_DECREF
from libc.stdint cimport uint32_t, uint64_t
from libc.stdlib cimport calloc, free
from libc.string cimport memset

from dfccl._native.abi cimport *
from dfccl._native.device cimport Device
from dfccl._native.core cimport NO_SLOT, daemon_core, slot_rec
from dfccl._native.completion cimport (completed, drop_stream_wait, release_tag, retire_handle_slot, retired_t, unlink,
                                      unlink_completed)
from dfccl._native.launch cimport (ensure_running, exited, launch_locked, leaving, record_fault, signal_progress,
                                   take_error)
from dfccl._native.work cimport Work

from dfccl._native.progress import progress as _progress

cdef extern from "pythread.h":
    ctypedef enum PyLockStatus:
        PY_LOCK_FAILURE = 0
        PY_LOCK_ACQUIRED = 1
    PyLockStatus PyThread_acquire_lock_timed(void *lock, long long microseconds, int intr_flag) nogil

cdef enum:
    # How often the watcher of a busy daemon looks at the completion words
    # and the daemon's state (the relaunch backoff is measured in time, not
    # in looks).
    WATCH_POLL_NS = 100000
    # A daemon that leaves again and again with nothing retired in between
    # (its peers are absent) is brought back after a backoff that doubles each
    # time, up to this many doublings: it does not spin the device (or, in the
    # simulator, the CPU) at full duty for collectives that cannot move.
    WATCH_BACKOFF_DOUBLINGS = 4
    # How often the watcher of a busy daemon asks the device whether it has
    # failed (Device.query_fault: one driver call).
    FAULT_POLL_NS = 100000000


cdef void lock_gil(daemon_core *c) noexcept:
    """Takes the daemon's lock from a thread that holds the GIL, without
    holding the GIL while blocked: the lock's holder may need it to finish
    (any allocation can run the garbage collector, and with it Python code
    that lets other threads in)."""
    if not PyThread_acquire_lock(c.lock, NOWAIT_LOCK):
        with nogil:
            PyThread_acquire_lock(c.lock, WAIT_LOCK)


# ---------------------------------------------------------------------------
# retiring
# ---------------------------------------------------------------------------
cdef inline bint _due(daemon_core *c, uint32_t s) noexcept nogil:
    """A completed slot the progress thread should retire: the watcher saw it
    completed at its previous look as well, or it is wanted soon; not one
    that a pending collective follows (unlink_completed)."""
    cdef slot_rec *r = &c.slots[s]
    return (r.retire_soon or r.seen_done == r.gen) and not r.followed


cdef int retire_work(daemon_core *c, object policy, uint32_t s, uint32_t gen) except -1:
    """Moves a completed Work's result into it and frees its slot.
    Idempotent: whoever sees the completion first retires it."""
    cdef retired_t r
    cdef Work work = None
    cdef uint64_t now = dfccl_now_ns()
    lock_gil(c)
    try:
        if c.slots[s].by_work and unlink_completed(c, s, gen, now, &r):
            work = <Work>r.work
            Py_DECREF(work)   # the slot's reference; `work` holds one
            if not r.abandoned:
                work._finish(&r.result, now)
    finally:
        PyThread_release_lock(c.lock)
    if work is not None:
        after_retire(c, policy, work, &r)
    return 0


cdef int after_retire(daemon_core *c, object policy, Work work, retired_t *r) except -1:
    """Outside the lock: the tag's bookkeeping, the policy, callbacks."""
    held, work._keepalive = work._keepalive, None
    if not r.abandoned and work._status != DFCCL_STATUS_MISMATCH:
        # A mismatch is explained from every rank's record when first asked
        # for (Work._get_error), by when the peers have published theirs.
        work._error = work._final_error()
    release_tag_of(r, held)
    if r.abandoned:
        return 0   # failed earlier (abandon); the daemon has let go of it only now
    if c.pol_due:
        adapt_policy(c, policy)
    run_callbacks(work)
    return 0


cdef int release_tag_of(retired_t *r, object owners) except -1:
    """The retired instance goes back to its tag table; a failed one's
    ``owners`` (its buffers) stay there until no peer can reach them."""
    cdef PyObject *o = <PyObject *>owners if owners is not None else NULL
    cdef int rc
    with nogil:
        rc = release_tag(r, o)
    if rc < 0:
        raise take_error()
    return 0


cdef int retire_completed(daemon_core *c, object policy, bint due_only) except -1:
    """Retires completed slots: every one, or (the progress thread) those the
    watcher's look found due."""
    cdef uint32_t i, s, gen
    cdef list works = []
    cdef list handles = []
    cdef int rc
    lock_gil(c)
    for i in range(c.n_outstanding):
        s = c.outstanding[i]
        if completed(c, s) and (not due_only or _due(c, s)):
            (works if c.slots[s].by_work else handles).append((s, c.slots[s].gen))
    PyThread_release_lock(c.lock)
    for s, gen in works:
        retire_work(c, policy, s, gen)
    for s, gen in handles:
        with nogil:
            rc = retire_handle_slot(c, s, gen)
        if rc < 0:
            raise take_error()
    if c.pol_due:
        adapt_policy(c, policy)
    return 0


cdef int adapt_policy(daemon_core *c, object policy) except -1:
    """Once per period: the policy adapts the base window to what retired
    (policy.py) and the daemon gets the new one."""
    cdef uint32_t i
    lock_gil(c)
    if not c.pol_due:
        PyThread_release_lock(c.lock)
        return 0
    waits = [c.pol_waits[i] for i in range(c.pol_nwaits)]
    completions, preemptions = c.pol_completions, c.pol_preemptions
    c.pol_last_ns = dfccl_now_ns()
    c.pol_completions = c.pol_preemptions = 0
    c.pol_nwaits = 0
    c.pol_due = 0
    PyThread_release_lock(c.lock)
    base = policy.adapt(completions, preemptions, waits)
    if base is not None:
        c.ctrl.base_window_ns = base
    return 0


# ---------------------------------------------------------------------------
# failing on the host
# ---------------------------------------------------------------------------
cdef list fail_unretired(daemon_core *c, object err, bint completed_too):
    """Fails on the host every outstanding collective not retired yet (and,
    unless ``completed_too``, not completed by the daemon either: those
    retire as usual): Works with ``err``, C handles as aborted; their slots
    stay the daemon's until it lets go.  Returns the Works.  Reads no device
    word when ``completed_too``.  The caller holds the lock if others may
    run."""
    cdef Work work
    cdef slot_rec *r
    cdef uint32_t i, s
    cdef uint64_t now = dfccl_now_ns()
    cdef list failed = []
    for i in range(c.n_outstanding):
        s = c.outstanding[i]
        r = &c.slots[s]
        if r.abandoned or (not completed_too and completed(c, s)):
            continue
        if r.by_work:
            if r.work == NULL or (<Work>r.work)._retired:
                continue
            work = <Work>r.work
            work._fail_on_host(now)
            work._error = err
            failed.append(work)
        r.abandoned = 1
        r.status = DFCCL_STATUS_ABORTED
        r.detail = -1
    return failed


cdef bint abandon_work(daemon_core *c, Work work) except -1:
    """Fails ``work`` now with AbortedError without waiting for the daemon
    (an abort that must return); its slot, tag record and buffers stay
    reserved until the daemon lets go of them."""
    lock_gil(c)
    try:
        if work._retired or work._slot == NO_SLOT or c.slots[work._slot].work != <PyObject *>work:
            return False
        work._fail_on_host(dfccl_now_ns())
        work._abandoned = True
        c.slots[work._slot].abandoned = 1
    finally:
        PyThread_release_lock(c.lock)
    work._error = work._final_error()
    run_callbacks(work)
    return True


cdef int abandon_handles(daemon_core *c, uint32_t endpoint) noexcept nogil:
    """Fails now, as aborted, every C handle of ``endpoint`` the daemon has
    not completed; their slots stay taken until it lets go.  Returns how many."""
    cdef uint32_t i, s, n = 0
    cdef slot_rec *r
    PyThread_acquire_lock(c.lock, WAIT_LOCK)
    for i in range(c.n_outstanding):
        s = c.outstanding[i]
        r = &c.slots[s]
        if not r.by_work and r.endpoint == endpoint and not r.abandoned and not completed(c, s):
            r.abandoned = 1
            r.status = DFCCL_STATUS_ABORTED
            r.detail = -1
            n += 1
    PyThread_release_lock(c.lock)
    return n


cdef void run_callbacks(Work work):
    if work._callbacks:
        callbacks, work._callbacks = work._callbacks, None
        _progress.run_callbacks(work, callbacks)


cdef list close_slots(daemon_core *c, bint daemon_exited):
    """The daemon closes: every outstanding collective is retired now, with
    its result if the daemon finished it, else as aborted; nothing may read
    the daemon's memory after this.  Returns what collectives pending under
    a daemon that did not leave kept alive (it may still touch them)."""
    cdef dfccl_result aborted
    cdef retired_t *rs
    cdef Work work
    cdef uint32_t s, k, n = c.n_outstanding
    cdef bint finished
    cdef uint64_t now = dfccl_now_ns()
    cdef list kept = []
    cdef list works = []
    memset(&aborted, 0, sizeof(aborted))
    aborted.status = DFCCL_STATUS_ABORTED
    aborted.detail = -1
    rs = <retired_t *>calloc(max(n, 1), sizeof(retired_t))
    if rs == NULL:
        raise MemoryError
    lock_gil(c)
    try:
        for k in range(n):
            s = c.outstanding[c.n_outstanding - 1]
            finished = daemon_exited and completed(c, s) and not c.slots[s].abandoned
            unlink(c, s, &c.results[s] if finished else &aborted, &rs[k])
            work = None
            if rs[k].work != NULL:
                work = <Work>rs[k].work
                Py_DECREF(work)
                rs[k].work = NULL
                if not work._abandoned:
                    if finished:
                        work._finish(&rs[k].result, now)
                    else:
                        if not daemon_exited:
                            kept.append(work._keepalive)   # the daemon may still touch its buffers
                        work._fail_closed(now)
            works.append(work)
    finally:
        PyThread_release_lock(c.lock)
    try:
        for k in range(n):
            work = works[k]
            if work is None:
                release_tag_of(&rs[k], None)
                continue
            held, work._keepalive = work._keepalive, None
            if not rs[k].abandoned and work._status != DFCCL_STATUS_MISMATCH:
                work._error = work._final_error()
            release_tag_of(&rs[k], held)
            if not rs[k].abandoned:
                run_callbacks(work)
    finally:
        free(rs)
    return kept


# ---------------------------------------------------------------------------
# the watcher
# ---------------------------------------------------------------------------
cdef uint32_t _look(daemon_core *c, bint *unfinished) noexcept nogil:
    """The watcher's look at the completion words: returns how many completed
    slots are due for retirement, marks the others seen, and sets
    ``unfinished`` when some collective has not completed."""
    cdef uint32_t i, s, due = 0
    cdef slot_rec *r
    unfinished[0] = False
    PyThread_acquire_lock(c.lock, WAIT_LOCK)
    for i in range(c.n_outstanding):
        s = c.outstanding[i]
        r = &c.slots[s]
        if not completed(c, s):
            unfinished[0] = True
            continue
        drop_stream_wait(c, s)
        if r.by_work and r.work == NULL:
            continue   # its submitter attaches the Work next
        if _due(c, s):
            due += 1
        else:
            r.seen_done = r.gen
    PyThread_release_lock(c.lock)
    return due


cdef bint _check_fault(daemon_core *c) noexcept nogil:
    """The watcher, every FAULT_POLL_NS while busy: whether the device has
    failed under the daemon.  A failed device runs no kernel again, so
    nothing pending will complete: the progress thread (and any waiter,
    which polls fault_word) fails it all now."""
    cdef uint64_t now = dfccl_now_ns()
    if now < c.fault_next_ns:
        return False
    c.fault_next_ns = now + FAULT_POLL_NS
    return record_fault(c, (<Device>c.device).query_fault())


cdef int watch(daemon_core *c) noexcept nogil:
    """The watcher's loop (module docstring), until the daemon stops it.
    It never takes the GIL: a thread that blocks in a CUDA call while holding
    the GIL (a synchronising torch op waiting for a collective, say) must not
    keep the daemon away, or the collective it waits for never runs.
    Returns the code of a relaunch that failed (0: none)."""
    cdef uint64_t now
    cdef int rc = 0, code = 0
    cdef bint unfinished
    while not c.watch_stop:
        if c.n_graph_slots != 0:
            # A replay of a captured graph arms its collective on the device
            # alone: the host sees it only in graph_arms.  A replay armed
            # after the last launch, with the daemon gone, brings it back at
            # once (its stream waits for it).
            dfccl_sleep_ns(WATCH_POLL_NS)
            if (dfccl_load_acquire_u64(&c.ctrl.graph_arms) != c.graph_arms_launched
                    and (c.epoch == 0 or exited(c))):
                rc = ensure_running(c)
                if rc != 0:
                    code = (<Device>c.device).query_fault()
                    record_fault(c, code if code != 0 else rc)
                    break
            if c.n_outstanding == 0:
                if _check_fault(c):
                    break
                continue
        elif c.n_outstanding == 0:
            c.watch_streak = 0
            # Idle: sleep until a submission makes the daemon busy
            # (wake_watch), looking again at least every 50 ms.
            if PyThread_acquire_lock_timed(c.watch_wake, 50000, 0) == PY_LOCK_ACQUIRED:
                dfccl_exchange_u32(&c.watch_token, 0)
            continue
        if c.n_graph_slots == 0:
            dfccl_sleep_ns(WATCH_POLL_NS)
        if _look(c, &unfinished) != 0 or c.pol_due:
            signal_progress()  # the progress thread retires them
        if _check_fault(c):
            break
        if c.epoch == 0 or not exited(c):
            continue
        if not unfinished:
            # Only completed collectives wait for retirement (which may wait
            # for the GIL): they do not need the daemon, and bringing it back
            # would keep the GPU busy for nothing; a CUDA module load (lazy
            # loading) in a thread holding the GIL waits for the GPU to be free.
            c.exit_seen_ns = 0
            continue
        # Work is left but the daemon quit (idle: peers absent, or tasks not
        # armed yet).  Stay off for a backoff so that device syncs can
        # return, then come back.
        now = dfccl_now_ns()
        if c.exit_seen_ns == 0:
            c.exit_seen_ns = now
        elif now - c.exit_seen_ns >= c.relaunch_backoff_ns << c.watch_streak:
            # Nothing retired since the last relaunch: the next backoff
            # doubles (new submissions launch at once anyway).
            if c.retired_count == c.watch_retired_mark:
                if c.watch_streak < WATCH_BACKOFF_DOUBLINGS:
                    c.watch_streak += 1
            else:
                c.watch_streak = 0
            c.watch_retired_mark = c.retired_count
            PyThread_acquire_lock(c.launch_lock, WAIT_LOCK)
            if not c.watch_stop and leaving(c):
                rc = launch_locked(c)
            PyThread_release_lock(c.launch_lock)
            if rc != 0:
                # The daemon cannot come back (a failed device, say): what
                # is pending would never complete, so it fails as on a
                # failed device (Daemon.fail_on_fault).
                code = (<Device>c.device).query_fault()
                record_fault(c, code if code != 0 else rc)
                break
    return rc


def warn_relaunch_failed(Device device, int rc):
    warnings.warn(f"dfccl: relaunching the daemon on {device.where} failed: "
                  f"{device.launch_error(rc)}; its pending collectives fail", RuntimeWarning)
