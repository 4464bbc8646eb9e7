# What a daemon shows (inspection.pyx): the base of Daemon, holding its C
# state; read-only views of it and of the daemon's.
from dfccl._native.abi cimport dfccl_daemon_state
from dfccl._native.device cimport Device
from dfccl._native.core cimport daemon_core


cdef class DaemonBase:
    cdef daemon_core *c
    cdef readonly Device device
    cdef dfccl_daemon_state *_copy_daemon_state(self) except NULL
