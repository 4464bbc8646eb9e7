# Retirement and the watcher (retire.pyx).
from libc.stdint cimport uint32_t
from dfccl._native.core cimport daemon_core
from dfccl._native.work cimport Work

cdef void lock_gil(daemon_core *c) noexcept
cdef int retire_work(daemon_core *c, object policy, uint32_t s, uint32_t gen) except -1
cdef int retire_completed(daemon_core *c, object policy, bint due_only) except -1
cdef int adapt_policy(daemon_core *c, object policy) except -1
cdef list fail_unretired(daemon_core *c, object err, bint completed_too)
cdef bint abandon_work(daemon_core *c, Work work) except -1
cdef int abandon_handles(daemon_core *c, uint32_t endpoint) noexcept nogil
cdef void run_callbacks(Work work)
cdef list close_slots(daemon_core *c, bint daemon_exited)
cdef int watch(daemon_core *c) noexcept nogil
