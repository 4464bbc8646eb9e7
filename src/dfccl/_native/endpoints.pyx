# cython: language_level=3
"""The communicator ranks a daemon serves (endpoints): their entries in
the daemon's device memory, their abort words, and their release once the
daemon has let go of every collective of theirs.  DaemonEndpoints is a
base of Daemon (daemon.pyx)."""

from cpython.pythread cimport PyThread_release_lock
from libc.stdint cimport uint32_t, uint64_t, uintptr_t
from libc.string cimport memset

from dfccl._native.abi cimport *
from dfccl._native.launch cimport ensure_running, take_error
from dfccl._native.retire cimport lock_gil

from dfccl.errors import ClosedError, InvalidArgumentError, ResourceError


cdef class DaemonEndpoints(DaemonBase):
    """A daemon's endpoints (Daemon builds it)."""

    cdef void _abort_flags_changed(self) noexcept:
        """Tells the host link to copy the endpoints' abort flags again."""
        dfccl_fence_seq_cst()
        dfccl_store_release_u64(&self.c.ctrl.abort_epoch, self.c.ctrl.abort_epoch + 1)

    cdef int _ensure_running(self) except -1:
        cdef int rc
        with nogil:
            rc = ensure_running(self.c)
        if rc < 0:
            raise take_error()
        return 0

    # -- endpoints -----------------------------------------------------------
    def add_endpoint(self, int rank, int nranks, int table_capacity, uint64_t comm_key,
                     peer_tables, peer_arenas, uint64_t owner_words, uint64_t reg_table=0, uint64_t ll_offset=0,
                     uint32_t ll_max_bytes=0, uint64_t net_remote=0, uint64_t net_queues=0):
        """Registers one rank of a communicator with the daemon; returns its id.
        ``owner_words``: zeroed device memory for ``table_capacity``
        dfccl_owner_bucket (what only this daemon touches of the rank's
        records); ``reg_table``: the peers' registered allocations as mapped
        here (registration.py); ``ll_offset`` / ``ll_max_bytes``: the LL
        region of every rank's arena (endpoint.py, ll_region_bytes);
        ``net_remote`` / ``net_queues``: the ranks on other hosts (a bit each)
        and this rank's net queues (dfccl.net)."""
        cdef dfccl_endpoint ep
        if not self.free_endpoints:
            self.reclaim_endpoints()
        if not self.free_endpoints:
            where = self.device.where
            if self.draining_endpoints:
                raise ResourceError(f"too many communicators on {where} (max_endpoints={self.max_endpoints}; "
                                    f"{len(self.draining_endpoints)} of them closed, but the daemon still runs "
                                    "collectives they abandoned)")
            raise ResourceError(f"too many communicators on {where} (max_endpoints={self.max_endpoints})")
        if nranks > DFCCL_MAX_RANKS:
            raise ResourceError(f"communicators are limited to {DFCCL_MAX_RANKS} ranks")
        if owner_words == 0:
            raise InvalidArgumentError("an endpoint needs its owner words (device memory)")
        idx = self.free_endpoints.pop()
        memset(&ep, 0, sizeof(dfccl_endpoint))
        ep.rank = rank
        ep.nranks = nranks
        ep.table_capacity = table_capacity
        ep.record_stride = DFCCL_RECORD_BYTES
        ep.comm_key = comm_key
        ep.reg_table = reg_table
        ep.ll_offset = ll_offset
        ep.ll_max_bytes = ll_max_bytes
        ep.net_remote = net_remote
        ep.net_queues = net_queues
        ep.owner_words = owner_words
        for i in range(nranks):
            ep.peer_table[i] = peer_tables[i]
            ep.peer_arena[i] = peer_arenas[i]
        self.device.copy_to_device(self.endpoints_dev + <uint64_t>idx * sizeof(dfccl_endpoint),
                                   <uint64_t><uintptr_t>&ep, sizeof(dfccl_endpoint))
        self.c.ep_abort[idx] = 0
        self._abort_flags_changed()
        return idx

    def remove_endpoint(self, int idx, on_released=None):
        """Unregisters endpoint ``idx``.  While the daemon still holds
        collectives of it (held_by_daemon: ones an abort abandoned on the
        host), its id stays taken, its device entry stays as it is and
        ``on_released`` (what frees the memory those collectives touch) waits:
        reused at once, the id would run them against another communicator's
        peers.  The endpoint drains; reclaim_endpoints() and close() finish
        it.  Once released, the entry is zeroed, so that a descriptor naming
        it is rejected (DFCCL_STATUS_BAD_TASK), and ``on_released()`` is
        called.  Returns whether it was released now."""
        if idx < 0 or idx >= <int>self.max_endpoints or idx in self.free_endpoints or idx in self.draining_endpoints:
            raise InvalidArgumentError(f"endpoint {idx} is not registered with this daemon")
        self.diagnostics.pop(idx, None)
        if not self.c.closed and self.held_by_daemon(idx) > 0:
            self.draining_endpoints[idx] = on_released
            return False
        self._release_endpoint(idx, on_released)
        return True

    def reclaim_endpoints(self):
        """Releases the removed endpoints the daemon has let go of
        (remove_endpoint); returns how many still drain."""
        for idx in list(self.draining_endpoints):
            if self.c.closed or self.held_by_daemon(idx) == 0:
                entry = self.draining_endpoints.pop(idx, self)   # another thread may be here too
                if entry is not self:
                    self._release_endpoint(idx, entry)
        return len(self.draining_endpoints)

    @property
    def draining(self):
        """The ids of removed endpoints whose collectives the daemon still
        holds (remove_endpoint)."""
        return sorted(self.draining_endpoints)

    def endpoint_entry(self, int idx):
        """(rank, nranks) of endpoint ``idx`` as the daemon reads them from
        device memory; (0, 0) for a released one."""
        cdef dfccl_endpoint ep
        if idx < 0 or idx >= <int>self.max_endpoints:
            raise InvalidArgumentError(f"endpoint {idx} is outside 0..{self.max_endpoints - 1}")
        if self.c.closed:
            raise ClosedError(f"daemon {self.device.where} is closed")
        self.device.copy_from_device(<uint64_t><uintptr_t>&ep, self.endpoints_dev + <uint64_t>idx * sizeof(dfccl_endpoint),
                                     sizeof(dfccl_endpoint))
        return (ep.rank, ep.nranks)

    def _release_endpoint(self, int idx, on_released):
        cdef dfccl_endpoint ep
        if not self.c.closed and not self.c.device_fault:
            memset(&ep, 0, sizeof(dfccl_endpoint))
            self.device.copy_to_device(self.endpoints_dev + <uint64_t>idx * sizeof(dfccl_endpoint),
                                       <uint64_t><uintptr_t>&ep, sizeof(dfccl_endpoint))

        self.free_endpoints.append(idx)
        if on_released is not None:
            on_released()

    def abort_endpoint(self, int idx, int lost_rank=-1):
        """Every pending and future collective of this endpoint fails with
        AbortedError (peers see PeerAbortedError), or, with ``lost_rank``,
        with PeerLostError naming that rank (whose process died)."""
        cdef uint32_t gen, i, s
        if lost_rank >= 0:
            dfccl_store_release_u32(&self.c.ep_abort[idx], DFCCL_EP_PEER_LOST + <uint32_t>lost_rank)
        else:
            dfccl_store_release_u32(&self.c.ep_abort[idx], DFCCL_EP_ABORTED)
        self._abort_flags_changed()
        if self.c.device_fault:
            return   # nothing runs on a failed device: fail_on_fault failed what was pending
        # Unarmed stream-ordered tasks would never run: arm them so they fail.
        lock_gil(self.c)
        pending = [(self.c.outstanding[i], self.c.slots[self.c.outstanding[i]].gen)
                   for i in range(self.c.n_outstanding)]
        PyThread_release_lock(self.c.lock)
        for s, gen in pending:
            self.device.copy_to_device(self.c.armed_dev + 4 * <uint64_t>s, <uint64_t><uintptr_t>&gen, 4)
        self._ensure_running()
