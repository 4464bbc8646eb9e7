# The host hot path's submission in C (hotpath.pyx).  It runs without the
# GIL and returns a dfccl_api_code (abi.pxd); a negative one's exception is
# kept for this thread (launch.pxd, take_error).
from cpython.ref cimport PyObject
from libc.stdint cimport uint32_t, uint64_t
from dfccl._native.core cimport daemon_core, plan_t


cdef struct submitted_t:
    uint32_t slot
    uint32_t gen
    uint64_t instance
    uint64_t position           # its entry in the submission ring


cdef int submit(daemon_core *c, plan_t *p, uint64_t send_addr, uint64_t recv_addr, bint has_stream, uint64_t stream,
                bint by_work, PyObject *raw, submitted_t *out) noexcept nogil


cdef int check_graph_failures(daemon_core *c, uint32_t endpoint) noexcept nogil
