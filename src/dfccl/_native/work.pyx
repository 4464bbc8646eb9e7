# cython: language_level=3
"""The Work a collective returns: the Python side of a completion handle
(slot and generation, as the C API's dfccl_handle), waiting for it on the
host (``synchronize``, without the GIL) or on a stream (``wait``),
callbacks, its counters, and the typed error it failed with.  The daemon
(daemon.pyx) attaches it to the slot the C hot path submitted and
retirement (retire.pyx) fills it; the daemon's completion word is what
both watch."""

from libc.stdint cimport int32_t, uint32_t, uint64_t, uintptr_t
from libc.string cimport memset
from cpython.exc cimport PyErr_CheckSignals

from dfccl._native.abi cimport *

from dfccl.errors import (AbortedError, BackendError, CollectiveTimeoutError, DfcclError, InvalidArgumentError,
                          MismatchError, NotSupportedError, PeerAbortedError, PeerLostError, collective_name)

cdef dict _STATS_ZERO = {"preemptions": 0, "resumes": 0, "queued_ns": 0, "running_ns": 0, "wall_ns": 0,
                         "max_wait_ns": 0, "host_ns": 0, "channels": 0}

# Work.synchronize pauses between polls of the completion word as every host
# wait does (dfccl_wait_pause, host_atomics.h: spin, yield, then short sleeps).
# SIGNAL_CHECK_NS: how often a long synchronize() takes the GIL to run signal
# handlers, so that Ctrl-C (KeyboardInterrupt) stops a wait for a collective
# that never completes.  Only the main thread runs them; elsewhere the check
# is a no-op.
cdef enum:
    SIGNAL_CHECK_NS = 20000000


cdef inline bint _reached(uint32_t *word, uint32_t gen) noexcept nogil:
    """Whether a slot's completion word shows ``gen`` or a later generation.
    A slot is reused only after its Work retired, so a later one means this
    one completed and another thread retired it (and the slot then went to
    a newer collective, which may have completed too): a wait that looked
    for ``gen`` alone would miss it for ever."""
    return <int32_t>(dfccl_load_acquire_u32(word) - gen) >= 0


cdef class Work:
    """A submitted collective.  ``synchronize()`` waits on the host,
    ``wait(stream)`` makes a stream wait, ``add_done_callback()`` runs a
    function on completion (on the progress thread).  Works are created by
    collectives; one constructed directly refers to nothing and says so.

    ``tag`` is the tag the collective was given (None: untagged),
    ``instance`` which use of it this is (the k-th untagged collective of a
    communicator is instance k of its untagged sequence) and ``name`` how
    messages name it: ``tag 'grad' (instance 3)`` or ``untagged #3``."""

    def __cinit__(self):
        self._slot = NO_SLOT
        self._status = DFCCL_STATUS_OK
        self._detail = -1
        self.rank = -1

    @staticmethod
    def completed(str kind, object tag, int rank):
        """A collective that had nothing to move (zero elements)."""
        cdef Work w = Work()
        w.kind = kind
        w.tag = tag
        w.rank = rank
        w._retired = True
        return w

    cdef int _check_submitted(self) except -1:
        if self._daemon is None and not self._retired:
            raise InvalidArgumentError("this Work was not returned by a collective: it refers to nothing "
                                       "(Works are created by Communicator collectives and plans)")
        return 0

    cdef bint _device_done(self):
        return _reached(self._done, self._gen)

    def _peek_done(self):
        """Whether the daemon has written the completion word, without
        retiring (for probes that time retirement apart)."""
        return self._retired or (self._daemon is not None and self._device_done())

    cdef int _refuse_captured(self, str what) except -1:
        if self.captured:
            raise NotSupportedError(
                f"{what}: rank {self.rank}'s {self.kind} {self.name} was captured in a CUDA graph: it has no "
                "completion on the host, it runs at each replay.  Wait on a stream instead: work.wait(stream) "
                "under the same capture orders what follows in the graph after it, and synchronizing the graph's "
                "stream after a replay (torch.cuda.synchronize()) waits for it; a failed replay is raised by the "
                "next dfccl call", rank=self.rank, tag=self.tag)
        return 0

    def done(self):
        """True once the collective has completed (successfully or not)."""
        self._refuse_captured("done")
        if self._retired:
            return True
        self._check_submitted()
        if self._device_done():
            self._daemon._retire(self._slot, self._gen)
            return True
        if self._fault != NULL and dfccl_load_acquire_u32(self._fault) != 0:
            self._daemon.fail_on_fault()   # the device failed: it never completes
            return self._retired
        return False

    def synchronize(self, timeout=None):
        """Blocks (without the GIL) until the collective completes.  Raises its
        error, or CollectiveTimeoutError after ``timeout`` seconds, or what a
        signal handler raises (Ctrl-C: KeyboardInterrupt, within 20 ms); the
        collective then stays pending."""
        cdef uint64_t deadline = 0
        cdef uint64_t start, now, signals_at
        cdef uint32_t *word
        cdef uint32_t *fault
        cdef uint32_t gen
        cdef bint ok = True
        cdef bint faulted = False
        cdef uint32_t spins = 0
        cdef double seconds
        self._refuse_captured("synchronize")
        if not self._retired:
            self._check_submitted()
            if timeout is not None:
                if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
                    raise InvalidArgumentError(f"synchronize: timeout must be a number of seconds or None, "
                                               f"not {timeout!r}", rank=self.rank, tag=self.tag)
                seconds = float(timeout)
                if seconds != seconds or seconds < 0:
                    raise InvalidArgumentError(f"synchronize: timeout must be >= 0, not {timeout!r}",
                                               rank=self.rank, tag=self.tag)
            word = self._done
            fault = self._fault
            gen = self._gen
            start = dfccl_now_ns()
            signals_at = start + SIGNAL_CHECK_NS
            if timeout is not None:
                deadline = start + <uint64_t>(min(seconds, 1e9) * 1e9)
            # Already complete: retire without letting other threads in.
            if not _reached(word, gen):
                with nogil:
                    while not _reached(word, gen):
                        spins += 1
                        if (spins & 15) != 0:
                            dfccl_cpu_relax()
                            continue
                        now = dfccl_now_ns()
                        dfccl_wait_pause(now - start)
                        if deadline != 0 and now >= deadline:
                            ok = _reached(word, gen)
                            break
                        if fault != NULL and dfccl_load_acquire_u32(fault) != 0:
                            # The device failed: this never completes.
                            faulted = not _reached(word, gen)
                            break
                        if now >= signals_at:
                            signals_at = now + SIGNAL_CHECK_NS
                            with gil:
                                # KeyboardInterrupt (or what a handler raises)
                                # ends the wait; the collective stays pending.
                                PyErr_CheckSignals()
            if faulted:
                self._daemon.fail_on_fault()
            elif not ok:
                raise self._timeout_error(timeout)
            if not self._retired:
                self._daemon._retire(self._slot, self._gen)
        if self._get_error() is not None:
            raise self._error

    def wait(self, stream):
        """Makes ``stream`` wait for this collective (cuStreamWaitValue32 on its
        completion word); the host does not block.  CUDA backend only."""
        from dfccl.streams import stream_handle
        if self.captured:
            # Under the same capture: the graph's stream `stream` waits for each replay too.
            self._daemon._graph_stream_wait(stream_handle(stream), self._slot)
            return
        if self._retired:
            if self._get_error() is not None:
                raise self._error
            return
        self._check_submitted()
        self._daemon._stream_wait(stream_handle(stream), self._slot, self._gen)

    def add_done_callback(self, fn):
        """Calls ``fn(work)`` once the collective is complete: at once if it
        already is, else on the progress thread."""
        if not callable(fn):
            raise InvalidArgumentError(f"add_done_callback: {fn!r} is not callable", rank=self.rank, tag=self.tag)
        self._refuse_captured("add_done_callback")
        if self._retired:
            fn(self)
            return
        self._check_submitted()
        if self._callbacks is None:
            self._callbacks = []
        self._callbacks.append(fn)
        # Retired (and the callback run) on the progress thread once the
        # daemon's watcher sees it complete, even if nobody synchronizes it.
        self._daemon._retire_soon(self._slot, self._gen)

    def exception(self):
        """The error of a completed collective, or None."""
        return self._get_error() if self._retired else None

    @property
    def stats(self):
        """Per-collective counters once complete: preemptions, resumes,
        queued_ns (pulled -> first run), running_ns (inside runs), wall_ns
        (first run -> done), max_wait_ns (longest wait that ended with the
        peer arriving), host_ns (submit -> retired), channels; for a
        hierarchical collective, the last part's, and ``parts``: each
        part's, with its ``phase``, in the order they ran (a part's
        queued_ns includes its wait for the part before)."""
        if not self._retired:
            return None
        if not self._has_result:
            return dict(_STATS_ZERO)
        r = &self._result
        out = {"preemptions": r.preemptions, "resumes": r.resumes, "queued_ns": r.queued_ns,
               "running_ns": r.running_ns, "wall_ns": r.wall_ns, "max_wait_ns": r.max_wait_ns,
               "host_ns": self._retired_ns - self._submitted_ns, "channels": r.nchannels}
        if self._chain is not None:
            out["parts"] = self._chain.part_stats(dict(out))
        return out

    @property
    def status(self):
        return self._status

    @property
    def name(self):
        """``tag 'grad' (instance 3)``, or ``untagged #3`` (errors.collective_name)."""
        return collective_name(self.tag, self.instance)

    @property
    def key(self):
        """The 64-bit key of the tag this collective is an instance of."""
        return self._key

    @property
    def submitted_ns(self):
        """Host monotonic clock (ns) at submission; 0 for a collective that had nothing to move."""
        return self._submitted_ns

    @property
    def retired_ns(self):
        """Host monotonic clock (ns) when the host saw it complete; 0 while pending."""
        return self._retired_ns

    @property
    def detail(self):
        """The rank the daemon's status names (-1: none)."""
        return self._detail

    def waiting_for(self):
        """The rank the daemon last reported this pending collective waiting
        for, or None.  A host-memory word the daemon stores while it waits:
        reading it never waits for the device."""
        cdef uint32_t word = 0
        if self._retired or self._daemon is None or self._daemon.closed or self._waiting == NULL:
            return None
        word = dfccl_load_acquire_u32(self._waiting)
        waiting = <int>word - 1
        return waiting if 0 <= waiting < 0xfff0 else None

    @property
    def submitted_as(self):
        """(kind, tag, rank) as submitted: for the last part of a
        hierarchical collective, whose kind, tag and rank name the whole,
        the part's own."""
        return self._own_names()

    def _as_whole(self, chain, str kind, object tag, int rank):
        """Makes this Work, the last part of a hierarchical collective,
        stand for the whole (hierarchy.py): named as ``kind`` of ``tag`` on
        ``rank`` of the communicator it was called on, and failed with the
        first error of any part (``chain.error``)."""
        self._chain = chain
        self._part_names = (self.kind, self.tag, self.rank)
        self.kind = kind
        self.tag = tag
        self.rank = rank

    def _describe_timeout(self, timeout):
        """What this pending collective waits for, as a CollectiveTimeoutError
        named as itself (for the last part of a hierarchical collective: as
        the part; the Chain of the whole words its own from the first
        pending part's)."""
        return self._own_timeout_error(timeout)

    cdef tuple _own_names(self):
        """(kind, tag, rank) its own errors name: a part's as submitted,
        also where it stands for a hierarchical whole (the Chain rewords
        them for the whole)."""
        return (self.kind, self.tag, self.rank) if self._part_names is None else self._part_names

    cdef object _timeout_error(self, timeout):
        if self._chain is not None:
            return self._chain.timeout_error(timeout)
        return self._own_timeout_error(timeout)

    cdef object _own_timeout_error(self, timeout):
        # Written live by the daemon into host memory (wait.cuh).
        kind, tag, rank = self._own_names()
        waiting = self.waiting_for()
        what = f"rank {rank}: {kind} {collective_name(tag, self.instance)} did not complete within {timeout} s"
        diag = self._daemon.diagnostics.get(self.endpoint) if not self._daemon.closed else None
        joined = missing = None
        if diag is not None:
            # Who has published this instance, read from the peers' records.
            try:
                joined, missing = diag.joined_ranks(self._key, self.instance)
            except Exception:
                joined = missing = None
        if missing:
            what += (f"; it is waiting for rank {missing[0]} to join: ranks {missing} have not joined this instance "
                     f"(ranks {joined} have)")
            if waiting is not None and waiting not in missing:
                what += f"; the transfer waits for data from rank {waiting}, which waits for them"
            waiting = missing[0]
        elif missing is not None:
            what += f"; every rank has joined it (ranks {joined})"
            if waiting is not None:
                what += f", the transfer waits for data from rank {waiting}"
        elif waiting is not None:
            what += f"; it is waiting for rank {waiting}, which has not joined this instance or has not sent its data"
        else:
            what += "; every peer has joined, the transfer is still in progress"
        return CollectiveTimeoutError(what, rank=rank, tag=tag, waiting_on=waiting,
                                      missing_ranks=missing, joined_ranks=joined)

    cdef void _finish(self, const dfccl_result *res, uint64_t now):
        """The leader of retirement (retire.pyx, under the daemon lock):
        copies the result; the error object is built only on failure."""
        self._result = res[0]
        self._has_result = True
        self._status = res.status
        self._detail = res.detail
        self._retired_ns = now
        self._retired = True
        if res.status == DFCCL_STATUS_OK:
            # Every peer finished with its buffers before it completed.  A
            # failed one's go to its tag table (retire.pyx, after_retire).
            self._keepalive = None

    cdef void _fail_on_host(self, uint64_t now):
        """Fails it as aborted on the host, without the daemon (abandoned, a
        failed device, a forked child's); what it keeps alive stays."""
        memset(&self._result, 0, sizeof(dfccl_result))
        self._result.status = DFCCL_STATUS_ABORTED
        self._result.detail = -1
        self._has_result = True
        self._status = DFCCL_STATUS_ABORTED
        self._detail = -1
        self._retired_ns = now
        self._retired = True

    cdef void _fail_closed(self, uint64_t now):
        """The daemon closed under this pending collective, its daemon gone
        (Daemon.close keeps the buffers of one it could not stop)."""
        self._fail_on_host(now)
        self._keepalive = None

    cdef object _get_error(self):
        if self._error is None and self._retired:
            self._error = self._final_error()
        return self._error

    cdef object _final_error(self):
        """The error of this retired Work (None: it succeeded).  The last part
        of a hierarchical collective fails if any part did, with the
        earliest's error, worded for the whole (hierarchy.Chain)."""
        err = self._make_error()   # None where it succeeded
        return err if self._chain is None else self._chain.error(err)

    cdef object _make_error(self):
        cdef uint32_t status = self._status
        cdef int32_t detail = self._detail
        if status == DFCCL_STATUS_OK:
            return None
        kind, tag, rank = self._own_names()
        name = collective_name(tag, self.instance)
        diag = self._daemon.diagnostics.get(self.endpoint) if self._daemon is not None else None
        if status == DFCCL_STATUS_MISMATCH and diag is not None:
            try:
                err = diag.mismatch_error(self._key, self.instance, kind, tag, rank)
            except Exception:
                err = None
            if err is not None:
                return err
        if status == DFCCL_STATUS_PEER_LOST:
            why = None
            if diag is not None:
                diag.peer_lost(detail)   # the communicator takes no more collectives
                why = diag.lost_why.get(detail)
            return PeerLostError(
                f"rank {rank}: {kind} {name} failed: rank {detail} "
                + (f"is lost: {why}" if why else "is lost (its process died or stopped, or its device failed)"),
                rank=rank, tag=tag, origin=detail)
        if status == DFCCL_STATUS_BAD_TASK:
            return BackendError(
                f"rank {rank}: {kind} {name} was rejected by the "
                "daemon: its descriptor failed the device-side checks (DFCCL_STATUS_BAD_TASK)")
        if status == DFCCL_STATUS_PEER_ABORTED and detail == rank:
            # This rank's own abort, relayed back by a peer that saw it first.
            status = DFCCL_STATUS_ABORTED
        if status == DFCCL_STATUS_PEER_ABORTED and detail >= 0 and diag is not None and diag.rank_left(detail):
            return PeerAbortedError(
                f"rank {rank}: {kind} {name} was abandoned: rank "
                f"{detail} was aborted or closed before it took part", rank=rank, tag=tag, origin=detail)
        if status == DFCCL_STATUS_MISMATCH:
            return MismatchError(
                f"rank {rank}: {kind} {name} does not match rank "
                f"{detail}'s submission of the same tag (kind, count, dtype, op or root differ)",
                rank=rank, tag=tag, peer=detail)
        if status == DFCCL_STATUS_PEER_ABORTED:
            return PeerAbortedError(
                f"rank {rank}: {kind} {name} was abandoned: rank "
                f"{detail} failed it (signature mismatch or abort)", rank=rank, tag=tag, origin=detail)
        if status == DFCCL_STATUS_ABORTED:
            return AbortedError(
                f"rank {rank}: {kind} {name} was aborted",
                rank=rank, tag=tag)
        return DfcclError(f"rank {rank}: {kind} {name} failed with status {status}",
                          rank=rank, tag=tag)

    def __repr__(self):
        state = "done" if self._retired else "pending"
        return f"<dfccl.Work {self.kind} {self.name} rank={self.rank} {state}>"
