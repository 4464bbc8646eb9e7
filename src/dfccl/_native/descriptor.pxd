# What the daemon runs (descriptor.pyx): the ABI's constants for Python, the
# daemon's hashes, and the TaskDescriptor that owns a bound collective.
from libc.stdint cimport uint64_t
from dfccl._native.core cimport plan_t
from dfccl._native.tag_table cimport TagTable


cdef class TaskDescriptor:
    cdef plan_t plan
    cdef readonly str kind
    cdef readonly object tag
    cdef readonly int rank
    cdef readonly uint64_t key
    cdef readonly bint transient
    cdef readonly uint64_t staging_bytes
    cdef readonly object owners
    cdef TagTable tags
    cdef object flight        # the flight recorder's ring (a deque) or None
    cdef object daemon           # the Daemon it is bound to: plan.core stays valid while this lives


cdef int override_fields(void *desc, dict fields) except -1
