# A context's communicator ranks (endpoints.pyx): a base of Context.
from libc.stdint cimport uint32_t, uint64_t
from dfccl._native.inspection cimport ContextBase


cdef class ContextEndpoints(ContextBase):
    cdef readonly uint32_t max_endpoints
    cdef uint64_t endpoints_dev
    cdef list free_endpoints
    cdef dict draining_endpoints      # id -> on_released: removed, the daemon still holds collectives of it
    cdef readonly dict diagnostics    # endpoint id -> what explains its failures (dfccl.diagnostics)

    cdef void _abort_flags_changed(self) noexcept
    cdef int _ensure_running(self) except -1
