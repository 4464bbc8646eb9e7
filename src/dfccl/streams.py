"""CUDA stream handles from the objects array libraries use for streams."""

from __future__ import annotations

from dfccl.errors import InvalidArgumentError

__all__ = ["stream_handle"]


def stream_handle(stream: object) -> int:
    """The CUstream (as an int) behind ``stream``: an int, a CuPy or PyTorch
    stream (``.cuda_stream``), a cuda.core stream (``__cuda_stream__``)."""
    if isinstance(stream, bool):
        raise InvalidArgumentError("stream must be a stream object or handle, not a bool")
    if isinstance(stream, int):
        return stream
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is not None:
        value = proto() if callable(proto) else proto
        return int(value[1]) if isinstance(value, tuple) else int(value)
    for attr in ("cuda_stream", "ptr", "handle"):
        value = getattr(stream, attr, None)
        if value is not None:
            return int(value)
    raise InvalidArgumentError(f"cannot get a CUDA stream handle from {type(stream).__name__}")
