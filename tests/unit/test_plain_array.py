"""The plain call's reader of array memory (buffers.plain_array): what it
takes, and that everything it declines is left to the general path."""

import numpy as np
import pytest

from dfccl._native.array_view import host_array_view
from dfccl.buffers import as_buffer, plain_array
from dfccl.types import DataType


@pytest.mark.parametrize("dtype", ["int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "float32",
                                   "float64"])
@pytest.mark.parametrize("shape", [(1,), (7,), (3, 5), ()])
def test_agrees_with_the_general_path(dtype, shape):
    x = np.zeros(shape, dtype=dtype)
    got = plain_array(x, False)
    b = as_buffer(x)
    assert got == (b.ptr, b.count, b.dtype, None)
    assert got[2] is DataType[np.dtype(dtype).name.upper()]


def test_views_point_at_their_first_element():
    base = np.arange(64, dtype=np.float32)
    view = base[10:20]
    assert plain_array(view, False) == (base.ctypes.data + 40, 10, DataType.FLOAT32, None)


def _readonly():
    x = np.ones(4, np.float32)
    x.flags.writeable = False
    return x


@pytest.mark.parametrize("make", [
    lambda: np.ones(8, np.float32)[::2],                  # strided
    lambda: np.ones((4, 4), np.float32).T,                # Fortran order
    _readonly,
    lambda: np.ones(3, ">f4"),                            # not native byte order
    lambda: np.ones(3, np.int16),                         # no dfccl type
    lambda: np.ones(0, np.float32),                       # empty
    lambda: np.float32(1.0),                              # a scalar
    lambda: np.ones(3, [("a", "f4"), ("b", "i4")]),       # a record
    lambda: np.ones(3, np.float32).view(np.matrix),       # a subclass
    lambda: bytearray(8),                                 # not an ndarray
], ids=["strided", "fortran", "readonly", "big-endian", "int16", "empty", "scalar", "record", "subclass",
        "bytearray"])
def test_declines_what_the_general_path_decides(make):
    assert plain_array(make(), False) is None


def test_host_array_view_reads_the_buffer_protocol():
    x = np.arange(6, dtype=np.int64).reshape(2, 3)
    assert host_array_view(x) == (x.ctypes.data, 6, x.dtype.char, 8)
    view = host_array_view(bytearray(5))
    assert view is not None and view[1:] == (5, "B", 1)
    assert host_array_view(object()) is None
    assert host_array_view(b"read only") is None
