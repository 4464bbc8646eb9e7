# What a context shows (inspection.pyx): the base of Context, holding its C
# state; read-only views of it and of the daemon's.
from dfccl._native.abi cimport dfccl_daemon_state
from dfccl._native.backend cimport Backend
from dfccl._native.core cimport ctx_core


cdef class ContextBase:
    cdef ctx_core *c
    cdef readonly Backend backend
    cdef dfccl_daemon_state *_copy_daemon_state(self) except NULL
