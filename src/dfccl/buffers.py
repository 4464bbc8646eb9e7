"""Reading the memory behind user arrays: numpy (``__array_interface__``), GPU
arrays (``__cuda_array_interface__``: CuPy, PyTorch, Numba) and DLPack."""

from __future__ import annotations

import ctypes
import numbers
import sys
from dataclasses import dataclass

from dfccl._deprecated import renamed_property
from dfccl._native.array_view import host_array_view
from dfccl.errors import InvalidArgumentError
from dfccl.types import BY_BUFFER_FORMAT, BY_FULL_TYPESTR, DataType, dtype_from_dlpack, dtype_from_typestr

__all__ = ["Buffer", "as_buffer", "plain_array"]

CPU = "cpu"
CUDA = "cuda"


@dataclass(frozen=True)
class Buffer:
    """A contiguous range of memory holding ``count`` elements of ``dtype``."""

    ptr: int
    count: int
    dtype: DataType
    device_type: str  # "cpu" or "cuda" (as torch.device.type names it)
    device: int       # CUDA ordinal; -1 for host memory
    readonly: bool
    owner: object     # keeps the memory alive while a collective uses it

    @property
    def nbytes(self) -> int:
        return self.count * self.dtype.itemsize

    # Old name, one release (design decision 43).
    kind = renamed_property("Buffer", "kind", "device_type")

    @classmethod
    def from_pointer(cls, ptr: int, count: int, dtype, *, device: int | None = None, owner: object = None,
                     readonly: bool = False) -> "Buffer":
        """Raw memory: ``count`` elements of ``dtype`` at ``ptr``; ``device`` is
        the CUDA ordinal for device memory, None for host memory.  The caller
        keeps the memory alive until the collective completes (``owner`` is
        held until then)."""
        from dfccl.types import as_data_type

        for name, value in (("ptr", ptr), ("count", count)) + ((("device", device),) if device is not None else ()):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise InvalidArgumentError(f"Buffer.from_pointer: {name} must be an int, not "
                                           f"{type(value).__name__} ({value!r})")
            if value < 0:
                raise InvalidArgumentError(f"Buffer.from_pointer: {name} must be >= 0, not {value}")
        if ptr == 0 and count > 0:
            raise InvalidArgumentError(f"Buffer.from_pointer: ptr is NULL but count is {count}")
        return cls(int(ptr), int(count), as_data_type(dtype), CPU if device is None else CUDA,
                   -1 if device is None else int(device), bool(readonly), owner)

    def view(self, offset_elems: int, count: int) -> "Buffer":
        return Buffer(self.ptr + offset_elems * self.dtype.itemsize, count, self.dtype, self.device_type, self.device,
                      self.readonly, self.owner)


def _contiguous_count(shape, strides, itemsize: int, what: str) -> int:
    count = 1
    for n in shape:
        count *= int(n)
    if strides is None or count == 0:
        return count
    expect = itemsize
    for n, s in reversed(list(zip(shape, strides))):
        if n != 1 and s != expect:
            raise InvalidArgumentError(f"{what}: the array is not C-contiguous (shape {tuple(shape)}, "
                                       f"strides {tuple(strides)}); pass a contiguous copy")
        expect *= n
    return count


def _cuda_pointer_device(ptr: int, what: str) -> int:
    from dfccl import runtime

    info = runtime.cuda_pointer_info(ptr)
    if info is None:
        raise InvalidArgumentError(f"{what}: pointer {ptr:#x} is not CUDA device memory")
    return info


def _dtype_of(obj, typestr: str, what: str) -> DataType:
    """The element type an array interface names.  A typestr such as '<f4'
    says it alone; only the others (a void type: bfloat16 exports '<V2';
    two-byte types, see BY_FULL_TYPESTR) need the array's dtype name, which
    numpy builds anew at each access (~2 us, most of a plain call's
    description)."""
    dtype = BY_FULL_TYPESTR.get(typestr)
    if dtype is not None:
        return dtype
    try:
        return dtype_from_typestr(typestr, getattr(getattr(obj, "dtype", None), "name", None))
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"{what}: {exc}") from None


def _from_cuda_array_interface(obj, cai, what: str) -> Buffer:
    dtype = _dtype_of(obj, cai["typestr"], what)
    ptr, readonly = cai["data"]
    count = _contiguous_count(cai["shape"], cai.get("strides"), dtype.itemsize, what)
    device = _cuda_pointer_device(ptr, what) if count else -1
    return Buffer(int(ptr), count, dtype, CUDA, device, bool(readonly), obj)


def _is_numpy_scalar(obj) -> bool:
    np = sys.modules.get("numpy")   # a numpy scalar implies numpy is imported
    return np is not None and isinstance(obj, np.generic)


def _from_array_interface(obj, ai, what: str) -> Buffer:
    dtype = _dtype_of(obj, ai["typestr"], what)
    data = ai.get("data")
    # The protocol also allows data as a buffer object (or None: the object's
    # own buffer); such a view can be a copy, so only (pointer, read-only) is
    # trusted to be the object's own memory.
    if not (isinstance(data, tuple) and len(data) == 2):
        raise InvalidArgumentError(f"{what}: {type(obj).__name__} does not expose a pointer to its memory "
                                   "(__array_interface__ 'data' is not a (pointer, read-only) pair); pass a numpy "
                                   "array")
    ptr, readonly = data
    count = _contiguous_count(ai["shape"], ai.get("strides"), dtype.itemsize, what)
    return Buffer(int(ptr), count, dtype, CPU, -1, bool(readonly), obj)


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int), ("dtype", _DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


_KDL_CPU, _KDL_CUDA, _KDL_CUDA_HOST, _KDL_CUDA_MANAGED = 1, 2, 3, 13

_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def _from_dlpack(obj, what: str) -> Buffer:
    dev_type, _ = obj.__dlpack_device__()
    try:
        capsule = obj.__dlpack__(stream=-1) if dev_type == _KDL_CUDA else obj.__dlpack__()
    except TypeError:
        capsule = obj.__dlpack__()
    addr = _capsule_pointer(capsule, b"dltensor")
    t = _DLTensor.from_address(addr)
    dtype = dtype_from_dlpack(t.dtype.code, t.dtype.bits, t.dtype.lanes)
    shape = [t.shape[i] for i in range(t.ndim)]
    strides = None if not t.strides else [t.strides[i] * dtype.itemsize for i in range(t.ndim)]
    count = _contiguous_count(shape, strides, dtype.itemsize, what)
    ptr = (t.data or 0) + t.byte_offset
    if t.device.device_type == _KDL_CUDA:
        return Buffer(ptr, count, dtype, CUDA, t.device.device_id, False, (obj, capsule))
    if t.device.device_type in (_KDL_CPU, _KDL_CUDA_HOST):
        return Buffer(ptr, count, dtype, CPU, -1, False, (obj, capsule))
    raise InvalidArgumentError(f"{what}: DLPack device type {t.device.device_type} is not supported "
                               "(use device memory, or host memory with the simulator)")


_TORCH_DTYPES: dict = {}


def _torch_dtypes(torch) -> dict:
    """torch dtype -> DataType, built on first use (torch is optional)."""
    if not _TORCH_DTYPES:
        for name in ("int8", "uint8", "int32", "int64", "float16", "float32", "float64", "bfloat16", "uint32",
                     "uint64"):
            if hasattr(torch, name):
                _TORCH_DTYPES[getattr(torch, name)] = DataType[name.upper()]
    return _TORCH_DTYPES


def plain_array(obj: object, cuda: bool) -> tuple[int, int, DataType, int | None] | None:
    """(pointer, count, element type, device) of the plain call's usual
    argument: a numpy array (``cuda`` False), a CuPy array, a torch tensor,
    or another object with ``__cuda_array_interface__``; writable,
    C-contiguous, not empty, of an element type its description names
    outright.  None for anything else, which as_buffer then describes, or
    rejects with its reason.  ``device`` is the CUDA ordinal the array's
    library reports (CuPy, torch), else None: host memory, or an interface
    that names no device, whose memory the caller asks the driver about (a
    driver call is most of a plain call's host time on a GPU).  numpy and
    CuPy arrays and torch tensors are read without building their interface
    dictionaries (~2 us and more each)."""
    if not cuda:
        np = sys.modules.get("numpy")   # anything but an ndarray (a scalar, a subclass) as_buffer decides
        if np is None or type(obj) is not np.ndarray:
            return None
        view = host_array_view(obj)
        if view is None:
            return None
        ptr, count, fmt, itemsize = view
        dtype = BY_BUFFER_FORMAT.get((fmt, itemsize))
        return (ptr, count, dtype, None) if dtype is not None and count else None
    cp = sys.modules.get("cupy")
    if cp is not None and type(obj) is cp.ndarray:
        # A CuPy dtype is numpy's: '<f2' is float16 (two-byte typestrs are
        # left out of BY_FULL_TYPESTR for other exporters' bfloat16).
        typestr = obj.dtype.str
        dtype = DataType.FLOAT16 if typestr == "<f2" else BY_FULL_TYPESTR.get(typestr)
        count = obj.size
        if dtype is None or not count or not obj.flags.c_contiguous:
            return None
        return (obj.data.ptr, count, dtype, obj.device.id)
    torch = sys.modules.get("torch")
    if torch is not None and type(obj) is torch.Tensor:
        # torch builds its interface dictionary in Python (several us); a
        # tensor that requires grad has none, and the general path says why.
        dtype = _torch_dtypes(torch).get(obj.dtype)
        if dtype is None or not obj.is_cuda or obj.requires_grad or not obj.is_contiguous():
            return None
        count = obj.numel()
        return (obj.data_ptr(), count, dtype, obj.get_device()) if count else None
    try:
        ai = obj.__cuda_array_interface__
    except (AttributeError, TypeError):
        return None
    dtype = BY_FULL_TYPESTR.get(ai["typestr"])
    data = ai.get("data")
    if dtype is None or ai.get("strides") is not None or type(data) is not tuple or data[1]:
        return None
    count = 1
    for n in ai["shape"]:
        count *= n
    return (data[0], count, dtype, None) if count else None


def as_buffer(obj: object, what: str = "buffer") -> Buffer:
    """Describes the memory of ``obj``; raises InvalidArgumentError for anything
    dfccl cannot use (non-contiguous, unsupported dtype, unknown object)."""
    if isinstance(obj, Buffer):
        return obj
    if _is_numpy_scalar(obj):
        # Its array interface exports a temporary copy: a collective would
        # write into (or read from) memory freed at once, and never update
        # the scalar.
        raise InvalidArgumentError(f"{what}: a numpy scalar ({type(obj).__name__}) has no memory a collective can "
                                   "use; pass an array (e.g. np.array([x]) or a 0-d np.asarray(x)) and read the "
                                   "result from it")
    try:
        cai = obj.__cuda_array_interface__
    except (AttributeError, TypeError):
        cai = None  # none, or e.g. a bfloat16 torch tensor: fall through to DLPack
    if cai is not None and str(cai.get("typestr", ""))[1:2] == "V" and hasattr(obj, "__dlpack__"):
        cai = None  # a void typestr ('<V2': bfloat16 from some torch versions): DLPack names the type
    if cai is not None:
        return _from_cuda_array_interface(obj, cai, what)
    ai = getattr(obj, "__array_interface__", None)
    if ai is not None:
        return _from_array_interface(obj, ai, what)
    if hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        return _from_dlpack(obj, what)
    raise InvalidArgumentError(f"{what}: {type(obj).__name__} is not an array (expected an object with "
                               "__cuda_array_interface__, __array_interface__ or __dlpack__); pass an array, e.g. "
                               "a numpy array, not a Python number, bytes or list")
