"""The registration scenario of tests/sim/test_jobs.py, run in every rank:
registered inputs read in place by peers in other processes, and a buffer
freed and reallocated at the same address between collectives."""

from __future__ import annotations

import ctypes

import numpy as np

import dfccl
from dfccl.registration import mem_alloc, mem_free

TIMEOUT = 60


class _DeviceArray:
    """A float32 vector at a device address (CUDA array interface)."""

    def __init__(self, ptr: int, count: int):
        self.__cuda_array_interface__ = {"shape": (count,), "typestr": "<f4", "data": (ptr, False), "version": 3,
                                         "strides": None}


def _view(comm, ptr: int, count: int):
    if comm.backend == "sim":
        return np.ctypeslib.as_array((ctypes.c_float * count).from_address(ptr))
    return _DeviceArray(ptr, count)


def _fill(comm, ptr: int, count: int, values: np.ndarray) -> None:
    if comm.backend == "sim":
        _view(comm, ptr, count)[:] = values
    else:
        from cuda.bindings import driver
        err, = driver.cuMemcpyHtoD(ptr, values.astype(np.float32), values.nbytes)
        assert err == driver.CUresult.CUDA_SUCCESS, err


def _read(comm, ptr: int, count: int) -> np.ndarray:
    if comm.backend == "sim":
        return _view(comm, ptr, count).copy()
    from cuda.bindings import driver
    out = np.empty(count, np.float32)
    err, = driver.cuMemcpyDtoH(out, ptr, out.nbytes)
    assert err == driver.CUresult.CUDA_SUCCESS, err
    return out


def run_register(comm: dfccl.Communicator) -> dict:
    r, n = comm.rank, comm.world_size
    count = 3000                                   # staged: below staged_max_bytes
    nbytes = count * 4
    alloc = lambda: mem_alloc(2 * nbytes, backend=comm.backend, device=comm.device)
    free = lambda p: mem_free(p, backend=comm.backend, device=comm.device)
    ptr = alloc()
    send = ptr + nbytes                            # inside the allocation, not at its base
    out_ptr = alloc()
    used = []

    def check_all_reduce(seed: int, in_place: bool) -> None:
        vals = np.arange(count, dtype=np.float32) * (seed % 5 + 1) + 100 * r + seed
        _fill(comm, send, count, vals)
        dst = send if in_place else out_ptr
        used.append(comm._registry.send_word(send, nbytes) != 0)
        comm.all_reduce(_view(comm, send, count), None if in_place else _view(comm, out_ptr, count),
                        tag=("ar", seed)).synchronize(timeout=TIMEOUT)
        want = sum(np.arange(count, dtype=np.float32) * (seed % 5 + 1) + 100 * p + seed for p in range(n))
        got = _read(comm, dst, count)
        assert np.array_equal(got, want), (seed, in_place, got[:4], want[:4])

    def check_all_gather(seed: int) -> None:
        vals = np.full(count, r + seed, np.float32)
        _fill(comm, send, count, vals)
        gather_ptr = mem_alloc(n * nbytes, backend=comm.backend, device=comm.device)
        comm.all_gather(_view(comm, send, count), _view(comm, gather_ptr, n * count),
                        tag=("ag", seed)).synchronize(timeout=TIMEOUT)
        got = _read(comm, gather_ptr, n * count)
        free(gather_ptr)
        assert np.array_equal(got, np.repeat(np.arange(n, dtype=np.float32) + seed, count)), seed

    handle = comm.register(_view(comm, send, count))
    assert handle.active
    for i in range(3):
        check_all_reduce(i, in_place=bool(i % 2))
        check_all_gather(i)
    # Free and reallocate at the same address, the registration left open:
    # the submission sees another allocation there and takes the staged copy.
    free(ptr)
    # Allocate until the freed range comes back (other holes fill first).
    spare = []
    for _ in range(64):
        ptr2 = alloc()
        if ptr2 == ptr:
            break
        spare.append(ptr2)
    if ptr2 != ptr:
        spare.pop()          # not found: keep the last one as the new buffer
    for p in spare:
        free(p)
    same_address = ptr2 == ptr
    # mmap does not always hand the range back; where it does not, the
    # registration check below still holds (another address is in no handle).
    ptr = ptr2
    send = ptr + nbytes
    check_all_reduce(10, in_place=False)
    assert (not handle.active or not same_address) and used[-1] is False, ("a freed allocation's registration must not be used", used, same_address, handle)
    # Register the new allocation: read in place again.
    with comm.register(_view(comm, send, count)) as h2:
        check_all_reduce(11, in_place=True)
        check_all_gather(11)
        assert used[-1] is True
    # Closed: back to the staged copy; free, reallocate, register once more.
    check_all_reduce(12, in_place=False)
    assert used[-1] is False
    free(ptr)
    ptr = alloc()
    send = ptr + nbytes
    h3 = comm.register(_view(comm, send, count))
    check_all_reduce(13, in_place=False)
    assert used[-1] is True
    comm.deregister(h3)
    free(ptr)
    free(out_ptr)
    return {"rank": r, "used": used, "same_address": same_address, "path": comm.path}
