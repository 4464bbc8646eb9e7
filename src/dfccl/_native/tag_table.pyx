# cython: language_level=3
"""A rank's tag table: which bucket of its record table holds which tag, how
many instances of each tag this rank has taken, and the staging each tag's
instances share (dfccl.tags explains tags, keys and records).

The state is C (core.pxd: tag_core, tag_state), so that what a submission
and a retirement of a tag that already has its bucket and staging change
(instance counter, pending count, idle list, layout, latest slot) runs
without the GIL under the table's lock: tag_instances.pyx, called by the
hot path.  The rest (claiming a bucket, reserving, growing or evicting
staging, forgetting a transient tag, errors) is the TagTable's methods
here, which hold the GIL; the hot path falls back to them whenever a fast
call declines.

A tag keeps its bucket (and its staging) while it is idle, so that the next
instance finds its record, its peers' cached record addresses and its FIFO
where the last one left them.  An idle bucket goes to another tag whose
probe sequence reaches it before a free one; idle staging is given back when
the pool runs short.  Instances of one tag run one after the other on each
channel (the daemon chains them, cuda/daemon/submit.cuh), so one FIFO
serves all of them.  A bucket whose instance failed stays bound to its tag
for good: peers may still read the abort marker in it.

No collective tag runs out of staging: when the shared staging cannot hold
what a ring collective planned, it loops through the FIFO it has, or else
through a reserved block, one of which exists for every tag that can be
pending (staging.py); the FIFO's shape travels in the descriptor and the
daemon adapts the slice (abi.h, DFCCL_FIFO_*).  A staged direct collective
without room for its copies takes such a FIFO too and says so
(DFCCL_FIFO_NO_STAGE): every rank then runs it as a ring.  Only staging an
instance needs whole on its own (all-to-all tables and copies) raises
ResourceError when it is not free."""

from cpython.pythread cimport PyThread_allocate_lock, PyThread_acquire_lock, PyThread_release_lock, NOWAIT_LOCK, WAIT_LOCK
from cpython.ref cimport PyObject
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport calloc, realloc
from libc.string cimport memset

from dfccl._native.abi cimport dfccl_graph_key, dfccl_home_bucket
from dfccl._native.core cimport tag_core, tag_grant, tag_layout, tag_state
from dfccl._native.tag_instances cimport (NO_FIT, fifo_shape, idle_append, idle_remove, loops, set_layout,
                                          tag_core_decref, tag_note_slot, take_instance)

from dfccl.errors import ResourceError

__all__ = ["TagTable"]

cdef enum:
    CHUNK = 64     # tag states allocated at a time (their addresses never change)

_MASK64 = (1 << 64) - 1


cdef inline void _lock(tag_core *t) noexcept:
    """Takes the table's lock from a thread that holds the GIL, without
    holding the GIL while blocked: a thread in a rare path may need it."""
    if not PyThread_acquire_lock(t.lock, NOWAIT_LOCK):
        with nogil:
            PyThread_acquire_lock(t.lock, WAIT_LOCK)


cdef enum:
    # _reserve: the smallest shared FIFO handed out short of the planned one,
    # in reserved blocks (smaller than that, a reserved block serves as well).
    SHARED_FIFO_BLOCKS = 4


cdef class TagTable:
    """Host mirror of one rank's tag table (module docstring).  Every method
    holds the GIL and the table's lock; the hot path's fast calls take the
    lock alone."""

    def __cinit__(self, uint32_t capacity, staging=None):
        self.t = <tag_core *>calloc(1, sizeof(tag_core))
        if self.t == NULL:
            raise MemoryError
        self.t.refs = 1
        self.t.capacity = capacity
        self.t.lock = PyThread_allocate_lock()
        self.t.owner = <uint64_t *>calloc(max(capacity, 1), sizeof(uint64_t))
        self.t.keyed = <uint8_t *>calloc(max(capacity, 1), 1)
        if self.t.lock == NULL or self.t.owner == NULL or self.t.keyed == NULL:
            raise MemoryError
        self.t.py_table = <PyObject *>self
        self._tags = {}
        self._retired = {}
        self._failed_owners = []
        self._captures = {}
        self._staging = staging

    def __dealloc__(self):
        if self.t != NULL:
            self.t.py_table = NULL
            tag_core_decref(self.t)
            self.t = NULL

    @property
    def capacity(self):
        return self.t.capacity

    @property
    def used(self):
        """Buckets of tags with pending instances (or poisoned)."""
        return self.t.used

    @property
    def bound(self):
        """Buckets bound to a tag, idle ones included."""
        return self.t.used + self.t.nidle

    # -- states ----------------------------------------------------------------
    cdef tag_state *state_of(self, uint64_t key):
        v = self._tags.get(key)
        if v is None:
            return NULL
        return <tag_state *><uintptr_t>v

    cdef tag_state *_new_state(self, uint64_t key, bint transient) except NULL:
        cdef tag_core *t = self.t
        cdef tag_state *st
        cdef tag_state **chunks
        cdef uint32_t i
        if t.free_states == NULL:
            chunks = <tag_state **>realloc(t.chunks, (t.nchunks + 1) * sizeof(tag_state *))
            if chunks == NULL:
                raise MemoryError
            t.chunks = chunks
            st = <tag_state *>calloc(CHUNK, sizeof(tag_state))
            if st == NULL:
                raise MemoryError
            t.chunks[t.nchunks] = st
            t.nchunks += 1
            for i in range(CHUNK):
                st[i].idle_next = t.free_states
                t.free_states = &st[i]
        st = t.free_states
        t.free_states = st.idle_next
        memset(st, 0, sizeof(tag_state))
        st.key = key
        st.bucket = -1
        st.fifo = -1
        st.live = 1
        st.transient = transient
        self._tags[key] = <uintptr_t>st
        return st

    cdef void _forget(self, tag_state *st):
        """The tag's state goes (a transient tag with nothing pending, or a
        first acquire that failed); a descriptor still pointing at it sees
        that it is no longer live, or no longer this key's."""
        del self._tags[st.key]
        st.live = 0
        st.idle_next = self.t.free_states
        self.t.free_states = st

    def close(self):
        """Its communicator rank closed or aborted: the hot path submits
        nothing more for it (a C caller gets DFCCL_API_E_CLOSED)."""
        self.t.closed = 1

    # -- acquire -----------------------------------------------------------------
    def acquire(self, uint64_t key, bint transient):
        """Registers the next instance of ``key``.  Returns (bucket, instance)."""
        bucket, instance, _, _, _ = self.acquirestaged(key, transient, 0)
        return bucket, instance

    def acquirestaged(self, uint64_t key, bint transient, uint64_t staging_bytes, layout=None):
        """Like acquire(), and reserves ``staging_bytes`` of staging for the
        tag, shared with its other instances.  ``layout`` (up to four ints, or
        None) says how the instance's channels use it.  Returns (bucket,
        instance, staging offset or 0, after, keyed): ``after`` names an
        earlier instance (the descriptor's ``after``) that must be over on
        every channel before this one starts; ``keyed``, keyed(bucket)."""
        cdef tag_layout lay
        cdef tag_grant g
        cdef int i
        lay.w[0] = lay.w[1] = lay.w[2] = lay.w[3] = 0
        if layout is not None:
            for i, v in enumerate(layout):
                lay.w[i] = v & _MASK64
        self.acquire_c(key, transient, staging_bytes, &lay, layout is not None, &g)
        return g.bucket, g.instance, g.offset, g.after, bool(g.keyed)

    cdef int acquire_c(self, uint64_t key, bint transient, uint64_t nbytes, const tag_layout *layout,
                       bint has_layout, tag_grant *g) except -1:
        """acquirestaged() for the hot path's fallback."""
        _lock(self.t)
        try:
            self._acquire_locked(key, transient, nbytes, layout, has_layout, g)
        finally:
            PyThread_release_lock(self.t.lock)
        return 0

    cdef int _acquire_locked(self, uint64_t key, bint transient, uint64_t nbytes, const tag_layout *layout,
                             bint has_layout, tag_grant *g) except -1:
        cdef tag_state *st = self.state_of(key)
        cdef bint fresh
        if st == NULL:
            st = self._new_state(key, transient)
        fresh = st.bucket < 0
        try:
            if fresh:
                st.bucket = self._claim(key)
            if nbytes:
                self._reserve(st, nbytes, layout, has_layout)
        except BaseException:
            if fresh:
                if st.bucket >= 0:
                    self.t.owner[st.bucket] = 0
                    st.bucket = -1
                if st.submitted == 0:
                    self._forget(st)
            raise
        take_instance(self.t, st, nbytes, layout, has_layout, g)
        return 0

    cdef int64_t _claim(self, uint64_t key) except -1:
        cdef uint32_t cap = self.t.capacity
        cdef uint32_t b = dfccl_home_bucket(key, cap)
        cdef uint64_t owner
        cdef tag_state *other
        for _ in range(cap):
            owner = self.t.owner[b]
            other = self.state_of(owner) if owner != 0 else NULL
            if owner == 0 or other.idle:
                if other != NULL:
                    self._evict(other)
                self.t.owner[b] = key
                return b
            b = b + 1 if b + 1 < cap else 0
        raise ResourceError(f"all {cap} tag records of this rank are in use (tags pending at once); "
                            "raise CommOptions.max_tags")

    cdef int _reserve(self, tag_state *st, uint64_t nbytes, const tag_layout *layout, bint has_layout) except -1:
        """Makes the tag's staging at least ``nbytes`` (a new region: nothing
        pending uses it, so its layout is the new one's) if the shared
        staging has it; a ring collective otherwise keeps a FIFO it can loop
        through (the tag's own, else a reserved block)."""
        if st.fifo >= 0 and st.fifo_bytes >= nbytes:
            return 0
        off = self._staging.alloc(nbytes)
        while off is None and self.t.idle_head != NULL and self.t.idle_head != st:
            # Give back the staging of idle tags, oldest first.
            self._evict(self.t.idle_head)
            off = self._staging.alloc(nbytes)
        if off is None and loops(layout, has_layout):
            if st.fifo >= 0 and fifo_shape(st.fifo_bytes, layout) != NO_FIT:
                return 0
            # A smaller shared FIFO first (halving down to a few reserved
            # blocks' worth): a deep queue of large messages then loops
            # through FIFOs of tens or hundreds of KiB rather than all but
            # the first few through a minimum one (thousands of slices each).
            smaller = nbytes // 2
            while off is None and smaller >= SHARED_FIFO_BLOCKS * self._staging.block_bytes:
                if fifo_shape(smaller, layout) == NO_FIT:
                    break
                off = self._staging.alloc(smaller)
                if off is not None:
                    nbytes = smaller
                smaller //= 2
            if off is None:
                off = self._staging.alloc_block()
                nbytes = self._staging.block_bytes
                if off is not None and fifo_shape(nbytes, layout) == NO_FIT:
                    self._staging.free(off, nbytes)
                    off = None
        if off is None:
            raise ResourceError(f"staging memory exhausted ({self._staging.in_use} of {self._staging.size} bytes "
                                f"held by tags with pending collectives, {nbytes} more needed, "
                                f"{self._staging.free_blocks} of {self._staging.blocks} reserved FIFOs free); raise "
                                "CommOptions.staging_bytes or synchronize earlier collectives")
        if st.fifo >= 0:
            if st.pending:
                self._retired.setdefault(st.key, []).append((st.fifo, st.fifo_bytes))
                st.retired_fifos += 1
            else:
                self._staging.free(st.fifo, st.fifo_bytes)
        st.fifo = off
        st.fifo_bytes = nbytes
        set_layout(st, layout, has_layout)
        return 0

    cdef void _evict(self, tag_state *st):
        idle_remove(self.t, st)
        self._unbind(st)

    cdef void _unbind(self, tag_state *st):
        self.t.owner[st.bucket] = 0
        st.bucket = -1
        if st.fifo >= 0:
            self._staging.free(st.fifo, st.fifo_bytes)
            st.fifo = -1
            st.fifo_bytes = 0

    def note_slot(self, uint64_t key, uint64_t slot_gen):
        """The completion slot and generation of the instance just acquired
        with staging: ((slot + 1) << 32) | gen, for later instances' ``after``."""
        cdef tag_state *st = self.state_of(key)
        if st == NULL:
            raise KeyError(key)
        tag_note_slot(self.t, st, slot_gen)

    # -- release -----------------------------------------------------------------
    cpdef uint64_t graph_key(self, uint64_t key):
        """The tag the next capture of ``key`` in a CUDA graph runs on
        (hash.h, dfccl_graph_key): the n-th capture of a tag is the same
        tag on every rank whatever else each captured, and none is ever
        the tag's own or another capture's."""
        n = self._captures.get(key, 0)
        self._captures[key] = n + 1
        return dfccl_graph_key(key, n)

    def cancel(self, uint64_t key):
        """Undoes the last acquire() of ``key`` (its submission failed before
        reaching the daemon): the instance number is given back."""
        cdef tag_state *st
        _lock(self.t)
        try:
            st = self.state_of(key)
            st.submitted -= 1
            self._release_locked(st, False, False)
        finally:
            PyThread_release_lock(self.t.lock)

    def release(self, uint64_t key, bint failed, instance_staging=None, bint ran=True, owners=None):
        """One instance of ``key`` completed (or failed; ``ran``: it reached
        the daemon).  ``instance_staging`` (offset, bytes): staging that
        instance had alone (alloc_instance_staging), given back unless it
        failed (a peer that has not seen the failure may still read or mark
        it).  ``owners``: what the instance kept alive (its buffers), kept
        until drop_failed() if it failed, for the same reason."""
        _lock(self.t)
        try:
            if instance_staging is not None and not failed:
                self._staging.free(*instance_staging)
            if failed and owners is not None:
                self._failed_owners.append(owners)
            self._release_locked(self.state_of(key), failed, ran)
        finally:
            PyThread_release_lock(self.t.lock)

    cdef int _release_locked(self, tag_state *st, bint failed, bint ran) except -1:
        if ran:
            self.t.keyed[st.bucket] = 1
        st.pending -= 1
        if failed:
            # Its bucket and staging stay bound for good: a peer that has not
            # seen the failure may still read the abort marker or write there.
            st.poisoned = 1
        if st.pending or st.poisoned:
            return 0
        self.t.used -= 1
        for off, n in self._retired.pop(st.key, ()):
            self._staging.free(off, n)
        st.retired_fifos = 0
        if st.transient:
            self._unbind(st)
            self._forget(st)
        else:
            idle_append(self.t, st)
        return 0

    def drop_failed(self):
        """Lets failed instances' buffers go: no peer can reach them any more."""
        self._failed_owners = []

    # -- inspection ----------------------------------------------------------------
    def keyed(self, uint32_t bucket):
        """Whether the daemon has surely written a key into ``bucket``: an
        instance placed there has retired (the daemon pulled it).  Until then
        a submission asks the daemon to key it (DFCCL_TASK_KEY_BUCKET), so
        that peers probing past it do not stop there (design decision 31)."""
        return bool(self.t.keyed[bucket])

    def instances(self, uint64_t key):
        cdef tag_state *st = self.state_of(key)
        return 0 if st == NULL else st.submitted

    def bucket_of(self, uint64_t key):
        """The bucket bound to ``key`` (-1: none)."""
        cdef tag_state *st = self.state_of(key)
        return -1 if st == NULL else st.bucket

    def staging_of(self, uint64_t key):
        """(offset, bytes) of the staging bound to ``key`` (-1, 0: none)."""
        cdef tag_state *st = self.state_of(key)
        if st == NULL:
            return (-1, 0)
        return (st.fifo, st.fifo_bytes)

    # -- staging of one instance ---------------------------------------------------
    def alloc_instance_staging(self, uint64_t nbytes):
        """Staging for one instance alone (an all-to-all's split table and
        send copy), given back with free_instance_staging().  Idle tags'
        staging is given back first when the pool runs short."""
        _lock(self.t)
        try:
            off = self._staging.alloc(nbytes)
            while off is None and self.t.idle_head != NULL:
                self._evict(self.t.idle_head)
                off = self._staging.alloc(nbytes)
        finally:
            PyThread_release_lock(self.t.lock)
        if off is None:
            raise ResourceError(f"staging memory exhausted ({self._staging.in_use} of {self._staging.size} bytes "
                                f"held by pending collectives, {nbytes} more needed); raise "
                                "CommOptions.staging_bytes or synchronize earlier collectives")
        return off

    def free_instance_staging(self, uint64_t offset, uint64_t nbytes):
        _lock(self.t)
        try:
            self._staging.free(offset, nbytes)
        finally:
            PyThread_release_lock(self.t.lock)
