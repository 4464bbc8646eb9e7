"""Pinned host memory that the GPU maps and that other processes of this
host map too: the arena of a GPU rank whose communicator spans hosts
(docs/multi-node.md, "On GPUs").

The network proxy reads what the daemon publishes in the arena and lands
what remote peers send there with plain host loads and stores, so it never
queues work on the GPU: a copy of the proxy's on a stream could wait behind
an application stream that waits for the very collective the copy serves
(a shared hardware queue), and a kernel launch could wait for a module
load's drain.  The memory is a file of host shared memory (the simulator's
device memory is the same) registered with the driver in each process that
maps it."""

from __future__ import annotations

import ctypes
import os
import uuid

from dfccl.errors import BackendError
from dfccl.shared_files import shared_directory

__all__ = ["HostArena"]

_PAGE = os.sysconf("SC_PAGE_SIZE")
_PROT_READ_WRITE = 0x1 | 0x2
_MAP_SHARED = 0x01
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def _check(result, what: str):
    """The values of a cuda.bindings call after its status, or BackendError."""
    from cuda.bindings import driver

    err, *values = result
    if err != driver.CUresult.CUDA_SUCCESS:
        raise BackendError(f"{what} failed: {err.name if hasattr(err, 'name') else err}")
    return values[0] if len(values) == 1 else values


class HostArena:
    """One process's mapping of a file of host shared memory, registered
    with the CUDA driver so that the daemon reaches it (``device_ptr``) and
    readable and writable from the host (``host_ptr``).  Built with
    :meth:`create` (a new file) or :meth:`open` (another process's, from
    its :meth:`describe`); :meth:`close` unregisters and unmaps
    (idempotent); :meth:`unlink` drops the file's name once every peer
    mapped it."""

    def __init__(self):
        raise TypeError("HostArena is built with HostArena.create() or HostArena.open()")

    @staticmethod
    def create(device, nbytes: int) -> "HostArena":
        """A new zero-filled arena of ``nbytes`` for ``device`` (a CUDA
        device of this process).

        Raises:
            BackendError: the shared-memory directory has no room, or the
                driver refuses the registration.
        """
        size = (max(nbytes, 1) + _PAGE - 1) // _PAGE * _PAGE
        path = os.path.join(shared_directory(), f"dfccl-arena-{os.getpid()}-{uuid.uuid4().hex}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                # Reserved now: a file of holes would fail later, in the daemon's
                # or the proxy's first touch of a page the directory cannot hold.
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                raise BackendError(
                    f"dfccl: cannot reserve {size} bytes of host shared memory in {os.path.dirname(path)} for the "
                    f"arena of a rank whose communicator spans hosts ({exc.strerror}); give that directory more room "
                    "or lower CommOptions.staging_bytes") from None
            self = HostArena._map(device, fd, path, size)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        self._owner = True
        return self

    @staticmethod
    def open(device, desc: dict) -> "HostArena":
        """Maps another process's arena (its :meth:`describe`) for ``device``.

        Raises:
            BackendError: the file is gone (its process closed or failed
                during start-up) or the driver refuses the registration.
        """
        try:
            fd = os.open(desc["path"], os.O_RDWR)
        except FileNotFoundError:
            raise BackendError(f"the arena {desc['path']} of a peer is gone (the peer closed, failed or exited "
                               "during start-up)") from None
        try:
            return HostArena._map(device, fd, desc["path"], int(desc["size"]))
        finally:
            os.close(fd)

    @staticmethod
    def _map(device, fd: int, path: str, size: int) -> "HostArena":
        from cuda.bindings import driver

        host = _libc.mmap(None, size, _PROT_READ_WRITE, _MAP_SHARED, fd, 0)
        if host is None or host == _MAP_FAILED:
            err = ctypes.get_errno()
            raise BackendError(f"mmap of {size} bytes of {path} failed: {os.strerror(err)}")
        self = HostArena.__new__(HostArena)
        self.path, self.size, self.host_ptr, self.device_ptr = path, size, host, 0
        self._owner = False
        self._registered = False
        try:
            device.make_current()
            flags = driver.CU_MEMHOSTREGISTER_PORTABLE | driver.CU_MEMHOSTREGISTER_DEVICEMAP
            _check(driver.cuMemHostRegister(host, size, flags), f"cuMemHostRegister({size} bytes of {path})")
            self._registered = True
            self.device_ptr = int(_check(driver.cuMemHostGetDevicePointer(host, 0), "cuMemHostGetDevicePointer"))
        except BaseException:
            self.close()
            raise
        return self

    def describe(self) -> dict:
        """What a process of this host needs to map this arena (JSON-able)."""
        return {"via": "host-shm", "path": self.path, "size": self.size}

    def write(self, offset: int, data: bytes) -> None:
        """Plain host stores at ``offset`` (the rank status words)."""
        if not 0 <= offset <= self.size - len(data):
            raise ValueError(f"write of {len(data)} bytes at {offset} is outside the arena of {self.size}")
        ctypes.memmove(self.host_ptr + offset, data, len(data))

    def unlink(self) -> None:
        """Drops the file's name (the memory lives on in every mapping)."""
        if self._owner:
            self._owner = False
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        """Unregisters and unmaps (once the daemon holds nothing of it)."""
        from cuda.bindings import driver

        if self._registered:
            self._registered = False
            driver.cuMemHostUnregister(self.host_ptr)   # the process's last mapping goes with it anyway
        if self.host_ptr:
            _libc.munmap(self.host_ptr, self.size)
            self.host_ptr = self.device_ptr = 0
        self.unlink()
