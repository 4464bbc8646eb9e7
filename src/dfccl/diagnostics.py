"""Explaining a failure from what every rank published: the host reads its
peers' tag records and rank status (memory it maps for the daemon anyway) to
say which ranks have joined an instance, which field of a mismatched
signature differs and on which ranks, and whether a rank has left.

Reads only: nothing here writes peers' memory.  The layouts are abi.h's
(dfccl_rank_status at the start of each arena, then the tag table of
dfccl_chan_state records); the hashes come from cuda/include/dfccl/hash.h
through the compiled runtime."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from dfccl._native.layout import (ARENA_STATUS_BYTES, CHAN_INSTANCE_OFFSET, RANK_LIVE, RECORD_BYTES,
                                  RECORD_HEADER_BYTES, instance_token)
from dfccl.errors import ClosedError, MismatchError, collective_name
from dfccl.tags import home_bucket
from dfccl.types import KIND_NAMES, DataType, ReduceOp

if TYPE_CHECKING:
    from dfccl.endpoint import Endpoint

__all__ = ["EndpointDiagnostics", "instance_token", "decode_signature", "SIGNATURE_FIELDS"]

# Later instances of a tag a peer may already have published while ours is
# still pending (ring neighbours finish one instance before us).
_LOOKAHEAD = 8
# How long an explanation waits for one read of device memory.
READ_TIMEOUT_S = 0.5

# Seconds a mismatch report waits for ranks that have not published yet.
_PUBLISH_GRACE = 0.2

#: Fields of a published instance, in the order a mismatch is reported:
#: what the user passed first, then what the plan derived from it.
SIGNATURE_FIELDS = ("kind", "dtype", "op", "root", "count", "ranks", "path", "channels", "one_shot", "staged",
                    "slice_bytes")


def decode_signature(signature: int, count: int, slice_bytes: int) -> dict:
    """A published signature (task_signature in block_env.cuh) as named fields."""
    kind = signature & 0xF
    flags = signature >> 48
    return {
        "kind": KIND_NAMES.get(kind, kind),
        "dtype": _name(DataType, (signature >> 4) & 0xF),
        "op": _name(ReduceOp, (signature >> 8) & 0xF),
        "path": ("direct", "ring")[(signature >> 12) & 0xF] if (signature >> 12) & 0xF < 2 else (signature >> 12) & 0xF,
        "root": (signature >> 16) & 0xFFFF,
        "channels": (signature >> 32) & 0xFF,
        "ranks": (signature >> 40) & 0xFF,
        "one_shot": bool(flags & 1),
        "staged": bool(flags & 4),
        "count": count,
        "slice_bytes": slice_bytes,
    }


def _name(enum_type, value: int):
    try:
        return enum_type(value).name.lower()
    except ValueError:
        return value


class EndpointDiagnostics:
    """Reads what the ranks of one communicator published, as seen from one
    rank (``endpoint``)."""

    def __init__(self, endpoint: "Endpoint", arenas: list[int]):
        self._ep = endpoint
        self._device = endpoint.device
        self._arenas = list(arenas)
        self._capacity = endpoint.capacity
        self._buf = np.zeros(14, np.uint64)
        self.on_peer_lost = None   # set by the rank's RankState: called with the lost rank
        self.lost_why: dict[int, str] = {}   # lost rank -> why, where this host found out
        self.lock = None           # the communicator's teardown lock (reentrant)
        self.closed = False        # set under that lock before the memory goes

    def peer_lost(self, rank: int) -> None:
        """A collective failed because ``rank``'s process died (seen here, or
        relayed by a peer that saw it first)."""
        if self.on_peer_lost is not None:
            self.on_peer_lost(rank)

    # -- raw reads -------------------------------------------------------------------
    def _read(self, addr: int, words: int) -> list[int]:
        # Errors are explained on whichever thread asks first (often the
        # progress thread), possibly while the communicator closes and frees
        # the memory read here: reads happen under its teardown lock, and not
        # at all once it is closed (the caller falls back to a plainer message).
        lock = self.lock
        if lock is None:
            return self._read_now(addr, words)
        with lock:
            if self.closed:
                raise ClosedError("the communicator is closed: its records can no longer be read")
            return self._read_now(addr, words)

    def _read_now(self, addr: int, words: int) -> list[int]:
        # Bounded: an explanation must not wait for the collective it explains.
        self._device.read_device(self._buf.ctypes.data, addr, 8 * words, READ_TIMEOUT_S)
        return [int(v) for v in self._buf[:words]]

    def find_record(self, rank: int, key: int, instance: int = 0) -> int:
        """Address (as mapped here) of ``rank``'s record of ``key``, or 0:
        the daemon's probe_record, which passes over a record of the tag
        naming an older instance (on channel 0) for a later one naming
        ``instance`` or later (a bucket the tag held before keeps its key
        until its new owner publishes)."""
        table = self._arenas[rank] + ARENA_STATUS_BYTES
        b = home_bucket(key, self._capacity)
        first = 0
        for _ in range(self._capacity):
            rec = table + b * RECORD_BYTES
            k = self._read(rec, 1)[0]
            if k == 0:
                break
            if k == key:
                if self._read(rec + RECORD_HEADER_BYTES + CHAN_INSTANCE_OFFSET, 1)[0] >= instance:
                    return rec
                first = first or rec
            b = 0 if b + 1 == self._capacity else b + 1
        return first

    def published(self, rank: int, key: int, instance: int) -> dict | None:
        """What ``rank`` published on channel 0 for this instance (decoded
        signature), or None if it has not published it (yet)."""
        rec = self.find_record(rank, key, instance)
        if rec == 0:
            return None
        ready, signature, count, _s, _r, _f, _c, slice_bytes = self._read(rec + RECORD_HEADER_BYTES, 8)
        if ready != instance_token(key, instance):
            return None
        return decode_signature(signature, count, slice_bytes)

    def rank_state(self, rank: int) -> tuple[int, int, int]:
        """(state, heartbeat, pid) from the status at the start of ``rank``'s arena."""
        state, heartbeat, pid = self._read(self._arenas[rank], 3)
        return state, heartbeat, pid

    def rank_left(self, rank: int) -> bool:
        """Whether ``rank`` has aborted or closed."""
        if not 0 <= rank < len(self._arenas):
            return False
        return self.rank_state(rank)[0] != RANK_LIVE

    # -- explanations ------------------------------------------------------------------
    def joined_ranks(self, key: int, instance: int) -> tuple[list[int], list[int]]:
        """(ranks that have published this instance of the tag, or a later
        one; ranks that have not).  This rank counts as joined."""
        tokens = {instance_token(key, instance + i) for i in range(_LOOKAHEAD)}
        joined, missing = [], []
        for p in range(len(self._arenas)):
            if p == self._ep.rank:
                joined.append(p)
                continue
            rec = self.find_record(p, key, instance)
            ready = self._read(rec + RECORD_HEADER_BYTES, 1)[0] if rec else 0
            (joined if ready in tokens else missing).append(p)
        return joined, missing

    def mismatch_error(self, key: int, instance: int, kind: str, tag: object, rank: int) -> MismatchError | None:
        """The MismatchError of failed instance ``instance`` of tag ``key``
        (a ``kind`` of ``tag`` on ``rank``, as the message names it), naming
        the first field that differs, every rank's value of it and the ranks
        out of line; None if the records no longer show the difference (they
        moved on)."""
        n = len(self._arenas)
        seen: dict[int, dict] = {}
        # Peers that have submitted the instance publish it at their first
        # run; give them a moment (the error is built when first asked for).
        deadline = time.monotonic() + _PUBLISH_GRACE
        while True:
            for p in range(n):
                if p not in seen:
                    s = self.published(p, key, instance)
                    if s is not None:
                        seen[p] = s
            if len(seen) == n or time.monotonic() >= deadline:
                break
            time.sleep(0.002)
        if len(seen) < 2:
            return None
        differing = [f for f in SIGNATURE_FIELDS if len({s[f] for s in seen.values()}) > 1]
        if not differing:
            return None
        field = differing[0]
        values = {p: s[field] for p, s in sorted(seen.items())}
        groups: dict = {}
        for p, v in values.items():
            groups.setdefault(v, []).append(p)
        # In line: the largest group of equal values (ties: the one with the lowest rank).
        in_line = max(groups.values(), key=lambda ranks: (len(ranks), -ranks[0]))
        out = [p for p in values if p not in in_line]
        parts = []
        for v, ranks in sorted(groups.items(), key=lambda kv: kv[1][0]):
            who = f"rank {ranks[0]} has" if len(ranks) == 1 else f"ranks {ranks} have"
            parts.append(f"{who} {v}")
        not_yet = [p for p in range(len(self._arenas)) if p not in seen]
        msg = (f"rank {rank}: {kind} {collective_name(tag, instance)}: ranks submitted it with "
               f"different {field}: {', '.join(parts)}; out of line: ranks {out}")
        if len(differing) > 1:
            msg += f" (also differ: {', '.join(differing[1:])})"
        if not_yet:
            msg += f"; ranks {not_yet} had not submitted it"
        # peer: a rank whose value differs from this rank's.
        mine = values.get(rank)
        peer = next((p for p in out + in_line if values[p] != mine), None)
        return MismatchError(msg, rank=rank, tag=tag, peer=peer, field=field,
                             values=values, ranks=out)

