# cython: language_level=3
"""A tag's instances in C: what a submission and a retirement of a tag that
already has its bucket and staging change (instance counter, pending count,
idle list, layout, latest slot), without the GIL, under the table's lock:
tag_acquire_fast and tag_release_fast, called by the hot path, and
take_instance, which the TagTable's rare paths end with too.  Also the
table's C state's lifetime (tag_core_incref / tag_core_decref): a slot or a
C handle in flight keeps it.  The rest is the TagTable's (tag_table.pyx),
which the hot path falls back to whenever a fast call declines."""

from cpython.pythread cimport PyThread_type_lock, PyThread_acquire_lock, PyThread_release_lock, WAIT_LOCK
from libc.stdint cimport uint32_t, uint64_t
from libc.stdlib cimport free

from dfccl._native.abi cimport DFCCL_FIFO_NO_STAGE, dfccl_add_fetch_u32

__all__ = []   # C only (tag_instances.pxd)


cdef extern from "pythread.h":
    void _free_lock "PyThread_free_lock"(PyThread_type_lock lock) nogil



cdef void tag_core_incref(tag_core *t) noexcept nogil:
    dfccl_add_fetch_u32(&t.refs, 1)


cdef void tag_core_decref(tag_core *t) noexcept nogil:
    cdef uint32_t i
    if dfccl_add_fetch_u32(&t.refs, -1) != 0:
        return
    for i in range(t.nchunks):
        free(t.chunks[i])
    free(t.chunks)
    free(t.owner)
    free(t.keyed)
    if t.lock != NULL:
        _free_lock(t.lock)
    free(t)


cdef void take_instance(tag_core *t, tag_state *st, uint64_t nbytes, const tag_layout *layout, bint has_layout,
                tag_grant *g) noexcept nogil:
    """Under the lock, the tag bound and its staging (if it needs any) large
    enough: takes its next instance.  Instances that lay the staging out
    alike use the same part of it on each channel, so per-channel order is
    enough; one laid out differently would write where another channel of a
    pending instance still works, so it runs after the latest one is over
    everywhere (``after``)."""
    g.offset = 0
    g.shape = 0
    g.after = 0
    if nbytes:
        if st.pending and not same_layout(st, layout, has_layout):
            g.after = st.last_slot_gen
        set_layout(st, layout, has_layout)
        g.offset = <uint64_t>st.fifo
        if staged(layout, has_layout):
            # The staging is also the fallback ring's FIFO; without room
            # for the copies, the ring is what runs.
            g.shape = fifo_shape(st.fifo_bytes, layout) | (DFCCL_FIFO_NO_STAGE if st.fifo_bytes < nbytes else 0)
        elif st.fifo_bytes < nbytes:
            g.shape = fifo_shape(st.fifo_bytes, layout)
    if st.pending == 0 and not st.poisoned:
        idle_remove(t, st)
        t.used += 1
    st.submitted += 1
    st.pending += 1
    g.bucket = st.bucket
    g.instance = st.submitted
    g.keyed = t.keyed[st.bucket]


cdef bint tag_acquire_fast(tag_core *t, tag_state *st, uint64_t key, uint64_t nbytes, const tag_layout *layout,
                           bint has_layout, tag_grant *g) noexcept nogil:
    """The next instance of ``st`` (the state a descriptor last saw for
    ``key``) when it still is that tag's, is bound and its staging fits;
    False (nothing changed) otherwise: TagTable.acquire_staged decides."""
    cdef bint ok = False
    if st == NULL:
        return False
    PyThread_acquire_lock(t.lock, WAIT_LOCK)
    if st.live and st.key == key and st.bucket >= 0 and (nbytes == 0 or (st.fifo >= 0 and st.fifo_bytes >= nbytes)):
        take_instance(t, st, nbytes, layout, has_layout, g)
        ok = True
    PyThread_release_lock(t.lock)
    return ok


cdef bint tag_release_fast(tag_core *t, tag_state *st, bint failed) noexcept nogil:
    """One instance of ``st`` retired (it reached the daemon).  False
    (nothing changed) when its tag's last pending instance gives staging back
    or forgets the tag: TagTable.release does that."""
    cdef bint ok = True
    PyThread_acquire_lock(t.lock, WAIT_LOCK)
    if st.pending == 1 and not failed and not st.poisoned and (st.retired_fifos or st.transient):
        ok = False
    else:
        t.keyed[st.bucket] = 1
        st.pending -= 1
        if failed:
            st.poisoned = 1
        if st.pending == 0 and not st.poisoned:
            t.used -= 1
            idle_append(t, st)
    PyThread_release_lock(t.lock)
    return ok


cdef void tag_note_slot(tag_core *t, tag_state *st, uint64_t slot_gen) noexcept nogil:
    PyThread_acquire_lock(t.lock, WAIT_LOCK)
    st.last_slot_gen = slot_gen
    PyThread_release_lock(t.lock)
