"""Element types and reduction operations, and how array libraries name them."""

from __future__ import annotations

import enum

from dfccl._native import layout

__all__ = ["DataType", "ReduceOp", "KIND_NAMES", "as_data_type", "as_reduce_op"]


class DataType(enum.IntEnum):
    """Element types; the values are the daemon's (abi.h, dfccl_dtype)."""

    INT8 = layout.DTYPE_INT8
    UINT8 = layout.DTYPE_UINT8
    INT32 = layout.DTYPE_INT32
    UINT32 = layout.DTYPE_UINT32
    INT64 = layout.DTYPE_INT64
    UINT64 = layout.DTYPE_UINT64
    FLOAT16 = layout.DTYPE_FLOAT16
    FLOAT32 = layout.DTYPE_FLOAT32
    FLOAT64 = layout.DTYPE_FLOAT64
    BFLOAT16 = layout.DTYPE_BFLOAT16

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]


class ReduceOp(enum.IntEnum):
    """Reductions; the values are the daemon's (abi.h, dfccl_op).  AVG sums and
    divides once by the number of ranks (integer division for integer types)."""

    SUM = layout.OP_SUM
    PROD = layout.OP_PROD
    MIN = layout.OP_MIN
    MAX = layout.OP_MAX
    AVG = layout.OP_AVG


#: Collective kinds (abi.h, dfccl_kind) by code, as the API names them.
KIND_NAMES = {layout.KIND_ALL_REDUCE: "all_reduce", layout.KIND_ALL_GATHER: "all_gather",
              layout.KIND_REDUCE_SCATTER: "reduce_scatter", layout.KIND_BROADCAST: "broadcast",
              layout.KIND_REDUCE: "reduce", layout.KIND_SEND: "send", layout.KIND_RECV: "recv",
              layout.KIND_ALL_TO_ALL: "all_to_all"}

# Element sizes, as the daemon computes them (layout.h), looked up once.
_ITEMSIZE = {dtype: layout.dtype_size(dtype) for dtype in DataType}

# Names as numpy, torch, cupy and DLPack spell them.
_BY_NAME = {
    "int8": DataType.INT8, "uint8": DataType.UINT8, "int32": DataType.INT32, "uint32": DataType.UINT32,
    "int64": DataType.INT64, "uint64": DataType.UINT64, "float16": DataType.FLOAT16, "half": DataType.FLOAT16,
    "float32": DataType.FLOAT32, "float": DataType.FLOAT32, "float64": DataType.FLOAT64, "double": DataType.FLOAT64,
    "bfloat16": DataType.BFLOAT16,
}

# Array-interface type strings (kind + itemsize).
_BY_TYPESTR = {
    "i1": DataType.INT8, "u1": DataType.UINT8, "i4": DataType.INT32, "u4": DataType.UINT32,
    "i8": DataType.INT64, "u8": DataType.UINT64, "f2": DataType.FLOAT16, "f4": DataType.FLOAT32,
    "f8": DataType.FLOAT64,
}

# Full typestrs that name their element type by themselves ('<f4', '|u1'):
# buffers.py looks these up before the array's dtype name.  Two-byte ones
# are left out: a bfloat16 array may export a two-byte typestr, and only
# its name tells (dtype_from_typestr); a 1-, 4- or 8-byte element cannot be
# bfloat16 whatever its name says.
BY_FULL_TYPESTR = {order + key: dtype for key, dtype in _BY_TYPESTR.items() for order in "<|" if key[-1] != "2"}

# Buffer-protocol formats (PEP 3118 native characters) with their item size,
# as the plain call reads host arrays (buffers.plain_array).  'e' is IEEE
# half by definition; numpy exports no format for bfloat16.
BY_BUFFER_FORMAT = {
    ("b", 1): DataType.INT8, ("B", 1): DataType.UINT8, ("i", 4): DataType.INT32, ("I", 4): DataType.UINT32,
    ("l", 8): DataType.INT64, ("q", 8): DataType.INT64, ("L", 8): DataType.UINT64, ("Q", 8): DataType.UINT64,
    ("e", 2): DataType.FLOAT16, ("f", 4): DataType.FLOAT32, ("d", 8): DataType.FLOAT64,
}

# DLPack (type code, bits).
_BY_DLPACK = {
    (0, 8): DataType.INT8, (1, 8): DataType.UINT8, (0, 32): DataType.INT32, (1, 32): DataType.UINT32,
    (0, 64): DataType.INT64, (1, 64): DataType.UINT64, (2, 16): DataType.FLOAT16, (2, 32): DataType.FLOAT32,
    (2, 64): DataType.FLOAT64, (4, 16): DataType.BFLOAT16,
}

_OPS = {"sum": ReduceOp.SUM, "prod": ReduceOp.PROD, "product": ReduceOp.PROD, "min": ReduceOp.MIN,
        "max": ReduceOp.MAX, "avg": ReduceOp.AVG, "mean": ReduceOp.AVG}


def as_data_type(value: object) -> DataType:
    """DataType from a DataType, a name ("float32"), a numpy/torch dtype."""
    from dfccl.errors import InvalidArgumentError

    if isinstance(value, DataType):
        return value
    name = getattr(value, "name", None) if not isinstance(value, str) else value
    if name is None and isinstance(value, type):
        try:  # numpy scalar types (np.float32) and anything numpy accepts
            import numpy as np
            name = np.dtype(value).name
        except TypeError:
            pass
    if name is None:
        name = str(value)
    name = name.rsplit(".", 1)[-1].lower()  # "torch.float32" -> "float32"
    try:
        return _BY_NAME[name]
    except KeyError:
        raise InvalidArgumentError(
            f"unsupported dtype {value!r}; supported: {', '.join(d.name.lower() for d in DataType)}") from None


def dtype_from_typestr(typestr: str, descr_name: str | None = None) -> DataType:
    from dfccl.errors import InvalidArgumentError

    if descr_name == "bfloat16":
        return DataType.BFLOAT16
    key = typestr[1:]
    if typestr[0] == ">" and key[-1] != "1":
        raise InvalidArgumentError(f"big-endian arrays are not supported ({typestr!r})")
    try:
        return _BY_TYPESTR[key]
    except KeyError:
        raise InvalidArgumentError(f"unsupported array element type {typestr!r}; supported: "
                                   f"{', '.join(d.name.lower() for d in DataType)}") from None


def dtype_from_dlpack(code: int, bits: int, lanes: int) -> DataType:
    from dfccl.errors import InvalidArgumentError

    if lanes != 1 or (code, bits) not in _BY_DLPACK:
        raise InvalidArgumentError(f"unsupported DLPack dtype (code={code}, bits={bits}, lanes={lanes})")
    return _BY_DLPACK[(code, bits)]


def as_reduce_op(value: object) -> ReduceOp:
    from dfccl.errors import InvalidArgumentError

    if isinstance(value, ReduceOp):
        return value
    if isinstance(value, str) and value.lower() in _OPS:
        return _OPS[value.lower()]
    raise InvalidArgumentError(f"unsupported reduction {value!r}; use one of sum, prod, min, max, avg")
