# cython: language_level=3
"""A daemon's memory layout: the words the host and the daemon share
(host-mapped: control, submission ring, completion words, results, waiting
words, endpoint abort flags) and the daemon's device memory (its state,
per-slot task contexts and words, the device ring, captured collectives'
descriptors, abort flags, endpoints).  lay_out allocates both and points
the daemon's C state and launch arguments into them; Daemon frees them
when it closes."""

from libc.stdint cimport uint32_t, uint64_t, uintptr_t

from dfccl._native.abi cimport *
from dfccl._native.core cimport daemon_core
from dfccl._native.device cimport Device

__all__ = []   # C only (daemon_memory.pxd)


cdef inline uint64_t _align(uint64_t x, uint64_t a):
    return (x + a - 1) // a * a


cdef int lay_out(daemon_core *c, Device device, int slots, int blocks, int max_endpoints,
                 daemon_memory *out) except -1:
    """Allocates the daemon's memory for ``slots`` slots, ``blocks`` blocks
    and ``max_endpoints`` endpoints, and points ``c`` (its words, its
    launch arguments) into it; ``out`` takes the allocations."""
    cdef uint64_t off, size
    # Host-mapped words: control | ring | done | results | waiting | endpoint_abort
    # The ring has twice as many entries as there are slots: an entry is
    # rewritten only once the daemon's host link has copied it, and the
    # link copies only as far as every block has pulled (link.cuh).
    c.ring_size = 2 * slots
    abort_words = _align(max_endpoints, 4)  # the link copies 16 bytes at a time
    off = _align(sizeof(dfccl_control), 256)
    ring_off = off
    off = _align(off + c.ring_size * sizeof(dfccl_sqe), 256)
    done_off = off
    off = _align(off + slots * 4, 256)
    results_off = off
    off = _align(off + slots * sizeof(dfccl_result), 256)
    host_waiting_off = off
    off = _align(off + slots * 4, 256)
    abort_off = off
    size = _align(off + abort_words * 4, 4096)
    host, dev = device.alloc_mapped(size)
    out.mapped_host = host
    out.mapped_dev = dev
    c.ctrl = <dfccl_control *><uintptr_t>host
    c.ring = <dfccl_sqe *><uintptr_t>(host + ring_off)
    c.done = <uint32_t *><uintptr_t>(host + done_off)
    c.results = <dfccl_result *><uintptr_t>(host + results_off)
    c.ep_abort = <uint32_t *><uintptr_t>(host + abort_off)
    c.waiting = <uint32_t *><uintptr_t>(host + host_waiting_off)
    c.done_dev = dev + done_off

    # Device memory: state | ctx[slot][block] | active[block][slot] | per-slot words | device ring |
    # abort flags | endpoints
    off = _align(sizeof(dfccl_daemon_state), 256)
    ctx_off = off
    off = _align(off + <uint64_t>slots * blocks * sizeof(dfccl_task_ctx), 256)
    active_off = off
    off = _align(off + <uint64_t>blocks * slots * 4, 256)
    counter_off = off
    off = _align(off + slots * 4, 256)
    error_off = off
    off = _align(off + slots * 4, 256)
    armed_off = off
    off = _align(off + slots * 4, 256)
    dev_ring_off = off
    off = _align(off + c.ring_size * sizeof(dfccl_task_desc), 256)
    graph_desc_off = off
    off = _align(off + slots * sizeof(dfccl_task_desc), 256)
    graph_count_off = off
    off = _align(off + slots * 8, 256)
    graph_mask_off = off
    off = _align(off + (slots + 31) // 32 * 4, 256)
    abort_dev_off = off
    off = _align(off + abort_words * 4, 256)
    ep_off = off
    size = _align(off + <uint64_t>abort_words * sizeof(dfccl_endpoint), 4096)  # the daemon checks indices against abort_words
    out.device_mem = device.alloc_device(size)
    base = out.device_mem
    out.endpoints_dev = base + ep_off
    c.armed_dev = base + armed_off

    c.args.control = <dfccl_control *><uintptr_t>dev
    c.args.ring = <dfccl_sqe *><uintptr_t>(dev + ring_off)
    c.args.dev_ring = <dfccl_task_desc *><uintptr_t>(base + dev_ring_off)
    c.args.armed = <uint32_t *><uintptr_t>(base + armed_off)
    c.args.done = <uint32_t *><uintptr_t>(dev + done_off)
    c.args.results = <dfccl_result *><uintptr_t>(dev + results_off)
    c.args.endpoint_abort = <uint32_t *><uintptr_t>(dev + abort_off)
    c.args.endpoint_abort_dev = <uint32_t *><uintptr_t>(base + abort_dev_off)
    c.args.state = <dfccl_daemon_state *><uintptr_t>base
    c.args.ctx = <dfccl_task_ctx *><uintptr_t>(base + ctx_off)
    c.args.active = <uint32_t *><uintptr_t>(base + active_off)
    c.args.slot_counter = <uint32_t *><uintptr_t>(base + counter_off)
    c.args.slot_error = <uint32_t *><uintptr_t>(base + error_off)
    c.args.slot_waiting = <uint32_t *><uintptr_t>(dev + host_waiting_off)
    c.args.endpoints = <dfccl_endpoint *><uintptr_t>(base + ep_off)
    c.args.graph_desc = <dfccl_task_desc *><uintptr_t>(base + graph_desc_off)
    c.args.graph_count = <uint64_t *><uintptr_t>(base + graph_count_off)
    c.args.graph_mask = <uint32_t *><uintptr_t>(base + graph_mask_off)
    c.args.ring_size = c.ring_size
    c.args.nslots = slots
    c.args.nblocks = blocks
    c.args.max_endpoints = abort_words
    return 0
