# cython: language_level=3
"""The CUDA backend: the daemon kernel on a real GPU through the CUDA driver
API, called through the table of cuda_driver.pyx without the GIL.  Every
call is checked; a failure raises BackendError naming the call and the
CUresult."""

import threading

from libc.stdint cimport uint32_t, uint64_t, uintptr_t
from libc.string cimport memcpy, memset
from dfccl._native.abi cimport dfccl_daemon_args, dfccl_graph_arm, dfccl_now_ns, dfccl_sleep_ns
from dfccl._native.cuda_driver cimport *
from dfccl._native.cuda_driver cimport check, driver_api, error_name
from dfccl._native.device cimport Device

from dfccl._native.cuda_driver import device_count, load_driver, pointer_device, relax_thread_capture_mode
from dfccl.errors import BackendError, InvalidArgumentError

__all__ = ["CudaDevice", "load_driver", "device_count", "relax_thread_capture_mode", "pointer_device"]


cdef enum:
    BLOCK_THREADS = 512  # threads of a daemon block (cuda/daemon/daemon_kernel.cu)

# The driver's entry points (filled by load_driver before a device exists).
cdef dfccl_cuda_api *API = driver_api()


cdef void _graph_destroyed(void *released) noexcept nogil:
    # A user object's destructor (a driver thread, no CUDA call allowed):
    # the graph that held it is gone; the daemon frees what it bound.
    (<uint32_t *>released)[0] = 1


cdef class CudaDevice(Device):
    """One GPU: its primary context, the daemon module and a private stream."""

    cdef CUdevice cu_device
    cdef CUcontext cu_ctx
    cdef CUmodule module
    cdef CUfunction daemon_fn
    cdef CUfunction graph_arm_fn
    cdef CUstream stream
    cdef CUstream setup_stream
    cdef readonly int sm_count
    cdef readonly int compute_capability
    cdef readonly str pci_bus_id
    cdef readonly bytes uuid
    cdef dict _imported
    # read_device's pinned bounce buffer; `pending`: a read gave up while
    # its copy was still queued (the copy may land in it later).
    cdef void *_bounce
    cdef size_t _bounce_bytes
    cdef bint _bounce_pending
    cdef object _read_lock

    def __cinit__(self, int device, bytes image, int blocks=0):
        cdef int value = 0
        cdef char bus[32]
        cdef CUuuid uu
        self.backend = "cuda"
        self.ordinal = device
        self.block_threads = BLOCK_THREADS
        self._imported = {}
        self._read_lock = threading.Lock()
        if not load_driver():
            raise BackendError("no CUDA driver on this machine")
        check(API.cuDeviceGet(&self.cu_device, device), f"cuDeviceGet({device})")
        check(API.cuDevicePrimaryCtxRetain(&self.cu_ctx, self.cu_device), "cuDevicePrimaryCtxRetain")
        self.make_current()
        check(API.cuDeviceGetAttribute(&value, DFCCL_CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, self.cu_device),
              "cuDeviceGetAttribute(MULTIPROCESSOR_COUNT)")
        self.sm_count = value
        self.resident_blocks = value  # one daemon block per SM (__launch_bounds__(512, 1))
        check(API.cuDeviceGetAttribute(&value, DFCCL_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self.cu_device),
              "cuDeviceGetAttribute(COMPUTE_CAPABILITY_MAJOR)")
        self.compute_capability = value * 10
        check(API.cuDeviceGetAttribute(&value, DFCCL_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self.cu_device),
              "cuDeviceGetAttribute(COMPUTE_CAPABILITY_MINOR)")
        self.compute_capability += value
        check(API.cuDeviceGetPCIBusId(bus, 32, self.cu_device), "cuDeviceGetPCIBusId")
        self.pci_bus_id = bus.decode()
        check(API.cuDeviceGetUuid(&uu, self.cu_device), "cuDeviceGetUuid")
        self.uuid = uu.bytes[:16]
        # Channels: a quarter of the SMs, at most 32 (the daemon's limit).
        self.default_blocks = blocks if blocks > 0 else max(1, min(32, self.sm_count // 4))
        check(API.cuModuleLoadData(&self.module, <const char *>image), "cuModuleLoadData(daemon image)")
        check(API.cuModuleGetFunction(&self.daemon_fn, self.module, b"dfccl_daemon"), "cuModuleGetFunction(dfccl_daemon)")
        check(API.cuModuleGetFunction(&self.graph_arm_fn, self.module, b"dfccl_graph_arm_node"),
              "cuModuleGetFunction(dfccl_graph_arm_node)")
        check(API.cuStreamCreate(&self.stream, DFCCL_CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        check(API.cuStreamCreate(&self.setup_stream, DFCCL_CU_STREAM_NON_BLOCKING), "cuStreamCreate")

    cpdef make_current(self):
        check(API.cuCtxSetCurrent(self.cu_ctx), "cuCtxSetCurrent")

    cdef int launch(self, const dfccl_daemon_args *args) noexcept nogil:
        cdef void *params[1]
        cdef CUresult rc
        params[0] = <void *>args
        rc = API.cuCtxSetCurrent(self.cu_ctx)
        if rc != DFCCL_CUDA_SUCCESS:
            return rc
        # One block per channel, and the link block where the daemon has one.
        return API.cuLaunchKernel(self.daemon_fn, args.nblocks + (1 if args.link_block else 0), 1, 1, BLOCK_THREADS,
                                  1, 1, 0, self.stream, params, NULL)

    cdef int query_fault(self) noexcept nogil:
        # The daemon's stream reports the sticky error of a failed context
        # (a fault in any kernel of this process ends them all).
        cdef CUresult rc = API.cuCtxSetCurrent(self.cu_ctx)
        if rc == DFCCL_CUDA_SUCCESS and self.stream != NULL:
            rc = API.cuStreamQuery(self.stream)
        if rc == DFCCL_CUDA_SUCCESS or rc == DFCCL_CUDA_ERROR_NOT_READY:
            return 0
        if 900 <= <int>rc <= 910:
            return 0   # CUDA_ERROR_STREAM_CAPTURE_*: another thread's capture, not a failed device
        return <int>rc

    def fault_name(self, int code):
        return error_name(code)

    def launch_error(self, int code):
        return BackendError(f"cuLaunchKernel(dfccl_daemon) on device {self.ordinal} failed: {error_name(code)}",
                            driver_code=code)

    cdef int stream_write32(self, uint64_t stream, uint64_t addr, uint32_t value) except -1:
        self.make_current()
        check(API.cuStreamWriteValue32(<CUstream><uintptr_t>stream, <CUdeviceptr>addr, value,
                                       DFCCL_CU_STREAM_WRITE_VALUE_DEFAULT), "cuStreamWriteValue32")
        return 0

    cdef int stream_wait32(self, uint64_t stream, uint64_t addr, uint32_t value) except -1:
        self.make_current()
        check(API.cuStreamWaitValue32(<CUstream><uintptr_t>stream, <CUdeviceptr>addr, value,
                                      DFCCL_CU_STREAM_WAIT_VALUE_GEQ), "cuStreamWaitValue32")
        return 0

    cdef int try_stream_write32(self, uint64_t stream, uint64_t addr, uint32_t value) noexcept nogil:
        cdef CUresult rc = API.cuCtxSetCurrent(self.cu_ctx)
        if rc != DFCCL_CUDA_SUCCESS:
            return rc
        return API.cuStreamWriteValue32(<CUstream><uintptr_t>stream, <CUdeviceptr>addr, value,
                                        DFCCL_CU_STREAM_WRITE_VALUE_DEFAULT)

    cdef int try_stream_wait32(self, uint64_t stream, uint64_t addr, uint32_t value) noexcept nogil:
        cdef CUresult rc = API.cuCtxSetCurrent(self.cu_ctx)
        if rc != DFCCL_CUDA_SUCCESS:
            return rc
        return API.cuStreamWaitValue32(<CUstream><uintptr_t>stream, <CUdeviceptr>addr, value,
                                       DFCCL_CU_STREAM_WAIT_VALUE_GEQ)

    # -- CUDA graphs ---------------------------------------------------------
    cdef int stream_capturing(self, uint64_t stream) except -1:
        cdef int status = 0
        self.make_current()   # the legacy default stream (0) is the current context's
        check(API.cuStreamIsCapturing(<CUstream><uintptr_t>stream, &status), "cuStreamIsCapturing")
        return 0 if status == DFCCL_CU_STREAM_CAPTURE_STATUS_NONE else 1

    cdef int try_stream_capturing(self, uint64_t stream) noexcept nogil:
        cdef int status = 0
        if API.cuCtxSetCurrent(self.cu_ctx) != DFCCL_CUDA_SUCCESS:
            return -1
        if API.cuStreamIsCapturing(<CUstream><uintptr_t>stream, &status) != DFCCL_CUDA_SUCCESS:
            return -1
        return 0 if status == DFCCL_CU_STREAM_CAPTURE_STATUS_NONE else 1

    cdef int stream_wait_mask32(self, uint64_t stream, uint64_t addr, uint32_t mask) except -1:
        self.make_current()
        check(API.cuStreamWaitValue32(<CUstream><uintptr_t>stream, <CUdeviceptr>addr, mask,
                                      DFCCL_CU_STREAM_WAIT_VALUE_AND), "cuStreamWaitValue32(AND)")
        return 0

    cdef int stream_graph_arm(self, uint64_t stream, const dfccl_daemon_args *args, const dfccl_graph_arm *arm) except -1:
        # The kernel's parameters are copied into the captured node: bound at capture.
        cdef void *params[2]
        params[0] = <void *>args
        params[1] = <void *>arm
        self.make_current()
        check(API.cuLaunchKernel(self.graph_arm_fn, 1, 1, 1, 32, 1, 1, 0, <CUstream><uintptr_t>stream, params, NULL),
              "cuLaunchKernel(dfccl_graph_arm_node)")
        return 0

    cdef int retain_for_capture(self, uint64_t stream, uint32_t *released) except -1:
        cdef int status = 0
        cdef unsigned long long capture_id = 0
        cdef CUgraph graph = NULL
        cdef const CUgraphNode *deps = NULL
        cdef size_t ndeps = 0
        cdef CUuserObject obj = NULL
        self.make_current()
        check(API.cuStreamGetCaptureInfo(<CUstream><uintptr_t>stream, &status, &capture_id, &graph, &deps, &ndeps),
              "cuStreamGetCaptureInfo")
        if status == DFCCL_CU_STREAM_CAPTURE_STATUS_NONE or graph == NULL:
            raise InvalidArgumentError("retain_for_capture: the stream is not capturing")
        check(API.cuUserObjectCreate(&obj, <void *>released, _graph_destroyed, 1,
                                     DFCCL_CU_USER_OBJECT_NO_DESTRUCTOR_SYNC), "cuUserObjectCreate")
        # The graph takes our reference: the destructor runs once the graph and
        # every executable graph made from it are destroyed (and their launches done).
        check(API.cuGraphRetainUserObject(graph, obj, 1, DFCCL_CU_GRAPH_USER_OBJECT_MOVE), "cuGraphRetainUserObject")
        return 0

    # -- memory ------------------------------------------------------------
    def alloc_mapped(self, size_t nbytes):
        cdef void *host = NULL
        cdef CUdeviceptr dev = 0
        self.make_current()
        check(API.cuMemHostAlloc(&host, nbytes, DFCCL_CU_MEMHOSTALLOC_PORTABLE | DFCCL_CU_MEMHOSTALLOC_DEVICEMAP),
              f"cuMemHostAlloc({nbytes})")
        memset(host, 0, nbytes)
        check(API.cuMemHostGetDevicePointer(&dev, host, 0), "cuMemHostGetDevicePointer")
        return (<uint64_t><uintptr_t>host, <uint64_t>dev)

    def free_mapped(self, uint64_t host_ptr):
        self.make_current()
        check(API.cuMemFreeHost(<void *><uintptr_t>host_ptr), "cuMemFreeHost")

    def alloc_device(self, size_t nbytes, bint shareable=False, bint zeroed=True):
        cdef CUdeviceptr p = 0
        self.make_current()
        cdef CUresult rc
        check(API.cuMemAlloc(&p, nbytes), f"cuMemAlloc({nbytes})")
        if not zeroed:
            return <uint64_t>p
        # Zeroed on a private stream and waited for alone, without the GIL: a
        # context synchronise would wait for the running daemon, the legacy
        # stream for whatever the application queued there, and the private
        # stream too can wait behind an application stream (shared hardware
        # queues) for a collective that another thread's submission completes.
        with nogil:
            rc = API.cuMemsetD8Async(p, 0, nbytes, self.setup_stream)
            if rc == DFCCL_CUDA_SUCCESS:
                rc = API.cuStreamSynchronize(self.setup_stream)
        if rc != DFCCL_CUDA_SUCCESS:
            API.cuMemFree(p)
        check(rc, "cuMemsetD8Async + cuStreamSynchronize(setup stream)")
        return <uint64_t>p

    def free_device(self, uint64_t ptr):
        self.make_current()
        check(API.cuMemFree(<CUdeviceptr>ptr), "cuMemFree")

    # Host <-> device copies go through the private setup stream and wait for
    # it alone, without the GIL: on the legacy default stream (where torch
    # queues its work unless told otherwise) a copy would wait for whatever
    # the application queued there, such as a cuStreamWaitValue32 on a
    # collective's completion.  Even the private stream waits behind such a
    # wait when they share a hardware queue, so nothing on the way to a
    # collective or to an explanation uses these two: see stage_to_device
    # and read_device.
    def copy_to_device(self, uint64_t dst, uint64_t src_host, size_t nbytes):
        cdef CUresult rc, restored
        cdef int mode = DFCCL_CU_STREAM_CAPTURE_MODE_RELAXED
        with nogil:
            rc = API.cuCtxSetCurrent(self.cu_ctx)
            if rc == DFCCL_CUDA_SUCCESS:
                # In the relaxed capture mode: this thread may be capturing a
                # graph (an all-to-all's split table is written at capture),
                # and in the global mode (torch's) CUDA refuses a synchronous
                # copy, though this one touches no captured stream.
                rc = API.cuThreadExchangeStreamCaptureMode(&mode)
                if rc == DFCCL_CUDA_SUCCESS:
                    rc = API.cuMemcpyHtoDAsync(<CUdeviceptr>dst, <const void *><uintptr_t>src_host, nbytes,
                                               self.setup_stream)
                    if rc == DFCCL_CUDA_SUCCESS:
                        rc = API.cuStreamSynchronize(self.setup_stream)
                    restored = API.cuThreadExchangeStreamCaptureMode(&mode)
                    if rc == DFCCL_CUDA_SUCCESS:
                        rc = restored
        check(rc, "cuMemcpyHtoDAsync(setup stream)")

    def copy_from_device(self, uint64_t dst_host, uint64_t src, size_t nbytes):
        cdef CUresult rc
        with nogil:
            rc = API.cuCtxSetCurrent(self.cu_ctx)
            if rc == DFCCL_CUDA_SUCCESS:
                rc = API.cuMemcpyDtoHAsync(<void *><uintptr_t>dst_host, <CUdeviceptr>src, nbytes, self.setup_stream)
            if rc == DFCCL_CUDA_SUCCESS:
                rc = API.cuStreamSynchronize(self.setup_stream)
        check(rc, "cuMemcpyDtoHAsync(setup stream)")

    def stage_to_device(self, uint64_t dst, uint64_t src_host, size_t nbytes, stream):
        """The copy goes on ``stream`` (else the setup stream), which then
        arms the collective: the submitting thread does not wait for it, nor
        for whatever holds up that stream (an application stream waiting for
        an earlier collective, on a shared hardware queue, say).  A pageable
        source is staged by the driver before the call returns.  A stream
        that captures a graph gets no copy node (a replay must not copy
        again, and the source is gone by then): the copy is made now, and
        the capture goes on on that stream."""
        cdef CUstream s = self.setup_stream if stream is None else <CUstream><uintptr_t>stream
        if stream is not None and self.stream_capturing(<uint64_t>stream):
            self.copy_to_device(dst, src_host, nbytes)
            return stream
        self.make_current()
        check(API.cuMemcpyHtoDAsync(<CUdeviceptr>dst, <const void *><uintptr_t>src_host, nbytes, s),
              "cuMemcpyHtoDAsync")
        return <uint64_t><uintptr_t>s

    def read_device(self, uint64_t dst_host, uint64_t src, size_t nbytes, double timeout):
        """copy_from_device with a deadline, for explanations (a timeout's
        message, status()): even the private stream can be held up, when it
        shares a hardware queue with an application stream that waits for a
        collective (CUDA_DEVICE_MAX_CONNECTIONS=1, MPS), and an explanation
        must not wait for the collective it explains.  Raises BackendError
        after ``timeout`` seconds; the copy then lands in a bounce buffer
        that later reads skip until the stream has drained.

        Every driver call here is made without the GIL: a driver call can
        itself block while another thread's kernel launch waits for the
        device to drain (a kernel's first launch does), and the thread
        whose submission would let it drain may need the GIL."""
        cdef CUresult rc = DFCCL_CUDA_SUCCESS
        cdef void *fresh = NULL
        cdef uint64_t deadline
        cdef size_t size = nbytes if nbytes > 4096 else 4096
        cdef bint grow, was_pending
        cdef int failed = 0   # 1: an earlier read still queued, 2: over the deadline
        cdef const char *what = NULL
        with self._read_lock:
            was_pending = self._bounce_pending
            grow = nbytes > self._bounce_bytes
            with nogil:
                rc = API.cuCtxSetCurrent(self.cu_ctx)
                what = "cuCtxSetCurrent"
                if rc == DFCCL_CUDA_SUCCESS and was_pending:
                    rc = API.cuStreamQuery(self.setup_stream)
                    what = "cuStreamQuery(setup stream)"
                    if rc == DFCCL_CUDA_ERROR_NOT_READY:
                        failed = 1
                    elif rc == DFCCL_CUDA_SUCCESS:
                        self._bounce_pending = False   # the late copy has landed
                if rc == DFCCL_CUDA_SUCCESS and grow:
                    rc = API.cuMemHostAlloc(&fresh, size, 0)
                    what = "cuMemHostAlloc(bounce)"
                    if rc == DFCCL_CUDA_SUCCESS:
                        if self._bounce != NULL:
                            API.cuMemFreeHost(self._bounce)
                        self._bounce = fresh
                        self._bounce_bytes = size
                if rc == DFCCL_CUDA_SUCCESS:
                    rc = API.cuMemcpyDtoHAsync(self._bounce, <CUdeviceptr>src, nbytes, self.setup_stream)
                    what = "cuMemcpyDtoHAsync(setup stream)"
                if rc == DFCCL_CUDA_SUCCESS:
                    what = "cuStreamQuery(setup stream)"
                    deadline = dfccl_now_ns() + <uint64_t>(timeout * 1e9)
                    while True:
                        rc = API.cuStreamQuery(self.setup_stream)
                        if rc != DFCCL_CUDA_ERROR_NOT_READY or dfccl_now_ns() > deadline:
                            break
                        dfccl_sleep_ns(20000)
                    if rc == DFCCL_CUDA_ERROR_NOT_READY:
                        failed = 2
                if rc == DFCCL_CUDA_SUCCESS:
                    memcpy(<void *><uintptr_t>dst_host, self._bounce, nbytes)
            if failed == 1:
                raise BackendError(f"device {self.ordinal}: an earlier read of device memory is still queued behind "
                                   "an application stream that waits for a collective")
            if failed == 2:
                self._bounce_pending = True
                raise BackendError(f"device {self.ordinal}: reading device memory took over {timeout:g} s (the copy "
                                   "is queued behind an application stream that waits for a collective)")
            check(rc, what.decode())

    def export_memory(self, uint64_t ptr):
        cdef CUipcMemHandle h
        self.make_current()
        check(API.cuIpcGetMemHandle(&h, <CUdeviceptr>ptr), "cuIpcGetMemHandle")
        return {"via": "cuda-ipc", "handle": (<bytes>h.reserved[:64]).hex(), "uuid": self.uuid.hex()}

    def import_memory(self, desc):
        cdef CUipcMemHandle h
        cdef CUdeviceptr p = 0
        if desc.get("via") != "cuda-ipc":
            raise InvalidArgumentError(f"cuda backend cannot map memory exported via {desc.get('via')!r}")
        raw = bytes.fromhex(desc["handle"])
        memcpy(h.reserved, <const char *>raw, 64)
        self.make_current()
        check(API.cuIpcOpenMemHandle(&p, h, DFCCL_CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS), "cuIpcOpenMemHandle")
        self._imported[<uint64_t>p] = True
        return <uint64_t>p

    def release_import(self, uint64_t ptr):
        if self._imported.pop(ptr, None):
            self.make_current()
            check(API.cuIpcCloseMemHandle(<CUdeviceptr>ptr), "cuIpcCloseMemHandle")

    # -- peers -------------------------------------------------------------
    def can_access(self, Device other):
        cdef int ok = 0, atomics = 0
        cdef CudaDevice o
        if not isinstance(other, CudaDevice):
            return False
        o = <CudaDevice>other
        if o.cu_device == self.cu_device:
            return True
        check(API.cuDeviceCanAccessPeer(&ok, self.cu_device, o.cu_device), "cuDeviceCanAccessPeer")
        if not ok:
            return False
        # The direct path adds into peers' counters: it needs native P2P atomics.
        check(API.cuDeviceGetP2PAttribute(&atomics, DFCCL_CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED,
                                          self.cu_device, o.cu_device), "cuDeviceGetP2PAttribute")
        return atomics != 0

    def enable_access(self, Device other):
        cdef CudaDevice o = <CudaDevice>other
        cdef CUresult rc
        if o.cu_device == self.cu_device:
            return
        self.make_current()
        rc = API.cuCtxEnablePeerAccess(o.cu_ctx, 0)
        if rc != DFCCL_CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED:
            check(rc, f"cuCtxEnablePeerAccess({self.ordinal} -> {o.ordinal})")

    # -- daemon ------------------------------------------------------------
    def synchronize(self):
        cdef CUresult rc
        self.make_current()
        with nogil:
            rc = API.cuStreamSynchronize(self.stream)
        check(rc, "cuStreamSynchronize(daemon stream)")

    def busy(self):
        cdef CUresult rc = API.cuStreamQuery(self.stream)
        if rc == DFCCL_CUDA_ERROR_NOT_READY:
            return True
        check(rc, "cuStreamQuery(daemon stream)")
        return False

    def context_synchronize(self):
        """cuCtxSynchronize on this device (waits for every stream)."""
        cdef CUresult rc
        self.make_current()
        with nogil:
            rc = API.cuCtxSynchronize()
        check(rc, "cuCtxSynchronize")

    def forget_after_fork(self):
        # No CUDA call is valid in a forked child: close() must make none.
        self._bounce = NULL
        self.stream = NULL
        self.setup_stream = NULL
        self.module = NULL
        self.cu_ctx = NULL
        self._imported = {}
        self._read_lock = threading.Lock()

    def close(self):
        if self._bounce != NULL and not self._bounce_pending:
            self.make_current()
            API.cuMemFreeHost(self._bounce)
            self._bounce = NULL
        if self.stream != NULL:
            self.make_current()
            API.cuStreamDestroy(self.stream)
            API.cuStreamDestroy(self.setup_stream)
            self.stream = NULL
        if self.module != NULL:
            API.cuModuleUnload(self.module)
            self.module = NULL
        if self.cu_ctx != NULL:
            API.cuDevicePrimaryCtxRelease(self.cu_device)
            self.cu_ctx = NULL
