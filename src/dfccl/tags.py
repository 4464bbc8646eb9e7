"""Collective identity: tags, their keys, and this rank's tag records.

The k-th use of tag T on one rank matches the k-th use of T on every other
rank.  A tag's *key* is a 64-bit hash of (communicator, tag).  Each rank keeps
its tag records in a table in its arena; a record lives in a bucket found by
linear probing from ``home_bucket(key)`` -- the same sequence a peer's daemon
probes (cuda/daemon/block_env.cuh, probe_record) to find it.

A bucket stays bound to its tag while any instance of the tag is pending here,
so successive instances share one record; it is freed when none is.  A bucket
whose instance failed stays bound to its tag for good: peers may still read the
abort marker in it."""

from __future__ import annotations

import hashlib
import struct

from dfccl.errors import InvalidArgumentError, ResourceError

__all__ = ["tag_key", "home_bucket", "TagTable"]

MASK64 = (1 << 64) - 1


def mix64(x: int) -> int:
    """The daemon's mix64 (splitmix64 finaliser), bit for bit."""
    x &= MASK64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & MASK64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & MASK64
    x ^= x >> 31
    return x


def home_bucket(key: int, capacity: int) -> int:
    return mix64(key) % capacity


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


class _TagState:
    __slots__ = ("bucket", "submitted", "pending", "poisoned", "transient")

    def __init__(self, transient: bool):
        self.bucket = -1
        self.submitted = 0
        self.pending = 0
        self.poisoned = False
        self.transient = transient


class TagTable:
    """Host mirror of one rank's tag table: which bucket holds which tag, and
    how many instances of each tag this rank has submitted."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._owner: list[int] = [0] * capacity  # key bound to each bucket; 0 = free
        self._tags: dict[int, _TagState] = {}
        self.used = 0

    def acquire(self, key: int, transient: bool) -> tuple[int, int]:
        """Registers the next instance of ``key``.  Returns (bucket, instance).
        The daemon orders the instances of a tag on each channel itself: an
        instance pulled while an earlier one is pending on that channel is
        chained behind it (cuda/daemon/submit.cuh)."""
        st = self._tags.get(key)
        if st is None:
            st = self._tags[key] = _TagState(transient)
        if st.bucket < 0:
            st.bucket = self._claim(key)
        st.submitted += 1
        st.pending += 1
        return st.bucket, st.submitted

    def cancel(self, key: int) -> None:
        """Undoes the last acquire() of ``key`` (its submission failed before
        reaching the daemon): the instance number is given back."""
        st = self._tags[key]
        st.submitted -= 1
        self.release(key, failed=False)

    def release(self, key: int, failed: bool) -> None:
        """One instance of ``key`` completed (or failed)."""
        st = self._tags[key]
        st.pending -= 1
        if failed:
            st.poisoned = True
        if st.pending == 0 and not st.poisoned:
            self._owner[st.bucket] = 0
            self.used -= 1
            st.bucket = -1
            if st.transient:
                del self._tags[key]

    def instances(self, key: int) -> int:
        st = self._tags.get(key)
        return 0 if st is None else st.submitted

    def _claim(self, key: int) -> int:
        cap = self.capacity
        b = home_bucket(key, cap)
        for _ in range(cap):
            if self._owner[b] == 0:
                self._owner[b] = key
                self.used += 1
                return b
            b = b + 1 if b + 1 < cap else 0
        raise ResourceError(f"all {cap} tag records of this rank are in use (tags pending at once); "
                            "raise CommOptions.max_tags")
