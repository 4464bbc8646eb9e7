/* The CUDA driver entry points the CUDA backend calls, as a table of function
 * pointers resolved at run time with cuda-python's cuGetProcAddress (see
 * src/dfccl/_native/cuda_backend.pyx).  Only the stable ABI types are declared
 * here, so the backend builds without cuda.h and without coupling to the
 * version of cuda.bindings' declarations. */
#ifndef DFCCL_CUDA_DRIVER_H
#define DFCCL_CUDA_DRIVER_H

#include <stddef.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef struct CUstream_st *CUstream;
typedef struct CUgraph_st *CUgraph;
typedef struct CUgraphNode_st *CUgraphNode;
typedef struct CUuserObject_st *CUuserObject;
typedef void (*CUhostFn)(void *);
typedef unsigned long long CUdeviceptr;
typedef struct { char reserved[64]; } CUipcMemHandle;
typedef struct { char bytes[16]; } CUuuid;

/* Values from cuda.h (part of the driver ABI). */
enum {
  DFCCL_CUDA_SUCCESS = 0,
  DFCCL_CUDA_ERROR_NOT_READY = 600,
  DFCCL_CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704,
  DFCCL_CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16,
  DFCCL_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75,
  DFCCL_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76,
  DFCCL_CU_MEMHOSTALLOC_PORTABLE = 1,
  DFCCL_CU_MEMHOSTALLOC_DEVICEMAP = 2,
  DFCCL_CU_STREAM_NON_BLOCKING = 1,
  DFCCL_CU_STREAM_WAIT_VALUE_GEQ = 0,
  DFCCL_CU_STREAM_WAIT_VALUE_AND = 2,
  DFCCL_CU_STREAM_CAPTURE_STATUS_NONE = 0,
  DFCCL_CU_STREAM_CAPTURE_MODE_RELAXED = 2,
  DFCCL_CU_USER_OBJECT_NO_DESTRUCTOR_SYNC = 1,
  DFCCL_CU_GRAPH_USER_OBJECT_MOVE = 1,
  DFCCL_CU_STREAM_WRITE_VALUE_DEFAULT = 0,
  DFCCL_CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1,
  DFCCL_CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2,
  DFCCL_CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9,
  DFCCL_CU_MEMORYTYPE_DEVICE = 2,
  DFCCL_CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED = 3
};

/* The driver version whose ABI these signatures follow (cuGetProcAddress). */
#define DFCCL_CUDA_API_VERSION 12000

typedef struct dfccl_cuda_api {
  CUresult (*cuGetErrorName)(CUresult, const char **);
  CUresult (*cuInit)(unsigned int);
  CUresult (*cuDeviceGet)(CUdevice *, int);
  CUresult (*cuDeviceGetCount)(int *);
  CUresult (*cuDeviceGetAttribute)(int *, int, CUdevice);
  CUresult (*cuDeviceGetPCIBusId)(char *, int, CUdevice);
  CUresult (*cuDeviceGetUuid)(CUuuid *, CUdevice);
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext *, CUdevice);
  CUresult (*cuDevicePrimaryCtxRelease)(CUdevice);
  CUresult (*cuCtxSetCurrent)(CUcontext);
  CUresult (*cuCtxSynchronize)(void);
  CUresult (*cuCtxEnablePeerAccess)(CUcontext, unsigned int);
  CUresult (*cuDeviceCanAccessPeer)(int *, CUdevice, CUdevice);
  CUresult (*cuDeviceGetP2PAttribute)(int *, int, CUdevice, CUdevice);
  CUresult (*cuModuleLoadData)(CUmodule *, const void *);
  CUresult (*cuModuleUnload)(CUmodule);
  CUresult (*cuModuleGetFunction)(CUfunction *, CUmodule, const char *);
  CUresult (*cuStreamCreate)(CUstream *, unsigned int);
  CUresult (*cuStreamDestroy)(CUstream);
  CUresult (*cuStreamQuery)(CUstream);
  CUresult (*cuStreamSynchronize)(CUstream);
  CUresult (*cuStreamWriteValue32)(CUstream, CUdeviceptr, unsigned int, unsigned int);
  CUresult (*cuStreamWaitValue32)(CUstream, CUdeviceptr, unsigned int, unsigned int);
  CUresult (*cuMemAlloc)(CUdeviceptr *, size_t);
  CUresult (*cuMemFree)(CUdeviceptr);
  CUresult (*cuMemsetD8Async)(CUdeviceptr, unsigned char, size_t, CUstream);
  CUresult (*cuMemcpyHtoDAsync)(CUdeviceptr, const void *, size_t, CUstream);
  CUresult (*cuMemcpyDtoHAsync)(void *, CUdeviceptr, size_t, CUstream);
  CUresult (*cuMemHostAlloc)(void **, size_t, unsigned int);
  CUresult (*cuMemFreeHost)(void *);
  CUresult (*cuMemHostGetDevicePointer)(CUdeviceptr *, void *, unsigned int);
  CUresult (*cuPointerGetAttributes)(unsigned int, int *, void **, CUdeviceptr);
  CUresult (*cuIpcGetMemHandle)(CUipcMemHandle *, CUdeviceptr);
  CUresult (*cuIpcOpenMemHandle)(CUdeviceptr *, CUipcMemHandle, unsigned int);
  CUresult (*cuIpcCloseMemHandle)(CUdeviceptr);
  CUresult (*cuLaunchKernel)(CUfunction, unsigned int, unsigned int, unsigned int, unsigned int, unsigned int,
                             unsigned int, unsigned int, CUstream, void **, void **);
  /* CUDA graphs: a capture's state and graph, a user object that tells
     when the graph is destroyed, and this thread's capture mode (dfccl's
     own copies are made in the relaxed mode while an application captures) */
  CUresult (*cuStreamIsCapturing)(CUstream, int *);
  CUresult (*cuStreamGetCaptureInfo)(CUstream, int *, unsigned long long *, CUgraph *, const CUgraphNode **,
                                     size_t *);
  CUresult (*cuUserObjectCreate)(CUuserObject *, void *, CUhostFn, unsigned int, unsigned int);
  CUresult (*cuGraphRetainUserObject)(CUgraph, CUuserObject, unsigned int, unsigned int);
  CUresult (*cuThreadExchangeStreamCaptureMode)(int *);
} dfccl_cuda_api;

#define DFCCL_API_ENTRY(name) { #name, offsetof(dfccl_cuda_api, name) }
static const struct { const char *name; size_t offset; } dfccl_cuda_api_entries[] = {
  DFCCL_API_ENTRY(cuGetErrorName), DFCCL_API_ENTRY(cuInit), DFCCL_API_ENTRY(cuDeviceGet),
  DFCCL_API_ENTRY(cuDeviceGetCount), DFCCL_API_ENTRY(cuDeviceGetAttribute), DFCCL_API_ENTRY(cuDeviceGetPCIBusId),
  DFCCL_API_ENTRY(cuDeviceGetUuid), DFCCL_API_ENTRY(cuDevicePrimaryCtxRetain),
  DFCCL_API_ENTRY(cuDevicePrimaryCtxRelease), DFCCL_API_ENTRY(cuCtxSetCurrent), DFCCL_API_ENTRY(cuCtxSynchronize),
  DFCCL_API_ENTRY(cuCtxEnablePeerAccess), DFCCL_API_ENTRY(cuDeviceCanAccessPeer),
  DFCCL_API_ENTRY(cuDeviceGetP2PAttribute), DFCCL_API_ENTRY(cuModuleLoadData), DFCCL_API_ENTRY(cuModuleUnload),
  DFCCL_API_ENTRY(cuModuleGetFunction), DFCCL_API_ENTRY(cuStreamCreate), DFCCL_API_ENTRY(cuStreamDestroy),
  DFCCL_API_ENTRY(cuStreamQuery), DFCCL_API_ENTRY(cuStreamSynchronize), DFCCL_API_ENTRY(cuStreamWriteValue32),
  DFCCL_API_ENTRY(cuStreamWaitValue32), DFCCL_API_ENTRY(cuMemAlloc), DFCCL_API_ENTRY(cuMemFree),
  DFCCL_API_ENTRY(cuMemsetD8Async), DFCCL_API_ENTRY(cuMemcpyHtoDAsync), DFCCL_API_ENTRY(cuMemcpyDtoHAsync), DFCCL_API_ENTRY(cuMemHostAlloc),
  DFCCL_API_ENTRY(cuMemFreeHost), DFCCL_API_ENTRY(cuMemHostGetDevicePointer), DFCCL_API_ENTRY(cuPointerGetAttributes),
  DFCCL_API_ENTRY(cuIpcGetMemHandle), DFCCL_API_ENTRY(cuIpcOpenMemHandle), DFCCL_API_ENTRY(cuIpcCloseMemHandle),
  DFCCL_API_ENTRY(cuLaunchKernel), DFCCL_API_ENTRY(cuStreamIsCapturing), DFCCL_API_ENTRY(cuStreamGetCaptureInfo),
  DFCCL_API_ENTRY(cuUserObjectCreate), DFCCL_API_ENTRY(cuGraphRetainUserObject),
  DFCCL_API_ENTRY(cuThreadExchangeStreamCaptureMode),
};
#undef DFCCL_API_ENTRY

static inline int dfccl_cuda_api_count(void) {
  return (int)(sizeof(dfccl_cuda_api_entries) / sizeof(dfccl_cuda_api_entries[0]));
}
static inline const char *dfccl_cuda_api_name(int i) { return dfccl_cuda_api_entries[i].name; }
static inline void dfccl_cuda_api_set(dfccl_cuda_api *api, int i, void *fn) {
  memcpy((char *)api + dfccl_cuda_api_entries[i].offset, &fn, sizeof fn);
}
static inline int dfccl_cuda_api_complete(const dfccl_cuda_api *api) {
  for (int i = 0; i < dfccl_cuda_api_count(); ++i) {
    void *fn;
    memcpy(&fn, (const char *)api + dfccl_cuda_api_entries[i].offset, sizeof fn);
    if (fn == NULL) return 0;
  }
  return 1;
}

#endif
