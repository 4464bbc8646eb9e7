"""``Communicator.split``: new communicators over subsets of a parent's ranks.

Like ncclCommSplit.  Every rank of the parent calls ``split(color, key)``;
the ranks that pass the same color form one new communicator, ordered by
(key, parent rank); a rank that passes None (or a negative color) gets None.
The children are ordinary communicators on the same daemons (one per device
and process), so a rank may belong to any number of overlapping
communicators, and collectives of all of them are scheduled together.

How the ranks agree:

* a parent created from a UniqueId exchanges (color, key) through the
  parent's rendezvous store, and each child bootstraps through the same store
  under an id derived from (parent id, split number, color): no new server,
  no new secret to share;
* a parent created with ``Communicator.for_devices`` (every rank in this
  process) exchanges them through an in-process rendezvous; each rank's
  ``split`` must then run on its own thread (``Communicator.split_all`` does
  that for a list of ranks).

Splits are numbered per parent: the k-th split on every rank is one
collective, so every rank must call split the same number of times, in the
same order relative to its other splits (collectives in between do not
matter).
"""

from __future__ import annotations

import hashlib
import json
import numbers
import threading
import time
from typing import TYPE_CHECKING

from dfccl.errors import CollectiveTimeoutError, InvalidArgumentError, PeerAbortedError, StartupTimeoutError
from dfccl.unique_id import UniqueId

if TYPE_CHECKING:
    from dfccl.communicator import Communicator

__all__ = ["check_color", "check_key", "members_of", "child_unique_id", "gather_through_store", "LocalRendezvous"]


def check_color(color) -> int | None:
    """None (this rank joins no child) or an int; negative ints mean None,
    as NCCL_SPLIT_NOCOLOR does."""
    if color is None:
        return None
    if isinstance(color, bool) or not isinstance(color, numbers.Integral):
        raise InvalidArgumentError(f"split: color must be an int or None, not {type(color).__name__} ({color!r})")
    color = int(color)
    return None if color < 0 else color


def check_key(key, default: int) -> int:
    if key is None:
        return default
    if isinstance(key, bool) or not isinstance(key, numbers.Integral):
        raise InvalidArgumentError(f"split: key must be an int or None, not {type(key).__name__} ({key!r})")
    return int(key)


def members_of(entries: list[dict], color: int) -> list[int]:
    """Parent ranks of the child with ``color``, in child-rank order:
    sorted by (key, parent rank)."""
    chosen = [(e["key"], p) for p, e in enumerate(entries) if e["color"] == color]
    return [p for _, p in sorted(chosen)]


def child_unique_id(parent: UniqueId, split_number: int, color: int) -> UniqueId:
    """The id a child bootstraps with: the parent's store and secret, a uid
    derived from (parent uid, split number, color), so children of different
    splits and colors never share store keys."""
    digest = hashlib.blake2b(parent.uid + split_number.to_bytes(8, "big") + color.to_bytes(8, "big", signed=True),
                             digest_size=16, person=b"dfccl-split").digest()
    return UniqueId(parent.host, parent.port, parent.secret, digest)


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


class LocalRendezvous:
    """The in-process counterpart of the store for ranks that all live in
    this process (for_devices): each rank posts a value under a name and
    waits for the others'."""

    def __init__(self, nranks: int):
        self.nranks = nranks
        self._cond = threading.Condition()
        self._values: dict = {}
        self._shared: dict = {}

    def exchange(self, name, rank: int, value, deadline: float, timeout: float):
        with self._cond:
            slot = self._values.setdefault(name, {})
            slot[rank] = value
            self._cond.notify_all()
            while len(slot) < self.nranks:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [p for p in range(self.nranks) if p not in slot]
                    raise StartupTimeoutError(
                        f"rank {rank}: split timed out after {timeout:g} s: ranks {missing} of this process have not "
                        "called split (each rank of a for_devices group must call split on its own thread, or use "
                        "Communicator.split_all)", rank=rank, missing_ranks=missing, arrived_ranks=sorted(slot))
                self._cond.wait(left)
            return [slot[p] for p in range(self.nranks)]

    def shared(self, name, factory):
        """One object per name for every rank that asks (the first one makes it)."""
        with self._cond:
            obj = self._shared.get(name)
            if obj is None:
                obj = self._shared[name] = factory()
            return obj


def split_local(parent: "Communicator", color: int | None, key: int, timeout: float):
    """split() for a parent whose ranks all live in this process."""
    from dfccl.communicator import Communicator, _Group

    group = parent._group
    rv: LocalRendezvous = group.rendezvous
    deadline = time.monotonic() + timeout
    number = parent._splits
    entries = rv.exchange(("split", number), parent._rank, {"color": color, "key": key}, deadline, timeout)
    if color is None:
        return None
    members = members_of(entries, color)
    new_rank = members.index(parent._rank)

    def make_shared():
        import secrets
        return {"comm_key": int.from_bytes(secrets.token_bytes(8), "little") or 1,
                "group": _Group(len(members))}

    shared = rv.shared(("split", number, color), make_shared)
    child = Communicator.__new__(Communicator)
    child._init_local(parent._backend, parent._device, new_rank, len(members), parent._user_options, None,
                      shared["comm_key"], shareable=False)
    child._group = shared["group"]
    child._group_closes_memory = True
    child._unique_id = None
    peers = child._group.rendezvous.exchange("describe", new_rank, child._endpoint.describe(), deadline, timeout)
    child._finish_init(peers)
    return child


def split_through_store(parent: "Communicator", color: int | None, key: int, timeout: float):
    """split() for a parent created from a UniqueId."""
    from dfccl.communicator import Communicator

    uid: UniqueId = parent._unique_id
    deadline = time.monotonic() + timeout
    number = parent._splits
    prefix = f"comm/{uid.comm_key():016x}/split/{number}"
    with uid.connect(timeout=max(deadline - time.monotonic(), 0.05)) as store:
        entries = gather_through_store(store, prefix, parent._rank, parent._size, {"color": color, "key": key},
                                       deadline, timeout)
    if color is None:
        return None
    members = members_of(entries, color)
    return Communicator(child_unique_id(uid, number, color), members.index(parent._rank), len(members),
                        device=parent._device, backend=parent._backend, options=parent._user_options,
                        timeout=max(deadline - time.monotonic(), 0.05))
