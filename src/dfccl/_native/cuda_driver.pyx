# cython: language_level=3
"""The CUDA driver's entry points, resolved once from cuda-python
(cuda.bindings.driver.cuGetProcAddress) into a C table
(cuda/include/dfccl/cuda_driver.h) that the hot paths call without the GIL,
and the process-wide driver calls that need no device: the device count,
the pointer query, the thread's capture mode.  Every call is checked; a
failure raises BackendError naming the call and the CUresult."""

from libc.stdint cimport uint64_t, uintptr_t

from dfccl.errors import BackendError

__all__ = ["load_driver", "device_count", "relax_thread_capture_mode", "pointer_device"]


cdef dfccl_cuda_api API
cdef bint _api_loaded = False


def load_driver():
    """Resolves the driver entry points; returns False where there is no
    driver (no GPU machine)."""
    global _api_loaded
    if _api_loaded:
        return True
    try:
        from cuda.bindings import driver
        err, = driver.cuInit(0)
        if err != driver.CUresult.CUDA_SUCCESS:
            return False
        flags = driver.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT
        for i in range(dfccl_cuda_api_count()):
            name = dfccl_cuda_api_name(i)
            err, pfn, status = driver.cuGetProcAddress(name, DFCCL_CUDA_API_VERSION, flags)
            if err != driver.CUresult.CUDA_SUCCESS or not pfn:
                raise BackendError(f"the CUDA driver has no {name.decode()} ({err}, {status})")
            dfccl_cuda_api_set(&API, i, <void *><uintptr_t>int(pfn))
    except BackendError:
        raise
    except Exception:
        return False  # no driver library on this machine
    if not dfccl_cuda_api_complete(&API):
        raise BackendError("could not resolve every CUDA driver entry point")
    _api_loaded = True
    return True


cdef str error_name(CUresult rc):
    cdef const char *name = NULL
    if _api_loaded and API.cuGetErrorName(rc, &name) == DFCCL_CUDA_SUCCESS and name != NULL:
        return name.decode()
    return f"CUresult {rc}"


cdef int check(CUresult rc, str what) except -1:
    if rc != DFCCL_CUDA_SUCCESS:
        raise BackendError(f"{what} failed: {error_name(rc)}", driver_code=rc)
    return 0


def device_count():
    """CUDA devices visible to this process (0 when there is no driver)."""
    cdef int n = 0
    if not load_driver():
        return 0
    if API.cuDeviceGetCount(&n) != DFCCL_CUDA_SUCCESS:
        return 0
    return n


def relax_thread_capture_mode():
    """Puts the calling thread in CUDA's relaxed stream-capture mode for
    good.  For dfccl's own threads (the watcher, the progress thread, the
    liveness monitor): in the global mode, torch's default, a call CUDA
    deems unsafe (a query, a copy) from any thread while another thread
    captures a graph invalidates that capture; the relaxed mode exempts
    this thread's calls, none of which touches a capturing stream.  Does
    nothing where there is no driver."""
    cdef int mode = DFCCL_CU_STREAM_CAPTURE_MODE_RELAXED
    cdef CUresult rc
    if not _api_loaded:
        return
    with nogil:
        rc = API.cuThreadExchangeStreamCaptureMode(&mode)
    check(rc, "cuThreadExchangeStreamCaptureMode(relaxed)")


def pointer_device(uint64_t ptr):
    """CUDA ordinal owning the device memory at ``ptr``; None for host memory or
    an unknown pointer.  One driver call (the plain call makes it for every
    collective): cuPointerGetAttributes reports an unknown pointer as memory
    type 0 instead of failing."""
    cdef unsigned int memtype = 0
    cdef int ordinal = -1
    cdef int attrs[2]
    cdef void *data[2]
    if not _api_loaded:
        return None
    attrs[0] = DFCCL_CU_POINTER_ATTRIBUTE_MEMORY_TYPE
    attrs[1] = DFCCL_CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
    data[0] = &memtype
    data[1] = &ordinal
    if API.cuPointerGetAttributes(2, attrs, data, <CUdeviceptr>ptr) != DFCCL_CUDA_SUCCESS:
        return None
    if memtype != <unsigned int>DFCCL_CU_MEMORYTYPE_DEVICE or ordinal < 0:
        return None
    return ordinal


cdef dfccl_cuda_api *driver_api() noexcept nogil:
    return &API
