# cython: language_level=3
"""A daemon's collectives captured in CUDA graphs (docs/architecture.md,
"CUDA graphs"): GraphCaptures, a part of Daemon, binds a collective issued
on a capturing stream once (a tag of its own, its record and staging, a
completion slot held until the graph is destroyed), captures its arm node
and the wait for it, notices failed replays, and frees what a destroyed
graph's collectives held.  It owns that state; Daemon refuses what it must
(closed, failed device) before it hands a capture here."""


import threading

from cpython.pythread cimport PyThread_release_lock
from libc.stdint cimport int32_t, uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport calloc, free
from libc.string cimport memcpy

from dfccl._native.abi cimport *
from dfccl._native.core cimport SLOT_FREE, SLOT_GRAPH, daemon_core, plan_t, tag_grant
from dfccl._native.descriptor cimport TaskDescriptor, fill_instance
from dfccl._native.device cimport Device
from dfccl._native.launch cimport core_decref, core_incref, wake_watch
from dfccl._native.retire cimport lock_gil, retire_completed
from dfccl._native.work cimport Work

from dfccl.errors import NotSupportedError, ResourceError

__all__ = ["CapturedNode", "GraphCaptures"]


class CapturedNode:
    """A collective captured in a CUDA graph: what it holds until the graph
    is destroyed (``released`` turns 1)."""

    __slots__ = ("slot", "key", "tags", "released", "kind", "tag", "rank", "endpoint", "first_instance", "owners",
                 "aux", "failed", "reported")

    def __init__(self, slot, key, tags, released, kind, tag, rank, endpoint, first_instance, owners, aux):
        self.slot, self.key, self.tags, self.released = slot, key, tags, released
        self.kind, self.tag, self.rank, self.endpoint = kind, tag, rank, endpoint
        self.first_instance, self.owners = first_instance, owners
        self.aux = aux          # (offset, bytes) of staging it has alone (an all-to-all's split table), or None
        self.failed = None      # the error of its last failed replay
        self.reported = 0       # the completion word of that replay


cdef GraphCaptures new_graph_captures(daemon_core *c, Device device, object policy):
    cdef GraphCaptures g = GraphCaptures.__new__(GraphCaptures)
    core_incref(c)
    g.c = c
    g.device = device
    g.policy = policy
    g._nodes = {}
    g._errors = []
    g._lock = threading.Lock()
    return g


cdef class GraphCaptures:
    """The collectives one daemon captured in CUDA graphs that are alive."""

    def __dealloc__(self):
        if self.c != NULL:
            core_decref(self.c)
            self.c = NULL

    cdef object bind(self, TaskDescriptor task, uint64_t send_addr, uint64_t recv_addr, uint64_t stream,
                     object owners):
        """``task`` issued on ``stream`` while it captures a CUDA graph: binds
        it once (a tag of its own, its record and staging, a slot) and
        captures its arm node and the wait for it, so that every replay runs
        the tag's next instance (cuda/daemon/graph.cuh).  An all-to-all's
        split table (``task.plan.aux_offset``, written before the capture
        and never by a replay) becomes the graph's: every replay reads the
        counts captured, and its done flags carry each replay's token.
        Returns its CapturedNode."""
        cdef plan_t plan
        cdef tag_grant g
        cdef dfccl_graph_arm arm
        cdef dfccl_task_desc *d = &arm.desc
        cdef uint32_t slot
        cdef uint32_t *released
        cdef daemon_core *c = self.c
        self.reap()
        memcpy(&plan, &task.plan, sizeof(plan_t))
        plan.key = task.tags.graph_key(task.key)
        plan.desc.tag_key = plan.key
        plan.desc.first_block = dfccl_first_block(plan.key, plan.block_offset, c.nblocks)
        task.tags.acquire_c(plan.key, False, plan.staging_bytes, &plan.layout, plan.has_layout, &g)
        try:
            slot = self._take_slot()
        except BaseException:
            task.tags.release(plan.key, False, None, False)
            raise
        fill_instance(d, &plan, &g, send_addr, recv_addr, slot)
        d.flags = d.flags | DFCCL_TASK_ARMED | DFCCL_TASK_GRAPH
        d.gen = 0
        d.after = 0   # a tag of its own: no earlier instance laid its staging out
        self._bindings += 1
        arm.binding = self._bindings
        released = <uint32_t *>calloc(1, sizeof(uint32_t))
        if released == NULL:
            self._free_slot(slot)
            task.tags.release(plan.key, False, None, False)
            raise MemoryError
        # No replay pending yet: the word each replay's arm waits on first.
        dfccl_store_release_u32(&c.done[slot], DFCCL_GRAPH_GEN_BIT)
        try:
            # The previous replay complete (a graph that never waits for its
            # collective still runs one replay of it at a time), then the arm.
            self.device.stream_wait_mask32(stream, c.done_dev + 4 * slot, DFCCL_GRAPH_GEN_BIT)
            self.device.stream_graph_arm(stream, &c.args, &arm)
            self.device.retain_for_capture(stream, released)
        except BaseException:
            # The capture is broken anyway (CUDA invalidates it); nothing was bound.
            free(released)
            self._free_slot(slot)
            task.tags.release(plan.key, False, None, False)
            raise
        node = self._nodes[slot] = CapturedNode(slot, plan.key, task.tags, <uintptr_t>released, task.kind,
                                                task.tag, task.rank, task.plan.desc.endpoint, g.instance, owners,
                                                (plan.aux_offset, plan.aux_bytes) if plan.aux_bytes else None)
        c.n_graph_slots += 1
        wake_watch(c)   # it watches graph_arms from now on
        return node

    cdef uint32_t _take_slot(self) except? 0xffffffff:
        """A completion slot for a captured collective, held until its graph
        is destroyed (never on the outstanding list: nothing retires it)."""
        cdef daemon_core *c = self.c
        cdef uint32_t slot
        if c.n_free == 0:
            # Completed collectives nobody has retired yet free theirs first.
            retire_completed(c, self.policy, False)
        lock_gil(c)
        try:
            if c.n_free == 0:
                raise ResourceError(f"no completion slot is free on {self.device.where} for a "
                                    "captured collective (raise DaemonOptions.max_outstanding)")
            c.n_free -= 1
            slot = c.free_stack[c.n_free]
            c.slots[slot].state = SLOT_GRAPH
        finally:
            PyThread_release_lock(c.lock)
        return slot

    cdef void _free_slot(self, uint32_t slot):
        cdef daemon_core *c = self.c
        lock_gil(c)
        c.slots[slot].state = SLOT_FREE
        c.free_stack[c.n_free] = slot
        c.n_free += 1
        PyThread_release_lock(c.lock)

    def reap(self):
        """Frees what captured collectives of destroyed graphs held: the
        slot, the tag's record and staging, an all-to-all's split table (a
        failed tag keeps them, as any failed tag does).  Returns how many
        are still alive."""
        for slot, node in list(self._nodes.items()):
            # Destroyed, and its last replay complete (the daemon may still
            # run a replay whose graph finished without waiting for it).
            if (<uint32_t *><uintptr_t>node.released)[0] != 1:
                continue
            if not (dfccl_load_acquire_u32(&self.c.done[<uint32_t>slot]) & DFCCL_GRAPH_GEN_BIT):
                continue
            del self._nodes[slot]
            free(<void *><uintptr_t>node.released)
            # ran: a replay reached the daemon (the word moved past the one set at capture)
            node.tags.release(node.key, node.failed is not None, node.aux,
                              self.c.done[<uint32_t>slot] != DFCCL_GRAPH_GEN_BIT)
            self._free_slot(slot)
            self.c.n_graph_slots -= 1
        return len(self._nodes)

    def held_by(self, uint32_t endpoint):
        """The endpoint's captured collectives whose graphs are alive: a
        replay may still run them."""
        self.reap()
        return sum(1 for n in self._nodes.values() if n.endpoint == endpoint)

    def captured(self):
        """Captured collectives whose graphs are alive, as dicts (kind, tag,
        rank, endpoint, slot, and the error of its last failed replay or
        None).  Every completion word is read, flagged or not: the daemon
        flags a failure just after publishing it, so a stream that a failed
        replay released may run ahead of the flag."""
        self.scan(every=True)
        self.reap()
        return [{"kind": n.kind, "tag": n.tag, "rank": n.rank, "endpoint": n.endpoint, "slot": n.slot,
                 "error": None if n.failed is None else str(n.failed)} for n in self._nodes.values()]

    def stream_wait(self, uint64_t stream, uint32_t slot):
        """Work.wait(stream) of a captured collective: ``stream`` must be
        capturing (into the same graph) and waits for each replay."""
        if not self.device.stream_capturing(stream):
            raise NotSupportedError("wait: a collective captured in a CUDA graph can only be waited for by a stream "
                                    "that captures into the same graph")
        self.device.stream_wait_mask32(stream, self.c.done_dev + 4 * slot, DFCCL_GRAPH_GEN_BIT)

    def check(self, uint32_t endpoint):
        """Raises the error of a replay of one of ``endpoint``'s captured
        collectives that failed since that rank's last call (the daemon
        flags it in ctrl.graph_failed); the collective's later replays run
        as usual.  Ranks sharing the daemon each get their own failures.
        Every failure seen is in captured()."""
        self.scan()
        with self._lock:
            for i, (owner, err) in enumerate(self._errors):
                if owner == endpoint:
                    del self._errors[i]
                    self.c.n_graph_errors = len(self._errors)
                    raise err

    def forget_errors(self, uint32_t endpoint):
        """``endpoint`` is removed: its failures not raised yet are dropped."""
        with self._lock:
            self._errors = [(owner, err) for owner, err in self._errors if owner != endpoint]
            self.c.n_graph_errors = len(self._errors)

    def scan(self, every=False):
        """Records the replays that failed since the daemon last flagged
        one (each captured collective's last error, and the errors for
        check() to raise); ``every``: whether or not one is flagged, and
        leaving the flag to check().  Threads may scan at once (the status
        page's writer does): each builds the errors it finds, outside the
        lock (explaining one reads the communicator's records under its
        teardown lock, which that writer holds while it scans), and the
        first to record a replay's failure keeps it."""
        cdef daemon_core *c = self.c
        cdef uint32_t word, status
        cdef int32_t detail
        cdef Work w
        if not every:
            if dfccl_load_acquire_u64(&c.ctrl.graph_failed) == 0:
                return
            dfccl_store_release_u64(&c.ctrl.graph_failed, 0)
        dfccl_fence_seq_cst()
        for node in list(self._nodes.values()):
            word = dfccl_load_acquire_u32(&c.done[node.slot])
            status = c.results[node.slot].status
            detail = c.results[node.slot].detail
            if not (word & DFCCL_GRAPH_GEN_BIT) or status == DFCCL_STATUS_OK or node.reported == word:
                continue
            replay = word & ~DFCCL_GRAPH_GEN_BIT
            w = Work.completed(node.kind, node.tag, node.rank)
            # The daemon explains the failure (its endpoints' diagnostics).
            w._daemon = <object>c.py_daemon if c.py_daemon != NULL else None
            w.endpoint = node.endpoint
            w.instance = node.first_instance + replay - 1
            w._status = status
            w._detail = detail
            cause = w._make_error()
            err = type(cause)(f"replay {replay} of a captured collective failed: {cause}", rank=node.rank,
                              tag=node.tag)
            with self._lock:
                if node.reported != word:
                    node.reported = word
                    node.failed = err
                    self._errors.append((node.endpoint, err))
                    c.n_graph_errors = len(self._errors)

    def close(self):
        """The daemon closes: returns how many captured collectives are
        still alive, and forgets them.  Their arm nodes name the daemon's
        memory, so a replay after close would write memory that is gone;
        the words their graphs set when destroyed stay allocated."""
        alive = self.reap()
        self._nodes = {}
        return alive
