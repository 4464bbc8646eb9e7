# A daemon's memory layout (daemon_memory.pyx).
from libc.stdint cimport uint64_t
from dfccl._native.core cimport daemon_core
from dfccl._native.device cimport Device


cdef struct daemon_memory:
    uint64_t mapped_host          # host-mapped words (host address)
    uint64_t mapped_dev           # the same, as the device sees them
    uint64_t device_mem           # the daemon's device memory
    uint64_t endpoints_dev        # its endpoint table in it


cdef int lay_out(daemon_core *c, Device device, int slots, int blocks, int max_endpoints,
                 daemon_memory *out) except -1
