# cython: language_level=3
"""What a daemon needs from the machine it runs on: memory the daemon and the
host both see, device memory, daemon launches, and stream operations.  Two
implementations: the CUDA driver (cuda_device) and the simulator
(sim_device)."""

from libc.stdint cimport uint32_t, uint64_t
from dfccl._native.abi cimport dfccl_daemon_args, dfccl_graph_arm


cdef class Device:
    """Abstract base; see SimDevice and CudaDevice."""

    @property
    def where(self):
        """``backend:ordinal``, as messages name this device (``cuda:0``)."""
        return f"{self.backend}:{self.ordinal}"

    cdef int launch(self, const dfccl_daemon_args *args) noexcept nogil:
        return -1

    cdef int query_fault(self) noexcept nogil:
        """Nonzero (the device's error code) once the device has failed
        under the daemon (a fault that ends every kernel of the process, as an
        illegal address does on a GPU); 0 otherwise.  Called without the GIL,
        by the daemon's watcher."""
        return 0

    cdef int stream_write32(self, uint64_t stream, uint64_t addr, uint32_t value) except -1:
        raise NotImplementedError

    cdef int stream_wait32(self, uint64_t stream, uint64_t addr, uint32_t value) except -1:
        raise NotImplementedError

    # The same without the GIL, for the hot path: 0 when done; nonzero when
    # it failed or needs the GIL (the simulator's streams are Python
    # objects), and then stream_write32 / stream_wait32 do it or say why.
    cdef int try_stream_write32(self, uint64_t stream, uint64_t addr, uint32_t value) noexcept nogil:
        return -1

    cdef int try_stream_wait32(self, uint64_t stream, uint64_t addr, uint32_t value) noexcept nogil:
        return -1

    # -- CUDA graphs (docs/architecture.md, "CUDA graphs") ----------------
    cdef int stream_capturing(self, uint64_t stream) except -1:
        """1 if ``stream`` is capturing a graph, else 0."""
        return 0

    def is_capturing(self, uint64_t stream):
        """stream_capturing() for Python callers: whether ``stream`` (a
        handle) is capturing a graph."""
        return self.stream_capturing(stream) != 0

    cdef int try_stream_capturing(self, uint64_t stream) noexcept nogil:
        """stream_capturing() without the GIL: 0 or 1, or -1 when it cannot
        tell (stream_capturing() then says, or why not)."""
        return -1

    cdef int stream_wait_mask32(self, uint64_t stream, uint64_t addr, uint32_t mask) except -1:
        """What follows on ``stream`` waits until ``*addr & mask`` is
        nonzero (cuStreamWaitValue32 AND)."""
        raise NotImplementedError

    cdef int stream_graph_arm(self, uint64_t stream, const dfccl_daemon_args *args, const dfccl_graph_arm *arm) except -1:
        """Queues the arm node of a captured collective on ``stream``
        (cuda/daemon/graph.cuh): a kernel of one thread on a GPU."""
        raise NotImplementedError

    cdef int retain_for_capture(self, uint64_t stream, uint32_t *released) except -1:
        """Sets ``*released`` to 1 once the graph ``stream`` is capturing
        has been destroyed (with every executable graph made from it);
        ``released`` must stay valid until then."""
        raise NotImplementedError

    # -- memory ------------------------------------------------------------
    def alloc_mapped(self, size_t nbytes):
        """Zeroed memory that the host and the daemon both address: returns
        (host pointer, daemon-side pointer)."""
        raise NotImplementedError

    def free_mapped(self, uint64_t host_ptr):
        raise NotImplementedError

    def alloc_device(self, size_t nbytes, bint shareable=False, bint zeroed=True):
        """Memory of the daemon's device, zeroed unless ``zeroed`` is false
        (zeroing waits for a stream of its own, which an application
        stream's wait can hold up: memory taken while collectives run is
        not); ``shareable``: other processes may map it (export_memory /
        import_memory)."""
        raise NotImplementedError

    def free_device(self, uint64_t ptr):
        raise NotImplementedError

    def copy_to_device(self, uint64_t dst, uint64_t src_host, size_t nbytes):
        raise NotImplementedError

    def copy_from_device(self, uint64_t dst_host, uint64_t src, size_t nbytes):
        raise NotImplementedError

    def stage_to_device(self, uint64_t dst, uint64_t src_host, size_t nbytes, stream):
        """Copies what a collective will read (an all-to-all's split table)
        without waiting for it: ordered on ``stream`` (a handle, or None).
        Returns the stream that must arm the collective, after the copy
        (None: the copy is done, the collective may run at once).  The
        source may be reused on return.  On a stream that captures a CUDA
        graph the copy is made at once, outside the graph (what is staged
        for a captured collective is bound once, not copied per replay), and
        that stream is returned."""
        self.copy_to_device(dst, src_host, nbytes)
        return stream

    def forget_after_fork(self):
        """In a forked child: this backend is its parent's.  Drops every handle
        without freeing or unlinking anything (the parent still uses it, and on
        GPUs a forked child cannot make CUDA calls), so that closing or
        collecting it in the child does nothing."""

    def read_device(self, uint64_t dst_host, uint64_t src, size_t nbytes, double timeout):
        """copy_from_device for explanations (error messages, status):
        gives up with BackendError after ``timeout`` seconds instead of
        waiting for a device that does not answer."""
        self.copy_from_device(dst_host, src, nbytes)

    def export_memory(self, uint64_t ptr):
        """A JSON-able description that import_memory() turns into a local
        pointer in another process."""
        raise NotImplementedError

    def import_memory(self, desc):
        raise NotImplementedError

    def release_import(self, uint64_t ptr):
        raise NotImplementedError

    def unlink_export(self, uint64_t ptr):
        """Removes the name other processes map exported memory by (call once
        they all have); the memory stays mapped.  A no-op where exporting
        leaves no name behind."""
        pass

    # -- peers -------------------------------------------------------------
    def can_access(self, Device other):
        """Can this device's daemon address ``other``'s memory in place?"""
        raise NotImplementedError

    def enable_access(self, Device other):
        raise NotImplementedError

    # -- daemon ------------------------------------------------------------
    def launch_error(self, int code):
        """The exception for a failed launch() return code."""
        from dfccl.errors import BackendError
        return BackendError(f"{self.backend} backend: daemon launch failed ({code})")

    def fault_name(self, int code):
        """What a query_fault() code is called."""
        return f"error {code}"

    def synchronize(self):
        """Waits until every queued daemon launch has finished."""
        raise NotImplementedError

    def close(self):
        pass
