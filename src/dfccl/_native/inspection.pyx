# cython: language_level=3
"""Inspection and diagnostics of a daemon: DaemonBase, the base of
Daemon (daemon.pyx), holds its C state (core.pxd, daemon_core) and shows it
and the daemon's: what is pending and for whom, what the daemon has taken,
its state, its time profile.  Reading these never changes what runs."""

from cpython.pythread cimport PyThread_release_lock
from libc.stdint cimport uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport calloc, free

from dfccl._native.abi cimport *
from dfccl._native.core cimport slot_rec
from dfccl._native.completion cimport completed
from dfccl._native.retire cimport lock_gil
from dfccl._native.work cimport Work

from dfccl.errors import BackendError

_DAEMON_STATES = {0: "idle", 1: "running", 2: "quitting", 3: "exited", 4: "leaving"}


cdef class DaemonBase:
    """What a Daemon shows of its host state and of its kernel's (Daemon builds it)."""

    @property
    def nblocks(self):
        return self.c.nblocks

    @property
    def nslots(self):
        return self.c.nslots

    @property
    def closed(self):
        return bool(self.c.closed)

    @property
    def forked_from(self):
        """In a forked child: the parent's pid (0: this process's own)."""
        return self.c.forked_from

    @property
    def device_fault(self):
        """The device's error code once it failed under the daemon (0: none)."""
        return self.c.device_fault

    @property
    def epoch(self):
        return self.c.epoch

    @property
    def launches(self):
        return self.c.launches

    @property
    def relaunch_backoff_ns(self):
        return self.c.relaunch_backoff_ns

    @property
    def done_dev(self):
        return self.c.done_dev

    @property
    def outstanding_count(self):
        return self.c.n_outstanding

    @property
    def free_slots(self):
        """Completion slots free for new collectives (captured collectives
        hold theirs while their graphs live)."""
        return self.c.n_free

    @property
    def stream_waits(self):
        """Incomplete collectives some stream waits for (the daemon stays
        while there are any)."""
        return dfccl_load_acquire_u64(&self.c.ctrl.stream_waits)

    @property
    def submissions(self):
        """(published, taken): submission-queue entries the host has published
        and those the daemon's host link has copied to the device.  Taken
        lagging published while the daemon runs means it has not looked at
        the host since."""
        return (dfccl_load_acquire_u64(&self.c.ctrl.sq_tail), dfccl_load_acquire_u64(&self.c.ctrl.sq_copied))

    @property
    def daemon_state(self):
        """(epoch, state) as the daemon last published it; state is one of
        'running', 'quitting' (deciding whether to leave), 'leaving',
        'exited' ('idle' before the first launch)."""
        cdef uint64_t v = dfccl_load_acquire_u64(&self.c.ctrl.daemon_state)
        return (v >> DFCCL_DAEMON_EPOCH_SHIFT, _DAEMON_STATES.get(v & DFCCL_DAEMON_STATE_MASK, "?"))

    # -- pending collectives -----------------------------------------------------
    def pending_works(self, uint32_t endpoint):
        """The Works of ``endpoint`` that have not been retired yet."""
        cdef uint32_t i
        cdef slot_rec *r
        out = []
        lock_gil(self.c)
        try:
            for i in range(self.c.n_outstanding):
                r = &self.c.slots[self.c.outstanding[i]]
                if r.work != NULL and r.endpoint == endpoint:
                    out.append(<Work>r.work)
        finally:
            PyThread_release_lock(self.c.lock)
        return out

    def pending_handles(self, uint32_t endpoint):
        """How many collectives of ``endpoint`` submitted through the C API
        the daemon has not completed and nothing has failed yet."""
        cdef uint32_t i, s, n = 0
        cdef slot_rec *r
        lock_gil(self.c)
        for i in range(self.c.n_outstanding):
            s = self.c.outstanding[i]
            r = &self.c.slots[s]
            if not r.by_work and r.endpoint == endpoint and not r.abandoned and not completed(self.c, s):
                n += 1
        PyThread_release_lock(self.c.lock)
        return n

    def held_by_daemon(self, uint32_t endpoint):
        """How many collectives of ``endpoint`` the daemon may still be running:
        in their slots, completion word not written, abandoned ones included
        (Daemon.abandon fails them on the host at once; the daemon lets go
        of them only when it writes their completion word).  Until this is
        zero the endpoint's memory must stay."""
        cdef uint32_t i, s, n = 0
        lock_gil(self.c)
        for i in range(self.c.n_outstanding):
            s = self.c.outstanding[i]
            if self.c.slots[s].endpoint == endpoint and not completed(self.c, s):
                n += 1
        PyThread_release_lock(self.c.lock)
        return n

    def stream_reached(self, Work work, double timeout=0.5):
        """For a stream-ordered collective (``work.stream_ordered``) still in
        its slot: whether its stream has reached it, that is written its armed
        word (for a collective the daemon has taken up, ``submissions``, but
        not started: is it held up by its stream?).  None when it is not
        stream-ordered or no longer in its slot, or when the word could not
        be read within ``timeout`` seconds (the read can be held up behind a
        waiting stream, as every device read of an explanation)."""
        cdef uint32_t value = 0
        cdef uint32_t slot = work._slot
        if work._daemon is not self or work._retired or not work.stream_ordered or slot >= self.c.nslots \
                or self.c.slots[slot].gen != work._gen:
            return None
        try:
            self.device.read_device(<uint64_t><uintptr_t>&value, self.c.armed_dev + 4 * <uint64_t>slot, 4, timeout)
        except BackendError:
            return None
        return value == work._gen

    # -- the daemon ----------------------------------------------------------------
    cdef dfccl_daemon_state *_copy_daemon_state(self) except NULL:
        """A host copy of the daemon's state in device memory; the caller frees it."""
        cdef dfccl_daemon_state *st = <dfccl_daemon_state *>calloc(1, sizeof(dfccl_daemon_state))
        if st == NULL:
            raise MemoryError
        try:
            self.device.copy_from_device(<uint64_t><uintptr_t>st, <uint64_t><uintptr_t>self.c.args.state,
                                         sizeof(dfccl_daemon_state))
        except BaseException:
            free(st)
            raise
        return st

    @property
    def bad_tasks(self):
        """How many descriptors the daemon rejected (DFCCL_STATUS_BAD_TASK)."""
        cdef dfccl_daemon_state *st = self._copy_daemon_state()
        try:
            return st.bad_tasks
        finally:
            free(st)

    def daemon_profile(self):
        """Where each daemon block's time went since the daemon was created
        (cuda/include/dfccl/abi.h, dfccl_block_profile): one dict per block
        with passes, runs and the nanoseconds spent pulling, picking,
        restoring, inside runs, saving and idle; and, from a daemon built with
        DFCCL_STEP_PROFILE=1 (zero otherwise), the step profile
        (dfccl_step_profile: LL runs and the time in each of their steps,
        completing).  Read from device memory while the daemon runs, so the
        figures of a busy block may be a pass apart from one another."""
        cdef dfccl_daemon_state *st = self._copy_daemon_state()
        cdef dfccl_block_profile *p
        cdef dfccl_step_profile *q
        try:
            out = []
            for b in range(self.c.nblocks):
                p = &st.profile[b]
                q = &st.steps[b]
                out.append({"passes": p.passes, "runs": p.runs, "pull_ns": p.pull_ns, "pick_ns": p.pick_ns,
                            "restore_ns": p.restore_ns, "run_ns": p.run_ns, "save_ns": p.save_ns,
                            "idle_ns": p.idle_ns, "ll_runs": q.ll_runs, "ll_credit_ns": q.ll_credit_ns,
                            "ll_push_ns": q.ll_push_ns, "ll_recv_ns": q.ll_recv_ns,
                            "ll_finish_ns": q.ll_finish_ns, "complete_ns": q.complete_ns,
                            "ll_publish_ns": q.ll_publish_ns, "ll_move_ns": q.ll_move_ns})
            return out
        finally:
            free(st)

    def daemon_sms(self):
        """The SM each daemon block ran on at its last launch (``%smid``), one
        entry per block; None for a block not launched yet, and on the
        simulator.  Blocks that talk through memory on nearby SMs see shorter
        round trips, so this is where to look when timings differ between
        runs."""
        cdef dfccl_daemon_state *st = self._copy_daemon_state()
        try:
            return [st.block_sm[b] - 1 if st.block_sm[b] != 0 else None for b in range(self.c.nblocks)]
        finally:
            free(st)
