# A submitted collective's completion in C (completion.pyx): retirement
# primitives, stream waits and the C API's handles.  Every function runs
# without the GIL; those that can fail return a dfccl_api_code (abi.pxd),
# a negative one's exception kept for this thread (launch.pxd, take_error).
from cpython.ref cimport PyObject
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t
from dfccl._native.abi cimport dfccl_result
from dfccl._native.core cimport daemon_core, tag_core, tag_state


cdef struct retired_t:
    dfccl_result result
    PyObject *work              # the Work's reference, handed to the caller (NULL: a C handle)
    tag_core *tags              # a reference, dropped by release_tag
    tag_state *tag
    uint64_t key
    uint64_t aux_offset
    uint64_t aux_bytes
    bint failed
    bint abandoned


# retire
cdef bint completed(daemon_core *c, uint32_t s) noexcept nogil
cdef void unlink(daemon_core *c, uint32_t s, const dfccl_result *result, retired_t *out) noexcept nogil
cdef bint unlink_completed(daemon_core *c, uint32_t s, uint32_t gen, uint64_t now, retired_t *out) noexcept nogil
cdef int release_tag(retired_t *r, PyObject *owners) noexcept nogil
cdef int retire_handle_slot(daemon_core *c, uint32_t s, uint32_t gen) noexcept nogil
cdef void drop_stream_wait(daemon_core *c, uint32_t s) noexcept nogil
cdef int hold_for_stream(daemon_core *c, uint32_t s, uint32_t gen) noexcept nogil
cdef int stream_wait(daemon_core *c, uint32_t s, uint32_t gen, uint64_t stream) noexcept nogil

# C handles
cdef int handle_test(daemon_core *c, uint32_t s, uint32_t gen, uint32_t *status, int32_t *detail) noexcept nogil
cdef int handle_wait(daemon_core *c, uint32_t s, uint32_t gen, int64_t timeout_ns, uint32_t *status,
                     int32_t *detail) noexcept nogil
cdef int handle_stream_wait(daemon_core *c, uint32_t s, uint32_t gen, uint64_t stream) noexcept nogil
cdef int handle_release(daemon_core *c, uint32_t s, uint32_t gen) noexcept nogil
