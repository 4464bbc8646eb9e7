# A device's daemon on the host side (launch.pyx): the daemon's C state,
# launches, faults, the progress thread's wake-up, and the errors of the C
# paths.  Functions that can fail return a dfccl_api_code (abi.pxd).
from libc.stdint cimport uint32_t
from dfccl._native.core cimport daemon_core

cdef enum:
    POLICY_WAITS = 4096        # longest waits the preemption policy keeps per period

# errors
cdef int record_error(object exc) noexcept
cdef object take_error()
cdef const char *last_error_message() noexcept nogil
cdef int fail(object exc_type, str message) noexcept with gil
cdef int fault_failure(daemon_core *c) noexcept with gil
cdef int refusal(daemon_core *c, int nchannels, bint comm_closed) noexcept with gil

# the progress thread's wake-up
cdef void signal_progress() noexcept nogil

# a daemon's C state
cdef daemon_core *core_new(uint32_t nslots, uint32_t nblocks) except NULL
cdef void core_incref(daemon_core *c) noexcept nogil
cdef void core_decref(daemon_core *c) noexcept nogil
cdef void wake_watch(daemon_core *c) noexcept nogil

# the daemon
cdef bint leaving(daemon_core *c) noexcept nogil
cdef bint exited(daemon_core *c) noexcept nogil
cdef int launch_locked(daemon_core *c) noexcept nogil
cdef int ensure_running(daemon_core *c) noexcept nogil
cdef bint record_fault(daemon_core *c, int code) noexcept nogil
