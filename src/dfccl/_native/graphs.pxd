# A daemon's collectives captured in CUDA graphs (graphs.pyx): a part of
# Daemon that owns what each captured collective holds.
from libc.stdint cimport uint32_t, uint64_t
from dfccl._native.core cimport daemon_core
from dfccl._native.descriptor cimport TaskDescriptor
from dfccl._native.device cimport Device


cdef class GraphCaptures:
    cdef daemon_core *c           # a reference (launch.pxd, core_incref)
    cdef Device device
    cdef object policy
    cdef dict _nodes              # slot -> CapturedNode, while its graph lives
    cdef list _errors             # (endpoint, error) of failed replays seen and not raised yet
    cdef object _lock             # guards _errors and each node's failure: several threads scan
    cdef uint64_t _bindings       # captures so far: each binds a slot under a new number

    cdef object bind(self, TaskDescriptor task, uint64_t send_addr, uint64_t recv_addr, uint64_t stream,
                     object owners)
    cdef uint32_t _take_slot(self) except? 0xffffffff
    cdef void _free_slot(self, uint32_t slot)


cdef GraphCaptures new_graph_captures(daemon_core *c, Device device, object policy)
