# cython: language_level=3
"""The simulator backend: every simulated GPU is a set of host threads running
the daemon's scheduler (compiled from cuda/daemon with the host compiler), and
its memory is host memory.  Memory that other processes must map lives in a
shared-memory file."""

import mmap
import os
import uuid

from libc.stdint cimport uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport calloc, free
from libc.string cimport memcpy
from dfccl._native.abi cimport dfccl_add_fetch_u32, dfccl_daemon_args, dfccl_graph_arm
from dfccl._native.device cimport Device

from dfccl.errors import BackendError, InvalidArgumentError
from dfccl.shared_files import create_mapped, shared_directory


cdef extern from "sim_device.h":
    ctypedef struct dfccl_sim_device:
        pass
    dfccl_sim_device *dfccl_sim_device_create() nogil
    int dfccl_sim_device_launch(dfccl_sim_device *dev, const dfccl_daemon_args *args) nogil
    void dfccl_sim_device_synchronize(dfccl_sim_device *dev) nogil
    int dfccl_sim_device_busy(dfccl_sim_device *dev) nogil
    void dfccl_sim_device_destroy(dfccl_sim_device *dev) nogil
    ctypedef struct dfccl_sim_graph_arm_params:
        dfccl_daemon_args args
        dfccl_graph_arm arm
    void dfccl_sim_graph_arm(const void *params) nogil


cdef extern from "sim_stream.h":
    ctypedef struct dfccl_sim_stream:
        pass
    ctypedef struct dfccl_sim_graph:
        pass
    dfccl_sim_stream *dfccl_sim_stream_create() nogil
    void dfccl_sim_stream_write32(dfccl_sim_stream *s, uint64_t addr, uint32_t value) nogil
    void dfccl_sim_stream_wait32(dfccl_sim_stream *s, uint64_t addr, uint32_t value) nogil
    void dfccl_sim_stream_delay(dfccl_sim_stream *s, uint64_t ns) nogil
    uint64_t dfccl_sim_stream_pending(dfccl_sim_stream *s) nogil
    int dfccl_sim_stream_synchronize(dfccl_sim_stream *s, uint64_t timeout_ns) nogil
    void dfccl_sim_stream_destroy(dfccl_sim_stream *s) nogil
    void dfccl_sim_stream_wait_mask32(dfccl_sim_stream *s, uint64_t addr, uint32_t mask) nogil
    void dfccl_sim_stream_call(dfccl_sim_stream *s, void (*fn)(const void *) noexcept nogil, const void *params,
                               uint64_t nbytes) nogil
    int dfccl_sim_stream_begin_capture(dfccl_sim_stream *s) nogil
    dfccl_sim_graph *dfccl_sim_stream_end_capture(dfccl_sim_stream *s) nogil
    int dfccl_sim_stream_capturing(dfccl_sim_stream *s) nogil
    int dfccl_sim_graph_launch(dfccl_sim_graph *g, dfccl_sim_stream *s) nogil
    uint64_t dfccl_sim_graph_size(dfccl_sim_graph *g) nogil
    void dfccl_sim_graph_destroy(dfccl_sim_graph *g) nogil


cdef class SimDevice(Device)


cdef class SimStream:
    """A stream of a simulated GPU (SimDevice.create_stream): its operations
    run in order on a host thread of its own, as a CUDA stream's run on the
    device.  Pass it (or its ``handle``) as ``stream=`` to a collective or to
    ``Work.wait``: a stream-ordered collective runs once the stream reaches
    it, and a wait holds up what is queued after it until the collective
    completes.  ``delay()`` stands for a kernel that runs for a while.
    ``runtime.device_synchronize`` does not wait for simulated streams."""

    cdef dfccl_sim_stream *s
    cdef readonly SimDevice device
    cdef list _releases   # while capturing: the words its graph sets when destroyed (retain_for_capture)

    def __cinit__(self, SimDevice device):
        self.device = device
        self._releases = []
        self.s = dfccl_sim_stream_create()
        if self.s == NULL:
            raise BackendError("sim backend: cannot create a stream")

    @property
    def handle(self):
        """What ``stream=`` takes (an int, like a CUstream)."""
        return <uint64_t><uintptr_t>self.s

    cdef dfccl_sim_stream *_open(self) except NULL:
        if self.s == NULL:
            raise InvalidArgumentError("this simulated stream is closed")
        return self.s

    def delay(self, double seconds):
        """Holds up what is queued after it by ``seconds`` (a long kernel)."""
        if not seconds >= 0:
            raise InvalidArgumentError(f"delay: seconds must be >= 0, not {seconds!r}")
        dfccl_sim_stream_delay(self._open(), <uint64_t>(seconds * 1e9))

    def write32(self, uint64_t addr, uint32_t value):
        """``*addr = value`` in stream order (cuStreamWriteValue32)."""
        dfccl_sim_stream_write32(self._open(), addr, value)

    def wait32(self, uint64_t addr, uint32_t value):
        """What follows waits until ``*addr >= value`` (cuStreamWaitValue32 GEQ)."""
        dfccl_sim_stream_wait32(self._open(), addr, value)

    def wait_mask32(self, uint64_t addr, uint32_t mask):
        """What follows waits until ``*addr & mask`` is nonzero (cuStreamWaitValue32 AND)."""
        dfccl_sim_stream_wait_mask32(self._open(), addr, mask)

    def begin_capture(self):
        """From now until end_capture(), what is issued on this stream is
        recorded into a graph instead of run (cuStreamBeginCapture)."""
        if not dfccl_sim_stream_begin_capture(self._open()):
            raise InvalidArgumentError("this simulated stream is already capturing")
        self._releases = []

    def end_capture(self):
        """Ends the capture; returns the graph (SimGraph) that runs what
        was recorded at each launch (cuStreamEndCapture + cuGraphInstantiate)."""
        cdef dfccl_sim_graph *g = dfccl_sim_stream_end_capture(self._open())
        if g == NULL:
            raise InvalidArgumentError("this simulated stream is not capturing")
        graph = SimGraph.__new__(SimGraph)
        (<SimGraph>graph).g = g
        (<SimGraph>graph)._releases = self._releases
        self._releases = []
        return graph

    @property
    def capturing(self):
        """Whether the stream is capturing (cuStreamIsCapturing)."""
        return dfccl_sim_stream_capturing(self._open()) != 0

    def pending(self):
        """Operations queued that have not finished."""
        return dfccl_sim_stream_pending(self._open())

    def synchronize(self, timeout=None):
        """Waits (without the GIL) for what is queued now; False if
        ``timeout`` seconds passed first."""
        cdef dfccl_sim_stream *st = self._open()
        cdef uint64_t ns = 0 if timeout is None else max(1, <uint64_t>(float(timeout) * 1e9))
        cdef int ok
        with nogil:
            ok = dfccl_sim_stream_synchronize(st, ns)
        return ok != 0

    def close(self):
        """Drops what has not run, a wait that would never end included.
        Idempotent."""
        if self.s != NULL:
            self.device._streams.pop(<uint64_t><uintptr_t>self.s, None)
            with nogil:
                dfccl_sim_stream_destroy(self.s)
            self.s = NULL

    def __dealloc__(self):
        if self.s != NULL:
            with nogil:
                dfccl_sim_stream_destroy(self.s)
            self.s = NULL


cdef void _release_word(const void *params) noexcept nogil:
    # A stream a closed graph was launched on got past its last launch.
    dfccl_add_fetch_u32((<uint32_t **>params)[0], 1)


cdef class SimGraph:
    """What a simulated stream captured (SimStream.end_capture): launch()
    queues it on a stream, in its captured order, as cuGraphLaunch queues an
    executable graph; close() destroys it, and with it what captured
    collectives hold (their slots, tags and staging) once the context next
    looks.  Launches already queued run to their end."""

    cdef dfccl_sim_graph *g
    cdef list _releases
    cdef dict _launched_on   # stream handle -> SimStream it was launched on

    def __init__(self):
        raise TypeError("SimGraph is made by SimStream.end_capture()")

    def launch(self, SimStream stream):
        """Queues the graph's operations on ``stream`` (cuGraphLaunch)."""
        if self.g == NULL:
            raise InvalidArgumentError("this simulated graph is closed")
        if not dfccl_sim_graph_launch(self.g, stream._open()):
            raise InvalidArgumentError("a simulated graph cannot be launched on a capturing stream")
        if self._launched_on is None:
            self._launched_on = {}
        self._launched_on[stream.handle] = stream

    @property
    def size(self):
        """Operations the graph holds."""
        return 0 if self.g == NULL else dfccl_sim_graph_size(self.g)

    def close(self):
        """Destroys the graph (cuGraphExecDestroy + cuGraphDestroy).  What
        its captures hold is released, as CUDA releases a graph's user
        objects, once its launches have run: each release word counts the
        streams it was launched on up to 1.  Idempotent."""
        cdef uint32_t *word
        cdef SimStream st
        if self.g == NULL:
            return
        dfccl_sim_graph_destroy(self.g)
        self.g = NULL
        streams = [st for st in (self._launched_on or {}).values() if st.s != NULL]
        for w in self._releases:
            word = <uint32_t *><uintptr_t>w
            word[0] = <uint32_t>(1 - len(streams))
            for st in streams:
                dfccl_sim_stream_call(st.s, _release_word, &word, sizeof(word))
        self._releases = []
        self._launched_on = None

    def __dealloc__(self):
        self.close()


cdef uint64_t _buffer_address(object mm) except? 0:
    cdef const unsigned char[:] view = memoryview(mm).cast("B")
    return <uint64_t><uintptr_t>&view[0]


def _unlink(path):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


cdef class SimDevice(Device):
    """One simulated GPU."""

    cdef dfccl_sim_device *dev
    cdef int fault         # inject_fault(): what query_fault() reports
    cdef dict _streams     # handle -> SimStream, the streams of this device
    cdef dict _shared      # address -> (mmap, path) for memory we created
    cdef dict _imported    # address -> mmap for memory other processes created

    def __cinit__(self, int device, int blocks=2):
        self.backend = "sim"
        self.ordinal = device
        self.default_blocks = blocks
        self.block_threads = 1
        self.resident_blocks = 0  # a thread per block: no limit
        self._shared = {}
        self._imported = {}
        self._streams = {}
        self.dev = dfccl_sim_device_create()
        if self.dev == NULL:
            raise BackendError("sim backend: cannot create the simulated device")

    cdef int launch(self, const dfccl_daemon_args *args) noexcept nogil:
        if self.fault:
            return self.fault   # a failed device launches nothing
        return dfccl_sim_device_launch(self.dev, args)

    cdef int query_fault(self) noexcept nogil:
        return self.fault

    def inject_fault(self, int code):
        """Tests only: the device reports ``code`` from now on, as a GPU
        does after a fault (the daemon blocks, host threads here, go on; the
        daemon treats the device as failed all the same)."""
        self.fault = code

    def fault_name(self, int code):
        return f"simulated device fault {code}"

    def create_stream(self):
        """A new stream of this simulated GPU (SimStream)."""
        st = SimStream(self)
        self._streams[st.handle] = st
        return st

    cdef SimStream _stream(self, uint64_t stream, str what):
        st = self._streams.get(stream)
        if st is None:
            raise InvalidArgumentError(f"{what} on the simulator needs one of its streams "
                                       f"(SimDevice.create_stream() of sim:{self.ordinal}), not {stream:#x}")
        return <SimStream>st

    cdef int stream_write32(self, uint64_t stream, uint64_t addr, uint32_t value) except -1:
        self._stream(stream, "stream-ordered submission").write32(addr, value)
        return 0

    cdef int stream_wait32(self, uint64_t stream, uint64_t addr, uint32_t value) except -1:
        self._stream(stream, "a stream-ordered wait").wait32(addr, value)
        return 0

    cdef int stream_capturing(self, uint64_t stream) except -1:
        return 1 if self._stream(stream, "stream-ordered submission").capturing else 0

    cdef int stream_wait_mask32(self, uint64_t stream, uint64_t addr, uint32_t mask) except -1:
        self._stream(stream, "a stream-ordered wait").wait_mask32(addr, mask)
        return 0

    cdef int stream_graph_arm(self, uint64_t stream, const dfccl_daemon_args *args, const dfccl_graph_arm *arm) except -1:
        cdef dfccl_sim_graph_arm_params params
        cdef SimStream st = self._stream(stream, "a captured collective")
        params.args = args[0]
        params.arm = arm[0]
        dfccl_sim_stream_call(st._open(), dfccl_sim_graph_arm, &params, sizeof(params))
        return 0

    cdef int retain_for_capture(self, uint64_t stream, uint32_t *released) except -1:
        cdef SimStream st = self._stream(stream, "a captured collective")
        if not st.capturing:
            raise InvalidArgumentError("retain_for_capture: the simulated stream is not capturing")
        st._releases.append(<uintptr_t>released)
        return 0

    def alloc_mapped(self, size_t nbytes):
        cdef void *p = calloc(1, nbytes if nbytes else 1)
        if p == NULL:
            raise MemoryError(f"sim backend: cannot allocate {nbytes} bytes")
        return (<uint64_t><uintptr_t>p, <uint64_t><uintptr_t>p)

    def free_mapped(self, uint64_t host_ptr):
        free(<void *><uintptr_t>host_ptr)

    def alloc_device(self, size_t nbytes, bint shareable=False, bint zeroed=True):
        # Zeroed either way (the simulator's memory costs no stream).
        if not shareable:
            return self.alloc_mapped(nbytes)[0]
        path = os.path.join(shared_directory(), f"dfccl-{os.getpid()}-{uuid.uuid4().hex}")
        mm = create_mapped(path, nbytes, exclusive=True, mode=0o600)
        addr = _buffer_address(mm)
        self._shared[addr] = (mm, path, nbytes)
        return addr

    def free_device(self, uint64_t ptr):
        entry = self._shared.pop(ptr, None)
        if entry is None:
            free(<void *><uintptr_t>ptr)
            return
        mm, path, _ = entry
        _unlink(path)
        try:
            mm.close()
        except BufferError:
            pass  # a view is still alive; the mapping goes with the process

    def copy_to_device(self, uint64_t dst, uint64_t src_host, size_t nbytes):
        memcpy(<void *><uintptr_t>dst, <const void *><uintptr_t>src_host, nbytes)

    def copy_from_device(self, uint64_t dst_host, uint64_t src, size_t nbytes):
        memcpy(<void *><uintptr_t>dst_host, <const void *><uintptr_t>src, nbytes)

    def export_memory(self, uint64_t ptr):
        entry = self._shared.get(ptr)
        if entry is None:
            raise InvalidArgumentError("sim backend: only memory allocated with shareable=True can be exported")
        return {"via": "sim-shm", "path": entry[1], "size": entry[2]}

    def shared_allocation(self, uint64_t ptr):
        """(base, size, name) of the shareable allocation holding ``ptr``
        (the simulator's cuMemGetAddressRange; the name tells a freed and
        reallocated one apart), or None."""
        for base, (_mm, path, nbytes) in self._shared.items():
            if base <= ptr < base + nbytes:
                return base, nbytes, path
        return None

    def unlink_export(self, uint64_t ptr):
        # The file only names the memory for peers still to map it; the pages
        # live on in every existing mapping, ours included.
        entry = self._shared.get(ptr)
        if entry is not None:
            _unlink(entry[1])

    def import_memory(self, desc):
        if desc.get("via") != "sim-shm":
            raise InvalidArgumentError(f"sim backend cannot map memory exported via {desc.get('via')!r}")
        try:
            fd = os.open(desc["path"], os.O_RDWR)
        except FileNotFoundError:
            raise BackendError(f"sim backend: the shared memory {desc['path']} of a peer is gone (the peer closed, "
                               "failed or exited during start-up)") from None
        try:
            mm = mmap.mmap(fd, int(desc["size"]))
        finally:
            os.close(fd)
        addr = _buffer_address(mm)
        self._imported[addr] = mm
        return addr

    def release_import(self, uint64_t ptr):
        mm = self._imported.pop(ptr, None)
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass

    def can_access(self, Device other):
        return isinstance(other, SimDevice)

    def enable_access(self, Device other):
        pass

    def synchronize(self):
        with nogil:
            dfccl_sim_device_synchronize(self.dev)

    def busy(self):
        return dfccl_sim_device_busy(self.dev) != 0

    def close(self):
        for st in list(self._streams.values()):
            st.close()   # before the device: a stream may wait for a collective
        if self.dev != NULL:
            with nogil:
                dfccl_sim_device_destroy(self.dev)
            self.dev = NULL
        # Runs at interpreter exit (runtime.shutdown): no shared-memory file
        # may outlive the process.  The mappings stay (views may be alive).
        for _mm, path, _n in self._shared.values():
            _unlink(path)

    def forget_after_fork(self):
        # The device's threads do not exist in the child: never join them.
        cdef SimStream st
        self.dev = NULL
        self._shared = {}
        self._imported = {}
        for st in self._streams.values():
            st.s = NULL   # nor the streams' threads
        self._streams = {}

    def __dealloc__(self):
        if self.dev != NULL:
            with nogil:
                dfccl_sim_device_destroy(self.dev)
            self.dev = NULL
