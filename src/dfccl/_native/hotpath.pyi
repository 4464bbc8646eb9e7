# The host hot path is C only (hotpath.pxd): Daemon calls it from Python,
# the C API (capi.pyi, cuda/include/dfccl/dfccl_api.h) from C.
