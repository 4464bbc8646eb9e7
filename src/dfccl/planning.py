"""How one collective runs: its path, protocol, channels and ring geometry.
A pure function of (kind, count, dtype, ranks, options), so every rank
computes the same answer without talking; the daemon checks that they agree
(the signature includes all of it).

The size table (docs/architecture.md, "Choosing a protocol"), for a
communicator whose peers are all reachable (direct or staged):

=====================================  ===========================================
per-rank piece / bytes one rank moves  protocol
=====================================  ===========================================
piece <= ll_max_bytes (AR, AG, RS;     LL: eager flagged stores, one channel
2..8 ranks)
moved <= one_shot_bytes (all-reduce)   direct, one phase (two if any rank is in place)
moved <= staged_max_bytes (staged)     direct (two-shot all-reduce)
above                                  ring (staged communicators); direct
                                       (in-process communicators)
=====================================  ===========================================

Across hosts (the ring) LL still takes the pieces up to ll_max_bytes, and
broadcasts up to it too (its rooted form: the root pushes, the others take
its lines): the network proxy carries the lines (docs/multi-node.md, "LL
across hosts").

Channels: one per ``bytes_per_channel`` bytes moved, at least two from
``two_channel_bytes`` (across hosts: the proxy's two lanes), at most the
communicator's; LL always one (channel_count)."""

from __future__ import annotations

from dataclasses import dataclass

from dfccl._native import layout
from dfccl._native.layout import (FIFO_UNIT_BYTES, KIND_ALL_GATHER, KIND_ALL_REDUCE, KIND_BROADCAST,
                                  KIND_REDUCE_SCATTER, LL_DEFAULT_MAX_BYTES, LL_HEADER_LINES, LL_LINE_BYTES,
                                  LL_LINE_PAYLOAD, LL_MAX_RANKS, PATH_DIRECT, PATH_RING, TASK_LL, TASK_ONE_SHOT,
                                  TASK_STAGED)
from dfccl.types import DataType

__all__ = ["Geometry", "plan_geometry", "channel_count", "LL_KINDS", "LL_MAX_RANKS", "ll_capable", "ll_region_bytes",
           "default_ll_max_bytes", "reserved_staging_bytes", "fifo_blocks", "clamp_slice"]

#: Collectives LL runs: the symmetric ones (every rank receives from every
#: rank), whose instance order alone keeps two parities of areas safe.
LL_KINDS = (KIND_ALL_REDUCE, KIND_ALL_GATHER, KIND_REDUCE_SCATTER)
# LL_MAX_RANKS (layout.h): a receiver finds its peers' buckets in its record
# header's cache (DFCCL_PEER_CACHE), and LL's per-peer pushes stop paying
# beyond a host's GPUs.


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
        the staged direct path's copies (a staged collective's slice and
        slots are the ring it falls back to, through the same staging or a
        reserved FIFO: docs/architecture.md, "Staging budget")."""
        return self.stage_bytes or self.nchannels * self.fifo_slots * self.slice_bytes


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


#: One part in this many of CommOptions.staging_bytes is reserved for the
#: minimum FIFOs of the tags that can be pending at once (fifo_blocks).
RESERVED_STAGING_DIVISOR = 4
_STAGING_ALIGN = 256


def reserved_staging_bytes(options) -> int:
    """Staging of a rank reserved for minimum FIFOs (the rest is shared)."""
    return options.staging_bytes // RESERVED_STAGING_DIVISOR // _STAGING_ALIGN * _STAGING_ALIGN


def fifo_blocks(reserved: int, tags: int, channels: int) -> tuple[int, int]:
    """(block bytes, blocks): the reserved staging cut into one block per
    tag that can be pending at once (``tags``), each at least the minimum
    FIFO of a collective of up to ``channels`` channels (two 16-byte slots
    per channel; any message loops through it).  Fewer blocks when
    ``reserved`` cannot hold that many."""
    least = _round_up(channels * 2 * FIFO_UNIT_BYTES, _STAGING_ALIGN)
    block = reserved // max(1, tags) // _STAGING_ALIGN * _STAGING_ALIGN
    if block >= least:
        return block, tags
    return least, reserved // least


def ring_slice_cap(nchannels: int, options) -> int:
    """Largest ring slice: max_slice_bytes, and small enough that a tag's
    FIFO (nchannels x ring_slots slices) is at most the shared staging //
    ring_tags, so that ring_tags tags get their planned FIFOs at once
    whatever their message sizes (the ring loops over a message through its
    FIFO)."""
    # A multiple of the staging pool's 256-byte allocation unit, so that
    # ring_tags FIFOs fit even after rounding up.
    shared = options.staging_bytes - reserved_staging_bytes(options)
    per_tag = shared // (options.ring_tags or 1) // _STAGING_ALIGN * _STAGING_ALIGN
    return max(256, min(options.max_slice_bytes, per_tag // (nchannels * options.ring_slots)) // 16 * 16)


def ll_capable(nranks: int, reach: bool) -> bool:
    """Whether a communicator can use LL at all: ``reach``, every peer's
    arena written to (mapped, direct or staged; or a mirror carried by the
    network proxy, across hosts), and 2..LL_MAX_RANKS ranks."""
    return reach and 2 <= nranks <= LL_MAX_RANKS


def ll_region_bytes(capacity: int, nranks: int, ll_max_bytes: int) -> int:
    """Bytes of the LL region of one rank's arena (layout.h,
    dfccl_ll_region_bytes): receive areas [bucket][sender][parity] of
    16 x (2 + ceil(ll_max_bytes / 8)) bytes, then acks [bucket][receiver] of
    8 bytes (256-aligned)."""
    return layout.ll_region_bytes(capacity, nranks, ll_max_bytes) if ll_max_bytes > 0 else 0


def default_ll_max_bytes(capacity: int, nranks: int, budget: int) -> int:
    """The largest multiple of 16 up to LL_DEFAULT_MAX_BYTES (layout.h) whose
    LL region fits ``budget`` (0 if not even 16 does)."""
    per_area = budget // max(1, capacity * nranks * 2)
    lines = per_area // LL_LINE_BYTES - LL_HEADER_LINES
    best = min(LL_DEFAULT_MAX_BYTES, max(0, lines * LL_LINE_PAYLOAD) // 16 * 16)
    while best > 0 and ll_region_bytes(capacity, nranks, best) > budget:
        best -= 16
    return best


def channel_count(moved: int, max_channels: int, options) -> int:
    """Channels of a collective that moves ``moved`` bytes per rank: one per
    options.bytes_per_channel, at least two from options.two_channel_bytes
    (when set), at least one, at most ``max_channels``."""
    nch = _ceil_div(moved, options.bytes_per_channel)
    if options.two_channel_bytes and moved >= options.two_channel_bytes:
        nch = max(nch, 2)
    return max(1, min(max_channels, nch))


def plan_geometry(kind: int, count: int, dtype: DataType, nranks: int, max_channels: int, direct: bool,
                  options, *, staged: bool = False, ll_reach: bool | None = None) -> Geometry:
    """``direct``: every peer is reachable for the direct path; ``staged``:
    through copies in the arenas (peers in other processes), up to
    ``options.staged_max_bytes``; ``ll_reach``: every peer's LL areas are
    (``direct`` when None; across hosts also, through the proxy)."""
    esize = dtype.itemsize
    # Bytes one rank moves through its channels: the whole buffer, or for
    # all-gather / reduce-scatter the n-times-larger side.
    total = count * esize * (nranks if kind in (KIND_ALL_GATHER, KIND_REDUCE_SCATTER) else 1)
    nch = channel_count(total, max_channels, options)
    if nranks == 1:
        return Geometry(PATH_DIRECT, nch)
    ll_max = options.ll_max_bytes or 0
    reach = direct if ll_reach is None else ll_reach
    # A broadcast takes LL only across hosts (reach without a direct path),
    # where the ring's fixed cost per instance is what it saves; on one host
    # the direct path reads the root's buffer in place.
    ll_kind = kind in LL_KINDS or (kind == KIND_BROADCAST and not direct)
    if options.protocol != "simple" and ll_kind and ll_capable(nranks, reach) and count * esize <= ll_max:
        return Geometry(PATH_DIRECT, 1, flags=TASK_LL)
    if direct and (not staged or total <= options.staged_max_bytes):
        # Small enough for one phase; the daemon still runs two phases when any
        # rank turns out to be in place (it learns that while meeting peers).
        flags = TASK_ONE_SHOT if (kind == KIND_ALL_REDUCE and total <= options.one_shot_bytes) else 0
        if staged:
            # At least a minimum FIFO: the staging is also the ring's if the
            # collective falls back to it.
            stage = max(staged_bytes(kind, count, esize, nranks), _round_up(nch * 2 * FIFO_UNIT_BYTES, _STAGING_ALIGN))
            return Geometry(PATH_DIRECT, nch, _ring_slice(kind, count, esize, nranks, nch, options), options.ring_slots,
                            flags=flags | TASK_STAGED, stage_bytes=stage)
        return Geometry(PATH_DIRECT, nch, flags=flags)
    return Geometry(PATH_RING, nch, _ring_slice(kind, count, esize, nranks, nch, options), options.ring_slots)


def _ring_slice(kind: int, count: int, esize: int, nranks: int, nch: int, options) -> int:
    """The ring's planned slice (bytes per FIFO slot)."""
    # Slices are cut from the largest channel part (the daemon splits
    # `count` into nch pack-aligned parts, cuda/daemon/transfer_common.cuh).
    align = max(1, 16 // esize)
    chan_elems = _round_up(_ceil_div(count, nch), align)
    chan_bytes = chan_elems * esize
    pieces = nranks if kind == KIND_ALL_REDUCE else (1 if kind in (KIND_ALL_GATHER, KIND_REDUCE_SCATTER)
                                                    else options.ring_slots)
    # FIFO slots hold whole 16-byte packs: the daemon cuts chunks on pack
    # boundaries, so a slot must be a multiple of 16 bytes.
    return clamp_slice(_round_up(_ceil_div(chan_bytes, pieces), 16), chan_bytes, ring_slice_cap(nch, options), options)


def clamp_slice(slice_bytes: int, chan_bytes: int, cap: int, options) -> int:
    """A slice of ``slice_bytes`` (a multiple of 16) for a channel of
    ``chan_bytes``: at least options.min_slice_bytes (at most the whole
    channel), at most ``cap``, never under 256 bytes."""
    floor = min(options.min_slice_bytes, _round_up(chan_bytes, 16))
    return max(256, min(cap, max(floor, slice_bytes)))
