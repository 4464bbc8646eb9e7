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

This module agrees on the membership (this rank's place in its child); the
Communicator builds the child from it.
"""

from __future__ import annotations

import hashlib
import numbers
import secrets
import time
from dataclasses import dataclass

from dfccl.bootstrap import gather_through_store
from dfccl.errors import InvalidArgumentError
from dfccl.local_group import LocalGroup
from dfccl.unique_id import UniqueId

__all__ = ["check_color", "check_key", "members_of", "child_unique_id", "LocalChild", "StoreChild", "split_local",
           "split_through_store"]


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


@dataclass(frozen=True)
class LocalChild:
    """This rank's place in a child whose ranks all live in this process."""

    rank: int
    size: int
    comm_key: int
    group: LocalGroup


@dataclass(frozen=True)
class StoreChild:
    """This rank's place in a child that bootstraps through the parent's store."""

    rank: int
    size: int
    unique_id: UniqueId


def split_local(group: LocalGroup, number: int, rank: int, color: int | None, key: int,
                deadline: float, timeout: float) -> LocalChild | None:
    """The k-th split (``number``) of a parent whose ranks all live in this
    process: exchanges (color, key) through the group's rendezvous; None for
    a rank that joins no child."""
    rv = group.rendezvous
    entries = rv.exchange(("split", number), rank, {"color": color, "key": key}, deadline, timeout)
    if color is None:
        return None
    members = members_of(entries, color)

    def make_shared():
        return {"comm_key": int.from_bytes(secrets.token_bytes(8), "little") or 1,
                "group": LocalGroup(len(members), closes_memory=True)}

    shared = rv.shared(("split", number, color), make_shared)
    return LocalChild(members.index(rank), len(members), shared["comm_key"], shared["group"])


def split_through_store(uid: UniqueId, number: int, rank: int, nranks: int, color: int | None, key: int,
                        deadline: float, timeout: float) -> StoreChild | None:
    """The k-th split (``number``) of a parent created from ``uid``: exchanges
    (color, key) through its store; None for a rank that joins no child."""
    prefix = f"comm/{uid.comm_key():016x}/split/{number}"
    with uid.connect(timeout=max(deadline - time.monotonic(), 0.05)) as store:
        entries = gather_through_store(store, prefix, rank, nranks, {"color": color, "key": key}, deadline, timeout)
    if color is None:
        return None
    members = members_of(entries, color)
    return StoreChild(members.index(rank), len(members), child_unique_id(uid, number, color))
