# A tag's instances in C (tag_instances.pyx): what the hot path takes and
# gives back without the GIL, under the table's lock.  The small helpers are
# inline here, shared with the TagTable's rare paths (tag_table.pyx).
from libc.stdint cimport uint64_t
from libc.string cimport memcmp
from dfccl._native.abi cimport (DFCCL_ALL_TO_ALL, DFCCL_FIFO_SLOTS_MAX, DFCCL_FIFO_SLOTS_SHIFT, DFCCL_FIFO_UNIT_BYTES,
                                DFCCL_FIFO_UNIT_MAX, DFCCL_FIFO_UNIT_SHIFT, DFCCL_PATH_DIRECT, DFCCL_PATH_RING,
                                DFCCL_TASK_STAGED)
from dfccl._native.core cimport tag_core, tag_grant, tag_layout, tag_state

cdef enum:
    NO_FIT = 1     # fifo_shape: the FIFO holds less than two 16-byte slots per channel


cdef inline void idle_append(tag_core *t, tag_state *st) noexcept nogil:
    st.idle = 1
    st.idle_next = NULL
    st.idle_prev = t.idle_tail
    if t.idle_tail != NULL:
        t.idle_tail.idle_next = st
    else:
        t.idle_head = st
    t.idle_tail = st
    t.nidle += 1


cdef inline void idle_remove(tag_core *t, tag_state *st) noexcept nogil:
    if not st.idle:
        return
    if st.idle_prev != NULL:
        st.idle_prev.idle_next = st.idle_next
    else:
        t.idle_head = st.idle_next
    if st.idle_next != NULL:
        st.idle_next.idle_prev = st.idle_prev
    else:
        t.idle_tail = st.idle_prev
    st.idle = 0
    st.idle_prev = st.idle_next = NULL
    t.nidle -= 1


cdef inline bint same_layout(tag_state *st, const tag_layout *layout, bint has_layout) noexcept nogil:
    if st.has_layout != has_layout:
        return False
    return not has_layout or memcmp(&st.layout, layout, sizeof(tag_layout)) == 0


cdef inline void set_layout(tag_state *st, const tag_layout *layout, bint has_layout) noexcept nogil:
    st.has_layout = has_layout
    if has_layout:
        st.layout = layout[0]


cdef inline bint staged(const tag_layout *layout, bint has_layout) noexcept nogil:
    """Whether the collective is staged direct (tag_layout words as
    descriptor.pyx writes them)."""
    return (has_layout and (layout.w[1] >> 16) & 0xff == DFCCL_PATH_DIRECT
            and (layout.w[2] & DFCCL_TASK_STAGED) != 0)


cdef inline bint loops(const tag_layout *layout, bint has_layout) noexcept nogil:
    """Whether the collective can run through a FIFO of any shape: a ring
    collective, a recv through its FIFO (the sender cuts the message in the
    receiver's slots), or a staged direct one (which then falls back to the
    ring)."""
    cdef uint64_t kind = layout.w[1] & 0xff
    if staged(layout, has_layout):
        return True
    return (has_layout and (layout.w[1] >> 16) & 0xff == DFCCL_PATH_RING
            and kind != DFCCL_ALL_TO_ALL)


cdef inline uint64_t fifo_shape(uint64_t fifo_bytes, const tag_layout *layout) noexcept nogil:
    """The shape bits (abi.h, DFCCL_FIFO_*) of ``fifo_bytes`` of FIFO laid
    out for ``layout``: 0 when it holds the planned slots, else as many
    planned slices as fit (two at least), else at least two smaller slots;
    NO_FIT when not even two 16-byte slots per channel fit."""
    cdef uint64_t nch = layout.w[1] >> 32
    cdef uint64_t planned = layout.w[2] >> 32
    cdef uint64_t per_ch, unit
    if nch == 0 or planned == 0:
        return NO_FIT
    per_ch = fifo_bytes // nch // DFCCL_FIFO_UNIT_BYTES * DFCCL_FIFO_UNIT_BYTES
    if per_ch >= planned * layout.w[3]:
        return 0
    if per_ch >= 2 * planned:
        return min(per_ch // planned, <uint64_t>DFCCL_FIFO_SLOTS_MAX) << DFCCL_FIFO_SLOTS_SHIFT
    unit = min(per_ch // 2 // DFCCL_FIFO_UNIT_BYTES, <uint64_t>DFCCL_FIFO_UNIT_MAX)
    if unit == 0:
        return NO_FIT
    return ((min(per_ch // (unit * DFCCL_FIFO_UNIT_BYTES), <uint64_t>DFCCL_FIFO_SLOTS_MAX) << DFCCL_FIFO_SLOTS_SHIFT)
            | (unit << DFCCL_FIFO_UNIT_SHIFT))



cdef void tag_core_incref(tag_core *t) noexcept nogil
cdef void tag_core_decref(tag_core *t) noexcept nogil
cdef void take_instance(tag_core *t, tag_state *st, uint64_t nbytes, const tag_layout *layout, bint has_layout,
                        tag_grant *g) noexcept nogil
cdef bint tag_acquire_fast(tag_core *t, tag_state *st, uint64_t key, uint64_t nbytes, const tag_layout *layout,
                           bint has_layout, tag_grant *g) noexcept nogil
cdef bint tag_release_fast(tag_core *t, tag_state *st, bint failed) noexcept nogil
cdef void tag_note_slot(tag_core *t, tag_state *st, uint64_t slot_gen) noexcept nogil
