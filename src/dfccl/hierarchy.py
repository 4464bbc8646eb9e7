"""Hierarchical collectives across hosts (docs/multi-node.md, "Hierarchical
collectives").

A communicator whose ranks span two hosts or more, the same number L >= 2
on each, builds two children at start-up: the ranks of its host (``local``,
the paths within a host) and the ranks of equal local index on every host
(``cross``, one per host: the network).  An all-reduce of at least
CommOptions.hierarchy_min_bytes whose count divides by L then runs as three
collectives of those children:

  1. reduce-scatter within the host: local rank j holds piece j reduced
     over its host;
  2. all-reduce of piece j across hosts, among the ranks of local index j;
  3. all-gather within the host: every rank holds every piece.

so each host sends 2 (H - 1) / H of the bytes over the network, spread over
L connections, where the ring sends 2 (n - 1) / n through one.  Where a
host's ranks are contiguous (rank = host x L + local index, as torchrun,
Slurm's block distribution and mpirun -H give), a reduce-scatter or an
all-gather of at least that many bytes (its n-times-larger side) runs the
same way with blocks of c elements, one per rank: a reduce-scatter as H
reduce-scatters within the host, the i-th over host i's L blocks (local
rank j then holds block i x L + j reduced over its host), and one
reduce-scatter of those H blocks across hosts; an all-gather as the
all-gather of this rank's block across hosts, then H all-gathers within
the host, the i-th of block i x L + j into host i's L blocks.  The H
blocks between the two steps live in scratch device memory of the
hierarchy's (ScratchPool).  Each host sends (H - 1) / H of the bytes over
the network, over L connections.

The parts are submitted together; the daemon runs each after the one
before (Daemon.submit's ``after``), as a task that is not ready yet:
gating them on the stream instead could deadlock two collectives issued in
opposite orders.  The last part's Work stands for the whole
(Work._as_whole): it fails with the first error of any part (Chain).

Every collective of such a communicator goes through Hierarchy.submit,
which keeps its tag's order whichever way each call runs: a tag's
instances run in order, but the parts have the children's tags, so the
first part runs after the tag's last collective here (of any kind), and a
collective on the communicator's own path runs after the tag's last
hierarchical one (``order_after``).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from dfccl._native.layout import KIND_ALL_GATHER, KIND_ALL_REDUCE, KIND_REDUCE_SCATTER
from dfccl._native.work import Work
from dfccl.buffers import Buffer
from dfccl.errors import DfcclError, PeerAbortedError, PeerLostError
from dfccl.flight import PendingStatus
from dfccl.streams import stream_handle
from dfccl.types import ReduceOp

__all__ = ["HostLayout", "host_layout", "HierarchyInfo", "Hierarchy", "Chain", "ScratchPool"]

#: How long a rank that could not submit every part waits for its children's
#: pending collectives to fail before it fails them on the host.
_GIVE_UP_S = 5.0

#: Tags whose last collective a hierarchy remembers before it forgets
#: those that completed (Hierarchy.submit).
_LAST_KEPT = 1024

#: The kinds a hierarchy runs, by their names.
_KINDS = {"all_reduce": KIND_ALL_REDUCE, "reduce_scatter": KIND_REDUCE_SCATTER, "all_gather": KIND_ALL_GATHER}
_NAMES = {kind: name for name, kind in _KINDS.items()}

#: Scratch areas are powers of two of at least this many bytes
#: (ScratchPool), so that calls of many sizes share few areas.
_SCRATCH_MIN_BYTES = 1 << 20


@dataclass(frozen=True)
class HostLayout:
    """Where the ranks of a communicator are: ``host[r]`` numbers rank r's
    host (by its lowest rank), ``local[r]`` is r's place among its host's
    ranks (by rank), ``per_host`` the ranks each host holds."""

    host: tuple[int, ...]
    local: tuple[int, ...]
    per_host: int

    @property
    def hosts(self) -> int:
        return len(self.host) // self.per_host

    @property
    def contiguous(self) -> bool:
        """Whether each host's ranks are contiguous: rank = host x
        per_host + local index (what reduce-scatters and all-gathers need
        to take the hierarchy)."""
        return all(h == r // self.per_host for r, h in enumerate(self.host))

    def host_ranks(self, rank: int) -> tuple[int, ...]:
        """The ranks of ``rank``'s host (its local child, by rank)."""
        return tuple(r for r in range(len(self.host)) if self.host[r] == self.host[rank])

    def index_ranks(self, rank: int) -> tuple[int, ...]:
        """The ranks of ``rank``'s place on every host (its cross child, by rank)."""
        return tuple(r for r in range(len(self.local)) if self.local[r] == self.local[rank])


@dataclass(frozen=True)
class HierarchyInfo:
    """What Communicator.hierarchy reports: ``hosts`` x ``per_host`` ranks;
    all-reduces of at least ``min_bytes`` per rank (whose count divides by
    ``per_host``) run hierarchically, and where ``blocks`` (each host's
    ranks contiguous) reduce-scatters and all-gathers whose larger side
    (all ranks' blocks) is at least ``min_bytes``; ``all_reduces``,
    ``reduce_scatters`` and ``all_gathers`` have so far on this rank."""

    hosts: int
    per_host: int
    min_bytes: int
    all_reduces: int
    blocks: bool = False
    reduce_scatters: int = 0
    all_gathers: int = 0

    def takes(self, count: int, itemsize: int, kind: str = "all_reduce") -> bool:
        """Whether a collective ``kind`` ("all_reduce", "reduce_scatter" or
        "all_gather") of ``count`` elements of ``itemsize`` bytes per rank
        (a reduce-scatter's or all-gather's block) runs hierarchically
        (unless its stream captures a graph)."""
        if kind not in _KINDS:
            raise ValueError(f"HierarchyInfo.takes: kind must be one of {sorted(_KINDS)}, not {kind!r}")
        return _takes(_KINDS[kind], count, itemsize, self.min_bytes, self.per_host, self.hosts, self.blocks)


def _takes(kind: int, count: int, itemsize: int, min_bytes: int, per_host: int, hosts: int, blocks: bool) -> bool:
    """The rule: an all-reduce of at least ``min_bytes`` per rank whose
    count L divides; a reduce-scatter or all-gather of a block per rank
    whose n blocks hold at least ``min_bytes``, where ``blocks``."""
    if kind == KIND_ALL_REDUCE:
        return count * itemsize >= min_bytes and count % per_host == 0
    if kind in (KIND_REDUCE_SCATTER, KIND_ALL_GATHER):
        return blocks and count > 0 and count * per_host * hosts * itemsize >= min_bytes
    return False


def host_layout(host_ids: Sequence[object]) -> HostLayout | None:
    """The layout of ranks whose hosts are ``host_ids`` (by rank) where a
    hierarchy pays and works: two hosts or more, the same number of ranks
    (two or more) on each; None otherwise."""
    first: dict[object, int] = {}
    members: list[list[int]] = []
    host, local = [], []
    for r, h in enumerate(host_ids):
        if h not in first:
            first[h] = len(members)
            members.append([])
        i = first[h]
        host.append(i)
        local.append(len(members[i]))
        members[i].append(r)
    sizes = {len(m) for m in members}
    if len(members) < 2 or len(sizes) != 1 or sizes == {1}:
        return None
    return HostLayout(tuple(host), tuple(local), sizes.pop())


class Chain:
    """The parts of one hierarchical collective, as its last part's Work
    reports them: its error is the first error of any part, reworded for
    the communicator it was called on (which ranks the part's numbers are)."""

    __slots__ = ("_parts", "_rank", "_whole")

    def __init__(self, parts: tuple, rank: int, whole: str) -> None:
        self._parts = parts   # (phase, Work, parent rank of each rank of the part's child)
        self._rank = rank
        self._whole = whole

    def error(self, last: BaseException | None) -> BaseException | None:
        """The whole's error, given the last part's own (None: it succeeded)."""
        # Complete (the last part ran after them); each is kept until the
        # one after it retired (Daemon.submit's followed), so from the last.
        for _phase, work, _ranks in reversed(self._parts[:-1]):
            work.done()
        for phase, work, ranks in self._parts[:-1]:
            e = work.exception()
            if e is not None:
                return self._reword(phase, ranks, e)
        return None if last is None else self._reword(self._parts[-1][0], self._parts[-1][2], last)

    def part_stats(self, last: dict) -> list[dict]:
        """Each part's Work.stats with its ``phase``, in the order they ran
        (``last``: the last part's own, which stands for the whole)."""
        out = []
        for phase, work, _ranks in self._parts[:-1]:
            work.done()   # retires it (it completed before the last part)
            out.append({"phase": phase, **(work.stats or {})})
        out.append({"phase": self._parts[-1][0], **last})
        return out

    def timeout_error(self, timeout) -> BaseException:
        """What the first part that has not completed waits for."""
        for i, (phase, work, ranks) in enumerate(self._parts):
            if not work.done():
                out = self._reword(phase, ranks, work._describe_timeout(timeout))
                if i == 0 and getattr(out, "missing_ranks", None):
                    # The likeliest reason besides a rank that has not called it yet.
                    out.args = (f"{out.args[0]}; a rank that called this collective with another size or dtype "
                                "may be running it on the ring instead (below hierarchy_min_bytes, or an "
                                "all-reduce whose count its host's rank count does not divide), waiting for this "
                                "rank there",)
                return out
        phase, work, ranks = self._parts[-1]
        return self._reword(phase, ranks, work._describe_timeout(timeout))

    def _reword(self, phase: str, ranks: tuple[int, ...], e: BaseException) -> BaseException:
        """``e`` (a part's, in its child's rank numbers) as the whole's."""
        def parent(r):
            return ranks[r] if isinstance(r, int) and 0 <= r < len(ranks) else r
        numbering = ", ".join(f"{i} is rank {p}" for i, p in enumerate(ranks))
        why = ""
        origin = getattr(e, "origin", None)
        if isinstance(e, PeerLostError) and origin is not None:
            why = f"rank {parent(origin)} is lost; "
        elif isinstance(e, PeerAbortedError) and origin is not None:
            why = f"rank {parent(origin)} gave its part up; "
        out = copy.copy(e)
        out.args = (f"rank {self._rank}: {self._whole} failed in its {phase}: {why}that part said: {e} (its ranks: "
                    f"{numbering})",)
        if isinstance(out, DfcclError):
            out.rank = self._rank
        # Instance attributes only (``peer`` of PeerLostError is ``origin``'s alias).
        for name, value in vars(out).items():
            if name in ("origin", "peer", "waiting_on") and value is not None:
                setattr(out, name, parent(value))
            elif name in ("missing_ranks", "joined_ranks") and value is not None:
                setattr(out, name, [parent(r) for r in value])
        out.__cause__ = e
        return out


class ScratchPool:
    """Device memory for the blocks a hierarchical reduce-scatter or
    all-gather holds between its parts.  An area goes back to the pool once
    the collective that held it succeeded (after a failure a peer may not
    be done with it: it stays out), and is freed only when the hierarchy
    closes: freeing device memory can wait for the device, where the
    daemon runs collectives that this thread may still have to submit the
    peers of.  Areas are powers of two, taken without zeroing
    (docs/multi-node.md, "Hierarchical collectives")."""

    __slots__ = ("_device", "_free", "_held", "_lock")

    def __init__(self, device) -> None:
        self._device = device
        self._lock = threading.Lock()   # threads of one rank may submit at once
        self._free: list[tuple[int, int]] = []   # (nbytes, address)
        # (nbytes, address, the Work holding it; None: not submitted whole, held until close)
        self._held: list[tuple[int, int, Work | None]] = []

    def take(self, nbytes: int) -> tuple[int, int]:
        """An area of at least ``nbytes`` (nbytes, address), held until
        close unless hold() names the Work it waits for."""
        with self._lock:
            self._reclaim()
            fits = [a for a in self._free if a[0] >= nbytes]
            if fits:
                area = min(fits)
                self._free.remove(area)
            else:
                size = max(_SCRATCH_MIN_BYTES, 1 << (nbytes - 1).bit_length())
                area = (size, self._device.alloc_device(size, zeroed=False))
            self._held.append((area[0], area[1], None))
            return area

    def hold(self, area: tuple[int, int], work: Work) -> None:
        """``area`` (take()'s) stays out until ``work`` succeeded."""
        with self._lock:
            self._held = [h if h[1] != area[1] else (h[0], h[1], work) for h in self._held]

    def _reclaim(self) -> None:
        """Areas whose collectives succeeded back to the free list (the lock held)."""
        keep = []
        for nbytes, address, work in self._held:
            if work is not None and work.done() and work.exception() is None:
                self._free.append((nbytes, address))
            else:
                keep.append((nbytes, address, work))
        self._held = keep

    def close(self) -> None:
        """Frees the free areas and those whose collectives completed, any
        way (after the children closed: nothing runs them now); an area of a
        collective still pending, or one never submitted whole, goes with
        the process."""
        with self._lock:
            for _nbytes, address in self._free:
                self._device.free_device(address)
            self._free = []
            keep = []
            for nbytes, address, work in self._held:
                if work is not None and work.done():
                    self._device.free_device(address)
                else:
                    keep.append((nbytes, address, work))
            self._held = keep



class Hierarchy:
    """The children of a communicator that spans hosts and the collectives
    it runs through them.  Built by the communicator (``Hierarchy.create``),
    closed with it."""

    def __init__(self, *args, **kwargs) -> None:
        raise TypeError("Hierarchy is built by its communicator (Hierarchy.create)")

    @classmethod
    def create(cls, *, rank: int, layout: HostLayout, min_bytes: int, submitter, local, cross, local_submitter,
               cross_submitter, daemon) -> "Hierarchy":
        """The hierarchy of one rank of a communicator that spans hosts.

        Args:
            rank: this rank in the communicator.
            layout: where its ranks are (host_layout).
            min_bytes: smallest collective that takes it (bytes per rank of
                an all-reduce, of all ranks' blocks of the others).
            submitter: the communicator's own (its path for the rest).
            local, cross: the children (this host's ranks; the ranks of this
                rank's local index), ranked by parent rank.
            local_submitter, cross_submitter: their submitters.
            daemon: the daemon every rank of this process on this device
                shares (the children's too).
        """
        self = object.__new__(cls)
        self._rank = rank
        self._per_host = layout.per_host
        self._hosts = layout.hosts
        self._runs = dict.fromkeys(_NAMES, 0)   # hierarchical collectives so far, by kind
        self._blocks = layout.contiguous
        self._local_index = layout.local[rank]
        self._min_bytes = min_bytes
        self.local, self.cross = local, cross
        self._sub = submitter
        self._local_sub, self._cross_sub = local_submitter, cross_submitter
        self._last: dict[int, tuple[Work, bool]] = {}   # by tag key: its last collective, whether hierarchical
        self._daemon = daemon
        self._scratch = ScratchPool(daemon.device)
        self.broken = False   # a part could not be submitted: the children were aborted
        self.local_ranks = layout.host_ranks(rank)   # the parent's rank of each rank of `local`
        self.cross_ranks = layout.index_ranks(rank)   # ... and of `cross`
        return self

    def info(self) -> HierarchyInfo:
        return HierarchyInfo(self._hosts, self._per_host, self._min_bytes, self._runs[KIND_ALL_REDUCE],
                             self._blocks, self._runs[KIND_REDUCE_SCATTER], self._runs[KIND_ALL_GATHER])

    def takes(self, kind: int, count: int, itemsize: int) -> bool:
        """Whether a collective ``kind`` of ``count`` elements per rank runs
        hierarchically (the stream is checked at submission: _chain)."""
        return _takes(kind, count, itemsize, self._min_bytes, self._per_host, self._hosts, self._blocks)

    def submit(self, kind: int, s: Buffer, r: Buffer, count: int, op: ReduceOp, root: int, tag, stream) -> Work:
        """Submits one collective of the communicator (checked arguments,
        as Submitter.submit takes them): one that takes() it as its parts,
        anything else on the communicator's own path, in its tag's order
        either way (the module docstring).

        Returns:
            Its Work (a hierarchical one's: the last part's, standing for
            the whole).
        """
        if self.takes(kind, count, s.dtype.itemsize):
            key = self._sub.key(tag)
            work = self._chain(kind, s, r, count, op, tag, stream, self._last.get(key, (None, False))[0])
            if work is not None:
                return self._remember(key, work, True)
        return self.in_order(tag, lambda order_after: self._sub.submit(kind, s, r, count, op, root, tag, stream,
                                                                       order_after=order_after))

    def in_order(self, tag, submit: Callable[[Work | None], Work]) -> Work:
        """A collective of ``tag`` on the communicator's own path, in its
        tag's order: ``submit(order_after)`` submits it after
        ``order_after``, the tag's last hierarchical collective where that
        was the tag's last collective (else None: after its own path's
        last, the tag's order holds as is).

        Returns:
            What ``submit`` returned.
        """
        key = self._sub.key(tag)
        last, last_hierarchical = self._last.get(key, (None, False))
        return self._remember(key, submit(last if last_hierarchical else None), False)

    def _remember(self, key: int, work: Work, hierarchical: bool) -> Work:
        """``work`` as its tag's last collective here."""
        if work.captured:
            return work   # a captured collective has a tag of its own (docs/architecture.md, "CUDA graphs")
        if len(self._last) >= _LAST_KEPT:
            self._last = {k: v for k, v in self._last.items() if not v[0].done()}
        self._last[key] = (work, hierarchical)
        return work

    def _parts(self, kind: int, s: Buffer, r: Buffer, count: int, scratch: Buffer | None) -> list[tuple]:
        """The parts of a hierarchical ``kind`` (the module docstring), in
        the order they run: (phase, child's submitter, kind, send, recv,
        count, the parent's rank of each rank of the child)."""
        loc, crs, L = self._local_sub, self._cross_sub, self._per_host
        if kind == KIND_ALL_REDUCE:
            piece = count // L
            mine = r.view(self._local_index * piece, piece)
            return [("reduce-scatter within the host", loc, KIND_REDUCE_SCATTER, s, mine, piece, self.local_ranks),
                    ("all-reduce across hosts", crs, KIND_ALL_REDUCE, mine, mine, piece, self.cross_ranks),
                    ("all-gather within the host", loc, KIND_ALL_GATHER, mine, r, piece, self.local_ranks)]
        # Block i x L + j of the n: scratch block i on local rank j.
        def within(i):
            return f"within the host, of host {i}'s blocks"
        if kind == KIND_REDUCE_SCATTER:
            return [(f"reduce-scatter {within(i)}", loc, KIND_REDUCE_SCATTER, s.view(i * L * count, L * count),
                     scratch.view(i * count, count), count, self.local_ranks) for i in range(self._hosts)] + \
                   [("reduce-scatter across hosts", crs, KIND_REDUCE_SCATTER, scratch, r, count, self.cross_ranks)]
        return [("all-gather across hosts", crs, KIND_ALL_GATHER, s, scratch, count, self.cross_ranks)] + \
               [(f"all-gather {within(i)}", loc, KIND_ALL_GATHER, scratch.view(i * count, count),
                 r.view(i * L * count, L * count), count, self.local_ranks) for i in range(self._hosts)]

    def _chain(self, kind: int, s: Buffer, r: Buffer, count: int, op: ReduceOp, tag, stream,
               order_after: Work | None) -> Work | None:
        """Submits the parts of collective ``kind`` (takes() holds), each
        after the one before; the last part's Work, standing for the whole.
        ``order_after``: the last collective of the tag before it, which
        its first part runs after.  None where the stream captures a CUDA
        graph (each replay would need its own chain): the communicator's
        own path takes it."""
        if stream is not None and self._daemon.device.is_capturing(stream_handle(stream)):
            return None
        area = scratch = None
        if kind != KIND_ALL_REDUCE:
            nbytes = self._hosts * count * s.dtype.itemsize
            area = self._scratch.take(nbytes)
            scratch = Buffer.from_pointer(area[1], self._hosts * count, s.dtype,
                                          device=r.device if r.device_type == "cuda" else None)
        parts = self._parts(kind, s, r, count, scratch)
        works: list[Work] = []
        try:
            for i, (_phase, sub, part_kind, ps, pr, pcount, _ranks) in enumerate(parts):
                works.append(sub.submit(part_kind, ps, pr, pcount, op, 0, tag, stream,
                                        key=sub.part_key(tag, (_NAMES[kind], i)), followed=i < len(parts) - 1,
                                        after=works[-1] if works else None,
                                        order_after=order_after if not works else None))
        except BaseException:
            # Peers would wait for ever for the parts this rank could not
            # submit: it gives up on both children, which fails theirs
            # (PeerAbortedError), and the caller aborts the communicator.
            if works:
                self._daemon.unfollow(works[-1])
            self.broken = True   # a scratch area taken stays out until close
            self.abort(_GIVE_UP_S)
            raise
        last = works[-1]
        if area is not None:
            self._scratch.hold(area, last)
        chain = Chain(tuple((p[0], w, p[6]) for p, w in zip(parts, works)), self._rank, f"{_NAMES[kind]} {last.name}")
        last._as_whole(chain, _NAMES[kind], tag, self._rank)
        self._runs[kind] += 1
        return last

    def pending(self) -> list[PendingStatus]:
        """The parts pending on this rank, as Communicator.status() lists
        them: named as parts, their ranks given in the parent's numbers."""
        out = []
        for child, ranks, where in ((self.local, self.local_ranks, "within the host"),
                                    (self.cross, self.cross_ranks, "across hosts")):
            def parent(r, ranks=ranks):
                return ranks[r] if r is not None and 0 <= r < len(ranks) else r
            for p in child.status().pending:
                out.append(replace(p, kind=f"{p.kind} {where} (part of a hierarchical collective)",
                                   waiting_for=parent(p.waiting_for),
                                   joined_ranks=None if p.joined_ranks is None else [parent(r) for r in p.joined_ranks],
                                   missing_ranks=None if p.missing_ranks is None
                                   else [parent(r) for r in p.missing_ranks]))
        return out

    def abort(self, timeout: float) -> None:
        for child in (self.cross, self.local):
            child.abort(timeout)

    def close(self, timeout: float) -> None:
        for child in (self.cross, self.local):
            child.close(timeout)
        self._scratch.close()
