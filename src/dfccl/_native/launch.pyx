# cython: language_level=3
"""A device's daemon on the host side, in C: the daemon's C state
(core.pxd, daemon_core) and its lifetime, the daemon's launches and relaunch
decisions, device faults, the progress thread's wake-up, and how the C
paths report errors.

Every function that can fail returns a dfccl_api_code
(cuda/include/dfccl/dfccl_api.h); a negative one's exception is kept for
the thread (record_error / take_error): the Python layer raises it, the C
API reports its message (last_error_message)."""

import threading

from cpython.pythread cimport (PyThread_type_lock, PyThread_allocate_lock,
                               PyThread_acquire_lock, PyThread_release_lock, WAIT_LOCK)
from libc.stdint cimport uint32_t, uint64_t
from libc.stdlib cimport calloc, free
from libc.string cimport strncpy

from dfccl._native.abi cimport *
from dfccl._native.device cimport Device
from dfccl._native.core cimport daemon_core, slot_rec

from dfccl.errors import BackendError, ClosedError, ResourceError

cdef extern from "pythread.h":
    void _pythread_free_lock "PyThread_free_lock"(PyThread_type_lock lock) nogil

cdef extern from *:
    """
    static char *dfccl_error_buffer(void) { static thread_local char buf[512]; return buf; }
    """
    char *dfccl_error_buffer() nogil

cdef enum:
    # How long the host waits for a quitting daemon to decide whether it
    # stays (it re-reads two host words: microseconds).
    DECIDE_NS = 50000000


# ---------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------
_kept = threading.local()


cdef int record_error(object exc) noexcept:
    """(GIL) Keeps ``exc`` as this thread's last error; returns its code."""
    cdef int code
    cdef bytes msg
    if isinstance(exc, ResourceError):
        code = DFCCL_API_E_RESOURCE
    elif isinstance(exc, ClosedError):
        code = DFCCL_API_E_CLOSED
    elif isinstance(exc, BackendError):
        code = DFCCL_API_E_BACKEND
    elif isinstance(exc, ValueError):
        code = DFCCL_API_E_INVALID
    else:
        code = DFCCL_API_E_PYTHON
    _kept.error = exc
    try:
        msg = f"{type(exc).__name__}: {exc}".encode("utf-8", "replace")[:511]
    except BaseException:   # an exception whose str() fails still has a code
        msg = type(exc).__name__.encode("utf-8", "replace")[:511]
    strncpy(dfccl_error_buffer(), msg, 511)
    dfccl_error_buffer()[511] = 0
    return code


cdef object take_error():
    """(GIL) This thread's last error, forgotten."""
    exc = getattr(_kept, "error", None)
    _kept.error = None
    return exc if exc is not None else RuntimeError("dfccl: an error was reported without an exception")


cdef const char *last_error_message() noexcept nogil:
    return dfccl_error_buffer()


cdef int fail(object exc_type, str message) noexcept with gil:
    return record_error(exc_type(message))


cdef int refusal(daemon_core *c, int nchannels, bint comm_closed) noexcept with gil:
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


# ---------------------------------------------------------------------------
# the progress thread's wake-up: a binary semaphore that C code without the
# GIL (a watcher, a retirement) can release.  Taken at import: "nothing to do".
# ---------------------------------------------------------------------------
cdef extern from "pythread.h":
    ctypedef enum PyLockStatus:
        PY_LOCK_FAILURE = 0
        PY_LOCK_ACQUIRED = 1
    PyLockStatus PyThread_acquire_lock_timed(PyThread_type_lock lock, long long microseconds, int intr_flag) nogil

cdef PyThread_type_lock _progress_sem = PyThread_allocate_lock()
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


# ---------------------------------------------------------------------------
# a daemon's C state
# ---------------------------------------------------------------------------
cdef daemon_core *core_new(uint32_t nslots, uint32_t nblocks) except NULL:
    cdef daemon_core *c = <daemon_core *>calloc(1, sizeof(daemon_core))
    cdef uint32_t i
    if c == NULL:
        raise MemoryError
    c.refs = 1
    c.nslots = nslots
    c.nblocks = nblocks
    c.slots = <slot_rec *>calloc(nslots, sizeof(slot_rec))
    c.outstanding = <uint32_t *>calloc(nslots, sizeof(uint32_t))
    c.free_stack = <uint32_t *>calloc(nslots, sizeof(uint32_t))
    c.pol_waits = <uint64_t *>calloc(POLICY_WAITS, sizeof(uint64_t))
    c.lock = PyThread_allocate_lock()
    c.launch_lock = PyThread_allocate_lock()
    c.submit_lock = PyThread_allocate_lock()
    c.watch_wake = PyThread_allocate_lock()
    if (c.slots == NULL or c.outstanding == NULL or c.free_stack == NULL or c.pol_waits == NULL or c.lock == NULL
            or c.launch_lock == NULL or c.submit_lock == NULL or c.watch_wake == NULL):
        core_decref(c)
        raise MemoryError
    # A binary semaphore: taken here, released by wake_watch.
    PyThread_acquire_lock(c.watch_wake, WAIT_LOCK)
    for i in range(nslots):
        c.free_stack[i] = nslots - 1 - i
    c.n_free = nslots
    return c


cdef void core_incref(daemon_core *c) noexcept nogil:
    dfccl_add_fetch_u32(&c.refs, 1)


cdef void core_decref(daemon_core *c) noexcept nogil:
    if dfccl_add_fetch_u32(&c.refs, -1) != 0:
        return
    free(c.slots)
    free(c.outstanding)
    free(c.free_stack)
    free(c.pol_waits)
    _free_lock(c.lock)
    _free_lock(c.launch_lock)
    _free_lock(c.submit_lock)
    _free_lock(c.watch_wake)
    free(c)


cdef inline void _free_lock(PyThread_type_lock lock) noexcept nogil:
    if lock != NULL:
        _pythread_free_lock(lock)


cdef void wake_watch(daemon_core *c) noexcept nogil:
    """Wakes an idle watcher (at most one token outstanding)."""
    if dfccl_exchange_u32(&c.watch_token, 1) == 0:
        PyThread_release_lock(c.watch_wake)


# ---------------------------------------------------------------------------
# the daemon
# ---------------------------------------------------------------------------
cdef bint leaving(daemon_core *c) noexcept nogil:
    """The daemon has not been launched, or its current launch is leaving or
    gone.  A launch that announced QUITTING is deciding (schedule.cuh,
    should_quit): this waits for its decision, so that no launch is queued
    behind a daemon that stays (on a hardware queue shared with an
    application stream, that launch would hold up the stream until the
    daemon leaves).  No decision within DECIDE_NS (a daemon that died
    deciding) counts as leaving."""
    cdef uint64_t state, st, deadline = 0
    if c.epoch == 0:
        return True
    while True:
        state = dfccl_load_acquire_u64(&c.ctrl.daemon_state)
        if (state >> DFCCL_DAEMON_EPOCH_SHIFT) != c.epoch:
            return False  # not started yet: it will see what the host wrote
        st = state & DFCCL_DAEMON_STATE_MASK
        if st != DFCCL_DAEMON_QUITTING:
            return st == DFCCL_DAEMON_LEAVING or st == DFCCL_DAEMON_EXITED
        if deadline == 0:
            deadline = dfccl_now_ns() + DECIDE_NS
        elif dfccl_now_ns() > deadline:
            return True
        dfccl_cpu_relax()


cdef bint exited(daemon_core *c) noexcept nogil:
    """Every block of the current launch has left."""
    cdef uint64_t state = dfccl_load_acquire_u64(&c.ctrl.daemon_state)
    return (state >> DFCCL_DAEMON_EPOCH_SHIFT) == c.epoch and (state & DFCCL_DAEMON_STATE_MASK) == DFCCL_DAEMON_EXITED


cdef int launch_locked(daemon_core *c) noexcept nogil:
    """Launches the daemon (the launch lock held); returns the backend's
    code, 0 on success."""
    cdef int rc
    c.epoch += 1
    c.args.epoch = <uint32_t>c.epoch
    c.exit_seen_ns = 0
    # Graph replays armed after this read relaunch it if it leaves (retire.pyx, watch).
    c.graph_arms_launched = dfccl_load_acquire_u64(&c.ctrl.graph_arms)
    rc = (<Device>c.device).launch(&c.args)
    if rc == 0:
        c.launches += 1
    return rc


cdef bint record_fault(daemon_core *c, int code) noexcept nogil:
    """The device reported ``code`` (nonzero: it has failed): every pending
    collective is to fail (Daemon.fail_on_fault, on the progress thread or a
    waiter), and nothing more is submitted."""
    if code == 0:
        return False
    c.device_fault = code
    dfccl_store_release_u32(&c.fault_word, 1)
    signal_progress()
    return True


cdef int fault_failure(daemon_core *c) noexcept with gil:
    try:
        return record_error((<object>c.py_daemon)._fault_error())
    except BaseException as exc:
        return record_error(exc)


cdef int _launch_failure(daemon_core *c, int rc) noexcept with gil:
    # A launch on a failed device fails with its error: say that.
    if record_fault(c, (<Device>c.device).query_fault()):
        return fault_failure(c)
    return record_error((<Device>c.device).launch_error(rc))


cdef int ensure_running(daemon_core *c) noexcept nogil:
    """Launches the daemon if it has not been launched or is leaving."""
    cdef int rc = 0
    if c.device_fault:
        return fault_failure(c)
    if not leaving(c):
        return 0
    PyThread_acquire_lock(c.launch_lock, WAIT_LOCK)
    if leaving(c):
        rc = launch_locked(c)
    PyThread_release_lock(c.launch_lock)
    if rc != 0:
        return _launch_failure(c, rc)
    return 0
