# What the daemon runs (descriptor.pyx): the ABI's constants for Python, the
# daemon's hashes, and the TaskDescriptor that owns a bound collective.
from libc.stdint cimport uint32_t, uint64_t
from libc.string cimport memcpy
from dfccl._native.abi cimport DFCCL_TASK_KEY_BUCKET, dfccl_task_desc
from dfccl._native.core cimport plan_t, tag_grant
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


cdef inline void fill_instance(dfccl_task_desc *d, const plan_t *p, const tag_grant *g, uint64_t send_addr,
                               uint64_t recv_addr, uint32_t slot) noexcept nogil:
    """``d``: the plan's descriptor for the instance ``g`` granted, on these
    buffers, in ``slot`` (the submitter sets gen, after and its arming)."""
    memcpy(d, &p.desc, sizeof(dfccl_task_desc))
    d.send_addr = send_addr
    d.recv_addr = recv_addr
    d.instance = g.instance
    d.fifo_offset = g.offset | g.shape
    d.bucket = <uint32_t>g.bucket
    if not g.keyed:
        d.flags = d.flags | DFCCL_TASK_KEY_BUCKET
    d.slot = slot
