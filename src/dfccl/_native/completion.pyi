# A collective's completion is C only (completion.pxd): Daemon and retire.pyx
# call it from Cython, the C API (capi.pyi, cuda/include/dfccl/dfccl_api.h)
# from C.
