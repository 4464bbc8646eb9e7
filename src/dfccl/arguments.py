"""Checks of a collective's and a communicator's arguments that need no
communicator: numbers, options, tags, and how send and recv may overlap."""

from __future__ import annotations

import math
import numbers

from dfccl._native.layout import KIND_ALL_GATHER, KIND_ALL_REDUCE, KIND_BROADCAST, KIND_REDUCE, KIND_REDUCE_SCATTER
from dfccl.buffers import Buffer
from dfccl.errors import InvalidArgumentError
from dfccl.options import CommOptions, DaemonOptions

__all__ = ["check_int", "check_seconds", "check_options", "is_simple_tag", "overlaps", "check_overlap"]


def check_int(name: str, value, minimum: int | None = None) -> int:
    """An int (numpy integers too), never a bool or a float that happens to be whole."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidArgumentError(f"{name} must be an int, not {type(value).__name__} ({value!r})")
    value = int(value)
    if minimum is not None and value < minimum:
        raise InvalidArgumentError(f"{name} must be >= {minimum}, not {value}")
    return value


def check_seconds(name: str, value, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgumentError(f"{name} must be a number of seconds, not {type(value).__name__} ({value!r})")
    t = float(value)
    if not math.isfinite(t) or t < 0 or (positive and t == 0):
        raise InvalidArgumentError(f"{name} must be finite and {'> 0' if positive else '>= 0'} seconds, not {value!r}")
    return t


def check_options(backend, options, daemon_options) -> None:
    if backend is not None and not isinstance(backend, str):
        raise InvalidArgumentError(f"backend must be 'cuda', 'sim' or None, not {type(backend).__name__} "
                                   f"({backend!r})")
    if options is not None and not isinstance(options, CommOptions):
        raise InvalidArgumentError(f"options must be a dfccl.CommOptions or None, not {type(options).__name__}")
    if daemon_options is not None and not isinstance(daemon_options, DaemonOptions):
        raise InvalidArgumentError("daemon_options must be a dfccl.DaemonOptions or None, not "
                                   f"{type(daemon_options).__name__}")


def is_simple_tag(tag) -> bool:
    """None, or a tag of exactly str or int, or a tuple of such tags (DDP's
    tagged hook names buckets so): valid without hashing, and equal values
    are the same tag (unlike 1, True and 1.0), so it can key a kept
    descriptor (Submitter.plain_task)."""
    return tag is None or _exact_tag(tag)


def _exact_tag(tag) -> bool:
    t = type(tag)
    return t is str or t is int or (t is tuple and all(map(_exact_tag, tag)))


def overlaps(a: Buffer, b: Buffer) -> bool:
    return a.ptr < b.ptr + b.nbytes and b.ptr < a.ptr + a.nbytes


def check_overlap(kind, s: Buffer, r: Buffer, count, rank, size, name):
    """Buffers may coincide exactly as NCCL's in-place forms; any other overlap
    would let the collective read what it already overwrote."""
    if s.ptr == r.ptr and kind in (KIND_ALL_REDUCE, KIND_BROADCAST, KIND_REDUCE):
        return
    if kind == KIND_ALL_GATHER and s.ptr == r.ptr + rank * count * s.dtype.itemsize:
        return
    if kind == KIND_REDUCE_SCATTER and r.ptr == s.ptr + rank * count * s.dtype.itemsize:
        return
    if overlaps(s, r):
        raise InvalidArgumentError(f"{name}: send and recv overlap without being the in-place form", rank=rank)
