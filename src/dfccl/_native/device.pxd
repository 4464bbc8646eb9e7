from libc.stdint cimport uint32_t, uint64_t
from dfccl._native.abi cimport dfccl_daemon_args, dfccl_graph_arm


cdef class Device:
    cdef readonly str backend    # "cuda" or "sim": the implementation
    cdef readonly int ordinal    # the device number within its backend
    cdef readonly int default_blocks
    cdef readonly int block_threads
    cdef readonly int resident_blocks   # daemon blocks that can be resident at once (0: no limit)

    cdef int launch(self, const dfccl_daemon_args *args) noexcept nogil
    cdef int query_fault(self) noexcept nogil
    cdef int stream_write32(self, uint64_t stream, uint64_t addr, uint32_t value) except -1
    cdef int stream_wait32(self, uint64_t stream, uint64_t addr, uint32_t value) except -1
    cdef int try_stream_write32(self, uint64_t stream, uint64_t addr, uint32_t value) noexcept nogil
    cdef int try_stream_wait32(self, uint64_t stream, uint64_t addr, uint32_t value) noexcept nogil
    cdef int stream_capturing(self, uint64_t stream) except -1
    cdef int try_stream_capturing(self, uint64_t stream) noexcept nogil
    cdef int stream_wait_mask32(self, uint64_t stream, uint64_t addr, uint32_t mask) except -1
    cdef int stream_graph_arm(self, uint64_t stream, const dfccl_daemon_args *args, const dfccl_graph_arm *arm) except -1
    cdef int retain_for_capture(self, uint64_t stream, uint32_t *released) except -1
