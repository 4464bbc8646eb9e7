# The Work a collective returns (work.pyx): a Python handle on a completion
# slot; the daemon fills it at submission and retires it (retire.pyx).
from libc.stdint cimport int32_t, uint32_t, uint64_t
from dfccl._native.abi cimport dfccl_result
from dfccl._native.core cimport NO_SLOT


cdef class Work:
    cdef object _daemon           # the Daemon that submitted it (None: refers to nothing)
    cdef uint32_t *_done          # its slot's completion word (host-mapped)
    cdef uint32_t *_waiting       # its slot's live "waiting on" word (host-mapped)
    cdef uint32_t *_fault         # its daemon's fault word: nonzero once the device failed
    cdef uint32_t _slot
    cdef uint32_t _gen
    cdef bint _retired
    cdef bint _has_result
    cdef uint32_t _status
    cdef int32_t _detail
    cdef dfccl_result _result
    cdef list _callbacks
    cdef object _keepalive
    cdef uint64_t _key
    cdef readonly uint32_t endpoint
    cdef readonly str kind
    cdef readonly object tag
    cdef readonly int rank
    cdef readonly int instance
    cdef readonly uint64_t position   # its entry in the submission ring (Daemon.submissions)
    cdef readonly bint stream_ordered # armed by a stream write, not at submission
    cdef uint64_t _submitted_ns
    cdef uint64_t _retired_ns
    cdef object _error
    cdef bint _abandoned
    cdef readonly bint captured       # captured in a CUDA graph: it runs at each replay, ordered on its stream
    cdef object _chain                # the last part of a hierarchical collective: its Chain (hierarchy.py), which
                                      # says what the whole failed of; None otherwise
    cdef tuple _part_names            # with a chain: the part's own (kind, tag, rank), which its own errors name
                                      # (_own_names)

    cdef int _check_submitted(self) except -1
    cdef int _refuse_captured(self, str what) except -1
    cdef bint _device_done(self)
    cdef object _timeout_error(self, timeout)
    cdef object _own_timeout_error(self, timeout)
    cdef tuple _own_names(self)
    cdef void _finish(self, const dfccl_result *res, uint64_t now)
    cdef void _fail_on_host(self, uint64_t now)
    cdef void _fail_closed(self, uint64_t now)
    cdef object _get_error(self)
    cdef object _final_error(self)
    cdef object _make_error(self)
