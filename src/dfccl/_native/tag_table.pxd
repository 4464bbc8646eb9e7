# A rank's tag table (tag_table.pyx): the TagTable that owns the C state
# the hot path reads and updates without the GIL (tag_instances.pxd).
from libc.stdint cimport int64_t, uint64_t
from dfccl._native.core cimport tag_core, tag_grant, tag_layout, tag_state


cdef class TagTable:
    cdef tag_core *t
    cdef dict _tags              # key -> address of its tag_state
    cdef dict _retired           # key -> [(offset, bytes)] of FIFOs it outgrew while instances used them
    cdef list _failed_owners
    cdef dict _captures          # key -> how often it was captured in a CUDA graph on this rank

    cpdef uint64_t graph_key(self, uint64_t key)
    cdef readonly object _staging

    cdef tag_state *state_of(self, uint64_t key)
    cdef int acquire_c(self, uint64_t key, bint transient, uint64_t nbytes, const tag_layout *layout,
                       bint has_layout, tag_grant *g) except -1
    cdef tag_state *_new_state(self, uint64_t key, bint transient) except NULL
    cdef void _forget(self, tag_state *st)
    cdef int _acquire_locked(self, uint64_t key, bint transient, uint64_t nbytes, const tag_layout *layout,
                             bint has_layout, tag_grant *g) except -1
    cdef int64_t _claim(self, uint64_t key) except -1
    cdef int _reserve(self, tag_state *st, uint64_t nbytes, const tag_layout *layout, bint has_layout) except -1
    cdef void _evict(self, tag_state *st)
    cdef void _unbind(self, tag_state *st)
    cdef int _release_locked(self, tag_state *st, bint failed, bint ran) except -1

