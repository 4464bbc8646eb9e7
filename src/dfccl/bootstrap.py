"""Start-up through the rendezvous store: ranks in any processes and hosts
exchange their arena descriptions, map each other, and agree that every rank
has (Communicator(unique_id, ...)); the same store carries split() and
register() exchanges.  A rank that fails tells the others through the store,
so that they fail at once, naming it, instead of at their deadline."""

from __future__ import annotations

import json
import logging
import time
from typing import Callable

from dfccl.errors import CollectiveTimeoutError, PeerAbortedError, StartupTimeoutError
from dfccl.store import StoreUnreachableError
from dfccl.unique_id import UniqueId

__all__ = ["StoreBootstrap", "gather_through_store", "STARTUP_LOG_INTERVAL"]

_log = logging.getLogger("dfccl")

#: Seconds between start-up progress lines (logger "dfccl", INFO).
STARTUP_LOG_INTERVAL = 5.0


def _publish_failure(store, prefix: str, rank: int, exc: BaseException, ep: bool) -> None:
    """Tells the other ranks that this one's start-up failed, so that they
    fail at once (PeerAbortedError naming it) instead of at their deadline."""
    failure = json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode()
    try:
        if ep:
            store.set(f"{prefix}/ep/{rank}", failure)
        store.set(f"{prefix}/ready/{rank}", failure)
    except Exception:
        pass  # the store is gone too: peers will time out, naming this rank


class StoreBootstrap:
    """One rank's start-up through the store of ``unique_id``, within one
    deadline for the whole of it (reaching the store, every rank arriving,
    every rank mapping its peers)."""

    def __init__(self, unique_id: UniqueId, rank: int, nranks: int, timeout: float, deadline: float):
        self.unique_id = unique_id
        self.rank = rank
        self.nranks = nranks
        self.timeout = timeout
        self.deadline = deadline
        self.prefix = f"comm/{unique_id.comm_key():016x}"
        #: This rank's description reached the store: peers may hold its
        #: arena's address from now on (its memory must outlive a failure).
        self.published = False

    def tell_peers(self, exc: BaseException) -> None:
        """Tells the peers of a failure before this rank reached the store."""
        try:
            with self.unique_id.connect(timeout=min(max(self.deadline - time.monotonic(), 0.05), 5.0)) as store:
                _publish_failure(store, self.prefix, self.rank, exc, True)
        except Exception:
            pass

    def run(self, description: dict, connect: Callable[[list[dict], Callable], None]) -> None:
        """Publishes ``description``, calls ``connect`` with every rank's once
        all have arrived, then waits until every rank has connected.
        ``connect`` also gets ``exchange(phase, value)``, which publishes
        this rank's ``value`` and returns every rank's (for what ranks can
        say only once they have seen the others: the network addresses of
        ranks on other hosts)."""
        uid, rank = self.unique_id, self.rank
        try:
            store = uid.connect(timeout=max(self.deadline - time.monotonic(), 0.05))
        except StoreUnreachableError as exc:
            raise StartupTimeoutError(
                f"rank {rank}: communicator start-up timed out after {self.timeout:g} s: could not reach the "
                f"rendezvous store at {uid.host}:{uid.port}; it runs in the process that called UniqueId.create(), "
                f"which has not started it yet or has exited ({exc})", rank=rank) from None
        with store:
            try:
                store.set(f"{self.prefix}/ep/{rank}", json.dumps(description).encode())
                self.published = True
                connect(self._gather(store, "ep"), lambda phase, value: self._exchange(store, phase, value))
                store.set(f"{self.prefix}/ready/{rank}", b"{}")
                self._gather(store, "ready")
            except BaseException as exc:
                _publish_failure(store, self.prefix, rank, exc, not self.published)
                raise

    def _exchange(self, store, phase: str, value: dict) -> list[dict]:
        store.set(f"{self.prefix}/{phase}/{self.rank}", json.dumps(value).encode())
        return self._gather(store, phase)

    def _gather(self, store, phase: str) -> list[dict]:
        """Every rank's value of ``phase``, waiting until the deadline at most
        (one deadline for the whole start-up, not one per peer), logging who is
        still missing every few seconds."""
        rank, n, deadline, timeout = self.rank, self.nranks, self.deadline, self.timeout
        keys = [f"{self.prefix}/{phase}/{p}" for p in range(n)]
        got: dict[int, dict] = {}
        start = deadline - timeout
        next_log = time.monotonic() + STARTUP_LOG_INTERVAL
        doing, did = {"ep": ("arrive", "arrived"), "net": ("start their network proxies", "started its proxy")}.get(
            phase, ("map their peers' memory", "mapped its peers"))
        while True:
            pending = [p for p in range(n) if p not in got]
            try:
                store.wait([keys[p] for p in pending],
                           timeout=max(0.0, min(deadline, next_log) - time.monotonic()))
            except CollectiveTimeoutError:
                pass
            for p in pending:   # which of them are here now
                try:
                    value = json.loads(store.get(keys[p], timeout=0))
                except CollectiveTimeoutError:
                    continue
                if "error" in value:
                    raise PeerAbortedError(f"rank {rank}: communicator start-up failed on rank {p}: {value['error']}",
                                           rank=rank, origin=p)
                got[p] = value
                _log.debug("rank %d: communicator start-up: rank %d %s (%.1f s)", rank, p, did,
                           time.monotonic() - start)
            missing = [p for p in range(n) if p not in got]
            if not missing:
                return [got[p] for p in range(n)]
            now = time.monotonic()
            if now >= deadline:
                arrived = sorted(got)
                what = "have not arrived" if phase == "ep" else "arrived but have not mapped their peers' memory"
                raise StartupTimeoutError(
                    f"rank {rank}: communicator start-up timed out after {timeout:g} s: ranks {missing} {what} "
                    f"(ranks {arrived} have)", rank=rank, missing_ranks=missing, arrived_ranks=arrived)
            if now >= next_log:
                _log.info("rank %d: communicator start-up: waiting for ranks %s to %s (%.0f s of %g s)", rank,
                          missing, doing, now - start, timeout)
                next_log = now + STARTUP_LOG_INTERVAL


def gather_through_store(store, prefix: str, rank: int, nranks: int, value: dict, deadline: float,
                         timeout: float, what: str = "split") -> list[dict]:
    """Publishes ``value`` under prefix/rank and returns every rank's value,
    waiting until ``deadline``; names the ranks missing at the deadline."""
    store.set(f"{prefix}/{rank}", json.dumps(value).encode())
    keys = [f"{prefix}/{p}" for p in range(nranks)]
    try:
        store.wait(keys, timeout=max(0.0, deadline - time.monotonic()))
    except CollectiveTimeoutError:
        pass
    got, missing = [], []
    for p, k in enumerate(keys):
        try:
            got.append(json.loads(store.get(k, timeout=0)))
        except CollectiveTimeoutError:
            missing.append(p)
    if missing:
        arrived = [p for p in range(nranks) if p not in missing]
        raise StartupTimeoutError(f"rank {rank}: {what} timed out after {timeout:g} s: ranks {missing} have "
                                  f"not called {what} (ranks {arrived} have)", rank=rank, missing_ranks=missing,
                                  arrived_ranks=arrived)
    for p, e in enumerate(got):
        if "error" in e:
            raise PeerAbortedError(f"rank {rank}: {what} failed on rank {p}: {e['error']}", rank=rank, origin=p)
    return got
