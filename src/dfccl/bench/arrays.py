"""Arrays in a backend's memory, for the demo, the tests and the benchmarks:
numpy arrays in the simulator, DeviceArray (device memory with
``__cuda_array_interface__``) on a GPU.  Not a general array library: it
allocates, fills from numpy and reads back."""

from __future__ import annotations

import numpy as np

from dfccl import runtime

__all__ = ["DeviceArray", "empty", "from_numpy", "to_numpy"]


class _BlockCache:
    """Freed device blocks kept for reuse.  cuMemFree synchronises the device,
    which with a persistent daemon means waiting for it to go idle; caching
    (like the allocators of PyTorch and CuPy) avoids that."""

    LIMIT = 16 << 30

    def __init__(self):
        self.free: dict[tuple[int, int], list[int]] = {}
        self.bytes = 0

    def take(self, device: int, nbytes: int) -> int | None:
        blocks = self.free.get((device, nbytes))
        if blocks:
            self.bytes -= nbytes
            return blocks.pop()
        return None

    def give(self, backend, device: int, nbytes: int, ptr: int) -> None:
        if self.bytes + nbytes > self.LIMIT:
            backend.free_device(ptr)
            return
        self.free.setdefault((device, nbytes), []).append(ptr)
        self.bytes += nbytes


_cache = _BlockCache()


def _round_block(nbytes: int) -> int:
    """Cache size class: the next power of two, at least 256 bytes."""
    return max(256, 1 << (int(nbytes) - 1).bit_length())


class DeviceArray:
    """Contiguous device memory holding ``count`` elements of ``dtype``."""

    def __init__(self, device: int, count: int, dtype):
        self.device = device
        self.dtype = np.dtype(dtype)
        self.count = int(count)
        self._backend = runtime.get_device("cuda", device)
        self._block = _round_block(self.nbytes)
        ptr = _cache.take(device, self._block)
        self.ptr = ptr if ptr is not None else self._backend.alloc_device(self._block)

    @property
    def nbytes(self) -> int:
        return self.count * self.dtype.itemsize

    @property
    def __cuda_array_interface__(self):
        return {"shape": (self.count,), "typestr": self.dtype.str, "data": (self.ptr, False), "version": 3,
                "strides": None}

    def view(self, start: int, stop: int) -> "DeviceArray":
        v = DeviceArray.__new__(DeviceArray)
        v.device, v.dtype, v.count, v._backend = self.device, self.dtype, stop - start, self._backend
        v.ptr = self.ptr + start * self.dtype.itemsize
        v._base = self
        return v

    def __getitem__(self, s: slice) -> "DeviceArray":
        start, stop, step = s.indices(self.count)
        if step != 1:
            raise ValueError("DeviceArray supports contiguous slices only")
        return self.view(start, stop)

    def upload(self, host: np.ndarray) -> None:
        host = np.ascontiguousarray(host, dtype=self.dtype)
        assert host.size == self.count
        if self.nbytes:
            self._backend.copy_to_device(self.ptr, host.ctypes.data, self.nbytes)

    def download(self) -> np.ndarray:
        out = np.empty(self.count, dtype=self.dtype)
        if self.nbytes:
            self._backend.copy_from_device(out.ctypes.data, self.ptr, self.nbytes)
        return out

    def __del__(self):
        if getattr(self, "_base", None) is None and getattr(self, "ptr", 0):
            try:
                _cache.give(self._backend, self.device, self._block, self.ptr)
            except Exception:
                pass
            self.ptr = 0

    def __len__(self) -> int:
        return self.count


def empty(backend: str, device: int, count: int, dtype, fill=None):
    """An array of ``count`` elements, filled with ``fill`` when given."""
    dtype = np.dtype(dtype)
    if backend == "sim":
        a = np.empty(count, dtype=dtype)
        if fill is not None:
            a.fill(fill)
        return a
    a = DeviceArray(device, count, dtype)
    if fill is not None:
        a.upload(np.full(count, fill, dtype=dtype))
    return a


def from_numpy(backend: str, device: int, host: np.ndarray):
    if backend == "sim":
        return np.array(host, copy=True)
    a = DeviceArray(device, host.size, host.dtype)
    a.upload(host)
    return a


def to_numpy(arr) -> np.ndarray:
    if isinstance(arr, np.ndarray):
        return arr.copy()
    return arr.download()
