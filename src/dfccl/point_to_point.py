"""Point to point (send / recv) and all-to-all: how a send meets its recv,
how each runs (path, channels, FIFO), and the split table of an all-to-all.

A send from rank A to rank B with tag T and B's recv from A with tag T are
two halves of one instance of the *pair tag* (communicator, T, A -> B): both
ranks name it by the same key, so the k-th send on (A -> B, T) meets the k-th
recv, through the tag records every collective uses.  Untagged sends and recvs
are the instances of one pair tag per ordered pair (NCCL's in-order matching
per peer pair).  The daemon side is cuda/daemon/transfer_p2p.cuh.

An all-to-all is an ordinary collective instance of its tag.  Its per-peer
counts and offsets go into a split table that the host writes into staging
of the rank's arena for that instance alone (peers read it, and mark in it
when they are done)."""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from dfccl._native.layout import PATH_DIRECT, PATH_RING, STAGE_ALIGN, TASK_STAGED, a2a_copy_offset, a2a_words
from dfccl.errors import InvalidArgumentError
from dfccl.planning import Geometry, _ceil_div, _round_up, channel_count, clamp_slice
from dfccl.tags import tag_key
from dfccl.types import DataType

__all__ = ["pair_key", "plan_p2p", "SplitLayout", "resolve_splits", "AllToAllPlan", "plan_all_to_all", "table_words",
           "split_table"]


def pair_key(comm_key: int, src: int, dst: int, tag: object) -> int:
    """Key of the pair tag (communicator, ``tag``, ``src`` -> ``dst``), the
    same on both ranks of the pair."""
    return tag_key(comm_key, ("#p2p", src, dst) if tag is None else ("#p2p", src, dst, tag))


def plan_p2p(count: int, dtype: DataType, max_channels: int, direct: bool, options) -> Geometry:
    """Path and channels of one send / recv: a pure function of the message,
    so both ranks of the pair compute the same (the daemon checks it).
    ``direct``: both ranks in this process (the receiver reads the sender's
    buffer in place); otherwise the sender pushes through a FIFO in the
    receiver's arena (Geometry.fifo_bytes of the receiver's staging)."""
    esize = dtype.itemsize
    nch = channel_count(count * esize, max_channels, options)
    if direct:
        return Geometry(PATH_DIRECT, nch)
    align = max(1, 16 // esize)
    chan_bytes = _round_up(_ceil_div(count, nch), align) * esize
    slice_bytes = clamp_slice(_round_up(_ceil_div(chan_bytes, options.ring_slots), 16), chan_bytes,
                              options.max_slice_bytes // 16 * 16, options)
    return Geometry(PATH_RING, nch, slice_bytes, options.ring_slots)


@dataclass(frozen=True)
class SplitLayout:
    """Elements this rank sends to / receives from each rank, and where they
    lie in its buffers.  ``even``: the per-peer count when every split is that
    same count (> 0), else None."""

    send_offsets: tuple[int, ...]
    send_counts: tuple[int, ...]
    recv_offsets: tuple[int, ...]
    recv_counts: tuple[int, ...]
    even: int | None


def _splits(name: str, splits, nranks: int, total: int, what: str) -> list[int]:
    if isinstance(splits, (str, bytes)):
        raise InvalidArgumentError(f"{what}: {name} must be a sequence of {nranks} element counts, not "
                                   f"{type(splits).__name__}")
    try:
        values = list(splits)
    except TypeError:
        raise InvalidArgumentError(f"{what}: {name} must be a sequence of {nranks} element counts, not "
                                   f"{type(splits).__name__}") from None
    if len(values) != nranks:
        raise InvalidArgumentError(f"{what}: {name} has {len(values)} entries, expected one per rank ({nranks})")
    out = []
    for p, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or int(v) < 0:
            raise InvalidArgumentError(f"{what}: {name}[{p}] must be an int >= 0, not {v!r}")
        out.append(int(v))
    if sum(out) != total:
        raise InvalidArgumentError(f"{what}: {name} sum to {sum(out)} elements, but the buffer holds {total}")
    return out


def _offsets(counts: Sequence[int]) -> tuple[int, ...]:
    out, at = [], 0
    for c in counts:
        out.append(at)
        at += c
    return tuple(out)


def resolve_splits(send_total: int, recv_total: int, nranks: int, send_splits, recv_splits,
                   what: str) -> SplitLayout:
    """Validates the splits of an all-to-all (None: equal parts of the buffer)
    and lays them out contiguously, in rank order, as torch does."""
    def equal(name: str, total: int) -> list[int]:
        if total % nranks:
            raise InvalidArgumentError(f"{what}: {name} buffer holds {total} elements, not a multiple of the "
                                       f"{nranks} ranks; pass {name}_splits")
        return [total // nranks] * nranks

    sc = equal("send", send_total) if send_splits is None else _splits("send_splits", send_splits, nranks,
                                                                       send_total, what)
    rc = equal("recv", recv_total) if recv_splits is None else _splits("recv_splits", recv_splits, nranks,
                                                                       recv_total, what)
    even = sc[0] if sc[0] > 0 and all(c == sc[0] for c in sc + rc) else None
    return SplitLayout(_offsets(sc), tuple(sc), _offsets(rc), tuple(rc), even)


@dataclass(frozen=True)
class AllToAllPlan:
    """How one all-to-all runs: ``count`` is the per-peer count of the even
    form and 0 for uneven splits (whose channels are all the communicator's,
    since ranks with different totals must agree on them); ``aux_bytes`` is
    the instance's staging: split table, then (staged) the send copy."""

    geometry: Geometry
    count: int
    aux_bytes: int
    copy_offset: int


def table_words(nranks: int, nchannels: int) -> int:
    """Words of a split table (abi.h, DFCCL_A2A_WORDS)."""
    return a2a_words(nranks, nchannels)


def plan_all_to_all(layout: SplitLayout, dtype: DataType, nranks: int, max_channels: int, mode: str,
                    options) -> AllToAllPlan:
    """``mode``: the communicator's path ("direct": peers read this rank's
    send buffer in place; otherwise they read a copy in its arena)."""
    esize = dtype.itemsize
    if layout.even is not None:
        count = layout.even
        nch = channel_count(count * nranks * esize, max_channels, options)
    else:
        count, nch = 0, max_channels
    staged = mode != "direct"
    copy_offset = a2a_copy_offset(nranks, nch)
    extent = max((o + c for o, c in zip(layout.send_offsets, layout.send_counts)), default=0)
    aux = copy_offset + (_round_up(extent * esize, STAGE_ALIGN) if staged else 0)
    return AllToAllPlan(Geometry(PATH_DIRECT, nch, flags=TASK_STAGED if staged else 0), count, aux, copy_offset)


def split_table(layout: SplitLayout, nchannels: int) -> np.ndarray:
    """The split table as the daemon reads it (abi.h): offsets and counts per
    peer, then the done flags, zeroed."""
    n = len(layout.send_counts)
    table = np.zeros(table_words(n, nchannels), dtype=np.uint64)
    table[0:n] = layout.send_offsets
    table[n:2 * n] = layout.send_counts
    table[2 * n:3 * n] = layout.recv_offsets
    table[3 * n:4 * n] = layout.recv_counts
    return table
