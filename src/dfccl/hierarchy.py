"""Hierarchical all-reduce across hosts (docs/multi-node.md, "Hierarchical
all-reduce").

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
L connections, where the ring sends 2 (n - 1) / n through one.  The three
are submitted together; the daemon runs the second after the first and the
third after the second (Daemon.submit's ``after``), as a task that is not
ready yet: gating them on the stream instead could deadlock two all-reduces
issued in opposite orders.  The last part's Work stands for the whole
(Work._as_whole): it fails with the first error of any part (Chain).

Every collective of such a communicator goes through Hierarchy.submit,
which keeps its tag's order whichever way each call runs: a tag's
instances run in order, but the parts have the children's tags, so the
first part runs after the tag's last collective here (of any kind), and a
collective on the communicator's own path runs after the tag's last
hierarchical all-reduce (``order_after``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from dfccl._native.layout import KIND_ALL_GATHER, KIND_ALL_REDUCE, KIND_REDUCE_SCATTER
from dfccl._native.work import Work
from dfccl.buffers import Buffer
from dfccl.errors import DfcclError, PeerAbortedError, PeerLostError
from dfccl.flight import PendingStatus
from dfccl.streams import stream_handle
from dfccl.types import ReduceOp

__all__ = ["HostLayout", "host_layout", "HierarchyInfo", "Hierarchy", "Chain"]

#: How long a rank that could not submit every part waits for its children's
#: pending collectives to fail before it fails them on the host.
_GIVE_UP_S = 5.0

#: Tags whose last collective a hierarchy remembers before it forgets
#: those that completed (Hierarchy.submit).
_LAST_KEPT = 1024

#: The parts, in the order the daemon runs them.
_PHASES = ("reduce-scatter within the host", "all-reduce across hosts", "all-gather within the host")


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
    ``per_host``) run hierarchically; ``all_reduces`` have so far on this
    rank."""

    hosts: int
    per_host: int
    min_bytes: int
    all_reduces: int

    def takes(self, count: int, itemsize: int) -> bool:
        """Whether an all-reduce of ``count`` elements of ``itemsize``
        bytes runs hierarchically (unless its stream captures a graph)."""
        return _takes(count, itemsize, self.min_bytes, self.per_host)


def _takes(count: int, itemsize: int, min_bytes: int, per_host: int) -> bool:
    """The rule: at least ``min_bytes`` per rank, a count L divides."""
    return count * itemsize >= min_bytes and count % per_host == 0


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
    """The parts of one hierarchical all-reduce, as its last part's Work
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

    def timeout_error(self, timeout) -> BaseException:
        """What the first part that has not completed waits for."""
        for i, (phase, work, ranks) in enumerate(self._parts):
            if not work.done():
                out = self._reword(phase, ranks, work._describe_timeout(timeout))
                if i == 0 and getattr(out, "missing_ranks", None):
                    # The likeliest reason besides a rank that has not called it yet.
                    out.args = (f"{out.args[0]}; a rank that called this all-reduce with another size or dtype "
                                "may be running it on the ring instead (below hierarchy_min_bytes, or a count its "
                                "host's rank count does not divide), waiting for this rank there",)
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


class Hierarchy:
    """The children of a communicator that spans hosts and the all-reduces
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
            min_bytes: smallest all-reduce (bytes per rank) that takes it.
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
        self._runs = 0
        self._local_index = layout.local[rank]
        self._min_bytes = min_bytes
        self.local, self.cross = local, cross
        self._sub = submitter
        self._local_sub, self._cross_sub = local_submitter, cross_submitter
        self._last: dict[int, tuple[Work, bool]] = {}   # by tag key: its last collective, whether hierarchical
        self._daemon = daemon
        self.broken = False   # a part could not be submitted: the children were aborted
        self.local_ranks = layout.host_ranks(rank)   # the parent's rank of each rank of `local`
        self.cross_ranks = layout.index_ranks(rank)   # ... and of `cross`
        return self

    def info(self) -> HierarchyInfo:
        return HierarchyInfo(self._hosts, self._per_host, self._min_bytes, self._runs)

    def takes(self, count: int, itemsize: int) -> bool:
        """Whether an all-reduce of ``count`` elements runs hierarchically
        (the stream is checked at submission: all_reduce)."""
        return _takes(count, itemsize, self._min_bytes, self._per_host)

    def submit(self, kind: int, s: Buffer, r: Buffer, count: int, op: ReduceOp, root: int, tag, stream) -> Work:
        """Submits one collective of the communicator (checked arguments,
        as Submitter.submit takes them): an all-reduce that takes() it as
        three parts, anything else on the communicator's own path, in its
        tag's order either way (the module docstring).

        Returns:
            Its Work (a hierarchical one's: the last part's, standing for
            the whole).
        """
        if kind == KIND_ALL_REDUCE and self.takes(count, s.dtype.itemsize):
            key = self._sub.key(tag)
            work = self._all_reduce(s, r, op, tag, stream, self._last.get(key, (None, False))[0])
            if work is not None:
                return self._remember(key, work, True)
        return self.in_order(tag, lambda order_after: self._sub.submit(kind, s, r, count, op, root, tag, stream,
                                                                       order_after=order_after))

    def in_order(self, tag, submit: Callable[[Work | None], Work]) -> Work:
        """A collective of ``tag`` on the communicator's own path, in its
        tag's order: ``submit(order_after)`` submits it after
        ``order_after``, the tag's last hierarchical all-reduce where that
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

    def _all_reduce(self, s: Buffer, r: Buffer, op: ReduceOp, tag, stream, order_after: Work | None
                    ) -> Work | None:
        """Submits the three parts of recv = op(send) (takes() holds); the
        last part's Work, standing for the whole.  ``order_after``: the last
        collective of the tag before it, which its first part runs after.
        None where the stream captures a CUDA graph (each replay would need
        its own chain): the communicator's own path takes it."""
        if stream is not None and self._daemon.device.stream_capturing(stream_handle(stream)):
            return None
        piece = s.count // self._per_host
        mine = r.view(self._local_index * piece, piece)
        loc, crs = self._local_sub, self._cross_sub
        w1 = loc.submit(KIND_REDUCE_SCATTER, s, mine, piece, op, 0, tag, stream,
                        key=loc.part_key(tag, 1), followed=True, order_after=order_after)
        last = w1
        try:
            w2 = crs.submit(KIND_ALL_REDUCE, mine, mine, piece, op, 0, tag, stream,
                            key=crs.part_key(tag, 2), after=w1, followed=True)
            last = w2
            w3 = loc.submit(KIND_ALL_GATHER, mine, r, piece, op, 0, tag, stream,
                            key=loc.part_key(tag, 3), after=w2)
        except BaseException:
            # Peers would wait for ever for the parts this rank could not
            # submit: it gives up on both children, which fails theirs
            # (PeerAbortedError), and the caller aborts the communicator.
            self._daemon.unfollow(last)
            self.broken = True
            self.abort(_GIVE_UP_S)
            raise
        chain = Chain(((_PHASES[0], w1, self.local_ranks), (_PHASES[1], w2, self.cross_ranks),
                       (_PHASES[2], w3, self.local_ranks)), self._rank, f"all_reduce {w3.name}")
        w3._as_whole(chain, "all_reduce", tag, self._rank)
        self._runs += 1
        return w3

    def pending(self) -> list[PendingStatus]:
        """The parts pending on this rank, as Communicator.status() lists
        them: named as parts, their ranks given in the parent's numbers."""
        out = []
        for child, ranks, where in ((self.local, self.local_ranks, "within the host"),
                                    (self.cross, self.cross_ranks, "across hosts")):
            def parent(r, ranks=ranks):
                return ranks[r] if r is not None and 0 <= r < len(ranks) else r
            for p in child.status().pending:
                out.append(replace(p, kind=f"{p.kind} {where} (part of a hierarchical all_reduce)",
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
