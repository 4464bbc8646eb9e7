# A daemon's communicator ranks (endpoints.pyx): a base of Daemon.
from libc.stdint cimport uint32_t, uint64_t
from dfccl._native.inspection cimport DaemonBase


cdef class DaemonEndpoints(DaemonBase):
    cdef readonly uint32_t max_endpoints
    cdef uint64_t endpoints_dev
    cdef list free_endpoints
    cdef dict draining_endpoints      # id -> on_released: removed, the daemon still holds collectives of it
    cdef readonly dict diagnostics    # endpoint id -> what explains its failures (dfccl.diagnostics)

    cdef void _abort_flags_changed(self) noexcept
    cdef int _ensure_running(self) except -1
