# cython: language_level=3
# The CUDA driver's ABI as dfccl declares it (cuda/include/dfccl/cuda_driver.h)
# and the one table of entry points every CUDA module calls through.

cdef extern from "dfccl/cuda_driver.h":
    ctypedef int CUresult
    ctypedef int CUdevice
    ctypedef struct CUctx_st
    ctypedef struct CUmod_st
    ctypedef struct CUfunc_st
    ctypedef struct CUstream_st
    ctypedef CUctx_st *CUcontext
    ctypedef CUmod_st *CUmodule
    ctypedef CUfunc_st *CUfunction
    ctypedef CUstream_st *CUstream
    ctypedef struct CUgraph_st
    ctypedef struct CUgraphNode_st
    ctypedef struct CUuserObject_st
    ctypedef CUgraph_st *CUgraph
    ctypedef CUgraphNode_st *CUgraphNode
    ctypedef CUuserObject_st *CUuserObject
    ctypedef void (*CUhostFn)(void *) noexcept nogil
    ctypedef unsigned long long CUdeviceptr
    ctypedef struct CUipcMemHandle:
        char reserved[64]
    ctypedef struct CUuuid:
        char bytes[16]

    int DFCCL_CUDA_SUCCESS, DFCCL_CUDA_ERROR_NOT_READY, DFCCL_CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
    int DFCCL_CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
    int DFCCL_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, DFCCL_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR
    int DFCCL_CU_MEMHOSTALLOC_PORTABLE, DFCCL_CU_MEMHOSTALLOC_DEVICEMAP
    int DFCCL_CU_STREAM_NON_BLOCKING, DFCCL_CU_STREAM_WAIT_VALUE_GEQ, DFCCL_CU_STREAM_WRITE_VALUE_DEFAULT
    int DFCCL_CU_STREAM_WAIT_VALUE_AND, DFCCL_CU_STREAM_CAPTURE_STATUS_NONE, DFCCL_CU_STREAM_CAPTURE_MODE_RELAXED
    int DFCCL_CU_USER_OBJECT_NO_DESTRUCTOR_SYNC, DFCCL_CU_GRAPH_USER_OBJECT_MOVE
    int DFCCL_CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
    int DFCCL_CU_POINTER_ATTRIBUTE_MEMORY_TYPE, DFCCL_CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, DFCCL_CU_MEMORYTYPE_DEVICE
    int DFCCL_CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED
    int DFCCL_CUDA_API_VERSION

    ctypedef struct dfccl_cuda_api:
        CUresult (*cuGetErrorName)(CUresult, const char **) nogil
        CUresult (*cuInit)(unsigned int) nogil
        CUresult (*cuDeviceGet)(CUdevice *, int) nogil
        CUresult (*cuDeviceGetCount)(int *) nogil
        CUresult (*cuDeviceGetAttribute)(int *, int, CUdevice) nogil
        CUresult (*cuDeviceGetPCIBusId)(char *, int, CUdevice) nogil
        CUresult (*cuDeviceGetUuid)(CUuuid *, CUdevice) nogil
        CUresult (*cuDevicePrimaryCtxRetain)(CUcontext *, CUdevice) nogil
        CUresult (*cuDevicePrimaryCtxRelease)(CUdevice) nogil
        CUresult (*cuCtxSetCurrent)(CUcontext) nogil
        CUresult (*cuCtxSynchronize)() nogil
        CUresult (*cuCtxEnablePeerAccess)(CUcontext, unsigned int) nogil
        CUresult (*cuDeviceCanAccessPeer)(int *, CUdevice, CUdevice) nogil
        CUresult (*cuDeviceGetP2PAttribute)(int *, int, CUdevice, CUdevice) nogil
        CUresult (*cuModuleLoadData)(CUmodule *, const void *) nogil
        CUresult (*cuModuleUnload)(CUmodule) nogil
        CUresult (*cuModuleGetFunction)(CUfunction *, CUmodule, const char *) nogil
        CUresult (*cuStreamCreate)(CUstream *, unsigned int) nogil
        CUresult (*cuStreamDestroy)(CUstream) nogil
        CUresult (*cuStreamQuery)(CUstream) nogil
        CUresult (*cuStreamSynchronize)(CUstream) nogil
        CUresult (*cuStreamWriteValue32)(CUstream, CUdeviceptr, unsigned int, unsigned int) nogil
        CUresult (*cuStreamWaitValue32)(CUstream, CUdeviceptr, unsigned int, unsigned int) nogil
        CUresult (*cuMemAlloc)(CUdeviceptr *, size_t) nogil
        CUresult (*cuMemFree)(CUdeviceptr) nogil
        CUresult (*cuMemsetD8Async)(CUdeviceptr, unsigned char, size_t, CUstream) nogil
        CUresult (*cuMemcpyHtoDAsync)(CUdeviceptr, const void *, size_t, CUstream) nogil
        CUresult (*cuMemcpyDtoHAsync)(void *, CUdeviceptr, size_t, CUstream) nogil
        CUresult (*cuMemHostAlloc)(void **, size_t, unsigned int) nogil
        CUresult (*cuMemFreeHost)(void *) nogil
        CUresult (*cuMemHostGetDevicePointer)(CUdeviceptr *, void *, unsigned int) nogil
        CUresult (*cuPointerGetAttributes)(unsigned int, int *, void **, CUdeviceptr) nogil
        CUresult (*cuIpcGetMemHandle)(CUipcMemHandle *, CUdeviceptr) nogil
        CUresult (*cuIpcOpenMemHandle)(CUdeviceptr *, CUipcMemHandle, unsigned int) nogil
        CUresult (*cuIpcCloseMemHandle)(CUdeviceptr) nogil
        CUresult (*cuLaunchKernel)(CUfunction, unsigned int, unsigned int, unsigned int, unsigned int,
                                   unsigned int, unsigned int, unsigned int, CUstream, void **, void **) nogil
        CUresult (*cuStreamIsCapturing)(CUstream, int *) nogil
        CUresult (*cuStreamGetCaptureInfo)(CUstream, int *, unsigned long long *, CUgraph *, const CUgraphNode **,
                                           size_t *) nogil
        CUresult (*cuUserObjectCreate)(CUuserObject *, void *, CUhostFn, unsigned int, unsigned int) nogil
        CUresult (*cuGraphRetainUserObject)(CUgraph, CUuserObject, unsigned int, unsigned int) nogil
        CUresult (*cuThreadExchangeStreamCaptureMode)(int *) nogil

    int dfccl_cuda_api_count()
    const char *dfccl_cuda_api_name(int i)
    void dfccl_cuda_api_set(dfccl_cuda_api *api, int i, void *fn)
    int dfccl_cuda_api_complete(const dfccl_cuda_api *api)


# The table load_driver() fills (cuda_driver.pyx); valid for the process's life.
cdef dfccl_cuda_api *driver_api() noexcept nogil
cdef str error_name(CUresult rc)
# Raises BackendError naming `what` and the CUresult unless rc is CUDA_SUCCESS.
cdef int check(CUresult rc, str what) except -1
