# The host hot path's submission is C only (hotpath.pxd): Daemon calls it
# from Cython, the C API (capi.pyi, cuda/include/dfccl/dfccl_api.h) from C.
