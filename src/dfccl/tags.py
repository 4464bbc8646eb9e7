"""Collective identity: tags, their keys, and this rank's tag records.

The k-th use of tag T on one rank matches the k-th use of T on every other
rank.  A tag's *key* is a 64-bit hash of (communicator, tag).  Each rank keeps
its tag records in a table in its arena; a record lives in a bucket found by
linear probing from ``home_bucket(key)`` -- the same sequence a peer's daemon
probes (cuda/daemon/block_env.cuh, probe_record) to find it.

A bucket stays bound to its tag while any instance of the tag is pending here,
so successive instances share one record; it is freed when none is.  A bucket
whose instance failed stays bound to its tag for good: peers may still read the
abort marker in it.  The table (TagTable) is C state with Python methods for
its rare paths (dfccl/_native/tag_table.pyx): the hot path takes and gives back
instances of a bound tag without the GIL."""

from __future__ import annotations

import hashlib
import struct

# The daemon's hashes, from the same C (cuda/include/dfccl/hash.h).
from dfccl._native.layout import home_bucket
from dfccl._native.tag_table import TagTable
from dfccl.errors import InvalidArgumentError

__all__ = ["tag_key", "home_bucket", "TagTable"]


def _tag_bytes(tag: object) -> bytes:
    if isinstance(tag, bool):
        raise InvalidArgumentError("a tag must be a str, an int or a tuple of those, not a bool")
    if isinstance(tag, int):
        return b"i" + str(tag).encode()
    if isinstance(tag, str):
        return b"s" + tag.encode()
    if isinstance(tag, tuple):
        return b"t" + b"".join(struct.pack("!I", len(b)) + b for b in map(_tag_bytes, tag))
    raise InvalidArgumentError(f"a tag must be a str, an int or a tuple of those, not {type(tag).__name__}")


def tag_key(comm_key: int, tag: object) -> int:
    """Nonzero 64-bit key of ``tag`` in the communicator ``comm_key``."""
    h = hashlib.blake2b(struct.pack("!Q", comm_key) + _tag_bytes(tag), digest_size=8).digest()
    return int.from_bytes(h, "little") or 1
