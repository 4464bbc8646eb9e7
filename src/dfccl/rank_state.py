"""The state of one communicator rank that the threads watching it share
with it: whether it is closed, aborted or has lost a peer, the lock its
memory is read under, and what a lost peer does to it.  The Communicator owns
it; the liveness monitor (liveness.py) and the diagnostics that explain a
failure (diagnostics.py) are handed it, and touch the rank through it only;
the submission path (submission.py, plans.py) asks it whether the rank
takes collectives."""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from dfccl.errors import ClosedError, PeerLostError

if TYPE_CHECKING:
    from dfccl.diagnostics import EndpointDiagnostics
    from dfccl.endpoint import Endpoint
    from dfccl.flight import FlightRecorder

__all__ = ["RankState"]

_log = logging.getLogger("dfccl")


class RankState:
    """One rank's life: open, aborted, peer lost, closed (or its parent's,
    in a forked child)."""

    def __init__(self, *, rank: int, comm_key: int, where: str, endpoint: "Endpoint", daemon,
                 flight: "FlightRecorder", peer_timeout: float | None):
        self.rank = rank
        self.comm_key = comm_key
        self.where = where                 # "backend:device", for messages
        self.endpoint = endpoint
        self.daemon = daemon               # the device's daemon
        self.flight = flight
        self.peer_timeout = peer_timeout   # CommOptions.peer_timeout
        # Held by whoever reads this rank's arena or its mappings of the
        # peers' from another thread (the liveness monitor; the diagnostics
        # that explain a failure), and by close() while it marks the rank
        # closed, before any of that memory goes.  Reentrant: the monitor
        # reads through the diagnostics.
        self.lock = threading.RLock()
        self.closed = False
        self.aborted = False
        self.lost_rank: int | None = None
        self.lost_why = ""
        self.fault_reported = False   # its device failed and its peers were told (liveness.py)
        self.forked_from = 0          # in a forked child: the pid of the process this rank belongs to
        self.diagnostics: "EndpointDiagnostics | None" = None
        # A child a hierarchy split off (hierarchy.py): its parent's rank of
        # each of its ranks, and what it is, so that its messages speak of
        # the ranks the application knows.
        self.parent_ranks: tuple[int, ...] | None = None
        self.role = ""

    def check_open(self) -> None:
        """Raises unless the rank takes new collectives: PeerLostError once
        a peer is lost, ClosedError once it is closed (or its parent's, in a
        forked child) or aborted."""
        if self.lost_rank is not None and not self.closed:
            raise PeerLostError(f"rank {self.rank}: the communicator lost rank {self.lost_rank} "
                                f"({self.lost_why}); close it", rank=self.rank, origin=self.lost_rank)
        if self.closed:
            if self.forked_from:
                raise ClosedError(f"rank {self.rank}: this communicator belongs to process {self.forked_from}, "
                                  "which forked this process; a forked child cannot use its parent's communicators "
                                  "(create new ones in the child; on GPUs, start it with the 'spawn' method)",
                                  rank=self.rank)
            raise ClosedError(f"rank {self.rank}: the communicator is closed", rank=self.rank)
        if self.aborted:
            raise ClosedError(f"rank {self.rank}: the communicator was aborted", rank=self.rank)

    def attach(self, diagnostics: "EndpointDiagnostics") -> None:
        """Reads of the peers' records go under this rank's lock, and a loss
        they find is this rank's."""
        diagnostics.lock = self.lock
        diagnostics.on_peer_lost = self.relay_loss
        self.diagnostics = diagnostics

    def peer_lost(self, peer: int, why: str) -> None:
        """``peer``'s process died or stopped, or its device failed: every
        pending and later collective fails with PeerLostError."""
        if self.closed or self.lost_rank is not None:
            return
        self.lost_rank = peer
        self.lost_why = why
        if self.diagnostics is not None:
            self.diagnostics.lost_why[peer] = why   # what the daemon's PeerLostErrors say
        self.flight.note("peer_lost", detail=f"rank {peer} lost: {why}")
        if self.parent_ranks is not None:
            _log.warning("rank %d: peer rank %d is lost (%s): %s", self.parent_ranks[self.rank],
                         self.parent_ranks[peer], self.role, why)
        else:
            _log.warning("rank %d: peer rank %d is lost: %s", self.rank, peer, why)
        if not self.aborted and not self.daemon.closed:
            self.endpoint.abort(lost_rank=peer)
        self.aborted = True

    def relay_loss(self, peer: int) -> None:
        """A collective failed because a peer found ``peer`` lost first."""
        self.peer_lost(peer, "a peer found it lost (its process died or stopped, or its device failed)")

    def mark_closed(self) -> None:
        """No thread reads this rank's memory from now on."""
        with self.lock:
            self.closed = True
            if self.diagnostics is not None:
                self.diagnostics.closed = True

    def forked(self, parent_pid: int) -> None:
        """In a forked child: the rank is the parent's.  It counts as closed,
        and closing it does nothing: its memory, its status and its peers
        are the parent's."""
        self.forked_from = parent_pid
        self.closed = True
        self.lock = threading.RLock()   # another thread may have held it at the fork
        if self.diagnostics is not None:
            self.diagnostics.lock = self.lock
            self.diagnostics.closed = True
