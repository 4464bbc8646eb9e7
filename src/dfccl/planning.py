"""How one collective runs: its path, channels and ring geometry.  A pure
function of (kind, count, dtype, ranks, options), so every rank computes the
same answer without talking; the daemon checks that they agree (the
signature includes all of it)."""

from __future__ import annotations

from dataclasses import dataclass

from dfccl._native.context import (KIND_ALL_GATHER, KIND_ALL_REDUCE, KIND_REDUCE_SCATTER, PATH_DIRECT, PATH_RING,
                                   TASK_ONE_SHOT, TASK_STAGED)
from dfccl.types import DataType

__all__ = ["Geometry", "plan_geometry"]


@dataclass(frozen=True)
class Geometry:
    path: int
    nchannels: int
    slice_bytes: int = 0
    fifo_slots: int = 0
    flags: int = 0
    stage_bytes: int = 0

    @property
    def fifo_bytes(self) -> int:
        """Staging the collective needs in this rank's arena: ring FIFOs, or
        the staged direct path's copies."""
        return self.nchannels * self.fifo_slots * self.slice_bytes + self.stage_bytes


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _ceil_div(a, b) * b


def staged_bytes(kind: int, count: int, itemsize: int, nranks: int) -> int:
    """Arena bytes of the staged direct path: the input copy (256-byte
    aligned), then for an all-reduce the reduced-segment copy
    (cuda/daemon/transfer_direct.cuh, stage_out_offset)."""
    in_bytes = count * itemsize * (nranks if kind == KIND_REDUCE_SCATTER else 1)
    out_bytes = count * itemsize if kind == KIND_ALL_REDUCE else 0
    return _round_up(in_bytes, 256) + _round_up(out_bytes, 256)


def ring_slice_cap(nchannels: int, options) -> int:
    """Largest ring slice: max_slice_bytes, and small enough that a tag's
    FIFO (nchannels x ring_slots slices) is at most staging_bytes //
    ring_tags, so that ring_tags tags fit in the staging at once whatever
    their message sizes (the ring loops over a message through its FIFO)."""
    # A multiple of the staging pool's 256-byte allocation unit, so that
    # ring_tags FIFOs fit even after rounding up.
    per_tag = options.staging_bytes // (options.ring_tags or 1) // 256 * 256
    return max(256, min(options.max_slice_bytes, per_tag // (nchannels * options.ring_slots)) // 16 * 16)


def plan_geometry(kind: int, count: int, dtype: DataType, nranks: int, max_channels: int, direct: bool,
                  options, *, staged: bool = False) -> Geometry:
    """``direct``: every peer is reachable for the direct path; ``staged``:
    through copies in the arenas (peers in other processes), up to
    ``options.staged_max_bytes``."""
    esize = dtype.itemsize
    # Bytes one rank moves through its channels: the whole buffer, or for
    # all-gather / reduce-scatter the n-times-larger side.
    total = count * esize * (nranks if kind in (KIND_ALL_GATHER, KIND_REDUCE_SCATTER) else 1)
    nch = max(1, min(max_channels, _ceil_div(total, options.bytes_per_channel)))
    if nranks == 1:
        return Geometry(PATH_DIRECT, nch)
    if direct and (not staged or total <= options.staged_max_bytes):
        # Small enough for one phase; the daemon still runs two phases when any
        # rank turns out to be in place (it learns that while meeting peers).
        flags = TASK_ONE_SHOT if (kind == KIND_ALL_REDUCE and total <= options.one_shot_bytes) else 0
        if staged:
            return Geometry(PATH_DIRECT, nch, flags=flags | TASK_STAGED,
                            stage_bytes=staged_bytes(kind, count, esize, nranks))
        return Geometry(PATH_DIRECT, nch, flags=flags)
    # Ring: slices are cut from the largest channel part (the daemon splits
    # `count` into nch pack-aligned parts, cuda/daemon/transfer_common.cuh).
    align = max(1, 16 // esize)
    chan_elems = _round_up(_ceil_div(count, nch), align)
    chan_bytes = chan_elems * esize
    pieces = nranks if kind == KIND_ALL_REDUCE else (1 if kind in (KIND_ALL_GATHER, KIND_REDUCE_SCATTER)
                                                    else options.ring_slots)
    slice_bytes = _round_up(_ceil_div(chan_bytes, pieces), 16)
    # FIFO slots hold whole 16-byte packs: the daemon cuts chunks on pack
    # boundaries, so a slot must be a multiple of 16 bytes.
    slice_bytes = max(256, min(ring_slice_cap(nch, options), slice_bytes))
    return Geometry(PATH_RING, nch, slice_bytes, options.ring_slots)
