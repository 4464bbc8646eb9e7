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

# The daemon's hashes, from the same C (cuda/include/dfccl/hash.h).
from dfccl._native.context import home_bucket
from dfccl.errors import InvalidArgumentError, ResourceError

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


class _TagState:
    __slots__ = ("bucket", "submitted", "pending", "poisoned", "transient", "fifo", "fifo_bytes", "retired_fifos",
                 "fifo_layout", "last_slot_gen")

    def __init__(self, transient: bool):
        self.bucket = -1
        self.submitted = 0
        self.pending = 0
        self.poisoned = False
        self.transient = transient
        self.fifo = -1            # staging this tag's instances share (one at a time per channel)
        self.fifo_bytes = 0
        self.retired_fifos: list[tuple[int, int]] = []  # smaller FIFOs still used by pending instances
        self.fifo_layout: object = None   # how the latest instance lays the staging out
        self.last_slot_gen = 0            # ((slot + 1) << 32) | gen of the latest instance with staging


class TagTable:
    """Host mirror of one rank's tag table: which bucket holds which tag, how
    many instances of each tag this rank has submitted, and the staging each
    tag's instances share.

    A tag keeps its bucket (and its staging) while it is idle, so that the
    next instance finds its record, its peers' cached record addresses and its
    FIFO where the last one left them.  An idle bucket is handed to another
    tag when that tag's probe sequence reaches it before a free one; idle
    staging is given back when the pool runs short.  Instances of one tag run
    one after the other on each channel (the daemon chains them,
    cuda/daemon/submit.cuh), so one FIFO serves all of them."""

    def __init__(self, capacity: int, staging=None):
        self.capacity = capacity
        self._owner: list[int] = [0] * capacity  # key bound to each bucket; 0 = free
        # Whether an instance placed in each bucket has retired: until then
        # the daemon's copy of the bucket may still read as never used, and a
        # submission to it asks the daemon to write the key (keyed()).
        self._keyed: list[bool] = [False] * capacity
        # What failed instances kept alive (their buffers): a failed rank does
        # not wait for its peers, and a peer that had met it may still read
        # its buffers in place until it sees the failure; like a failed
        # instance's bucket, they stay until no peer can touch them
        # (Endpoint.release, drop_failed).
        self._failed_owners: list[object] = []
        self._tags: dict[int, _TagState] = {}
        self._idle: dict[int, None] = {}  # persistent tags bound but with nothing pending, oldest first
        self._staging = staging
        self.used = 0  # buckets of tags with pending instances (or poisoned)

    @property
    def bound(self) -> int:
        """Buckets bound to a tag, idle ones included."""
        return self.used + len(self._idle)

    def acquire(self, key: int, transient: bool) -> tuple[int, int]:
        """Registers the next instance of ``key``.  Returns (bucket, instance)."""
        bucket, instance, _, _, _ = self.acquire_staged(key, transient, 0)
        return bucket, instance

    def acquire_staged(self, key: int, transient: bool, staging_bytes: int,
                       layout: object = None) -> tuple[int, int, int, int, bool]:
        """Like acquire(), and reserves ``staging_bytes`` of staging for the
        tag, shared with its other instances.  ``layout`` says how the
        instance's channels use it.  Returns (bucket, instance, staging offset
        or 0, after, keyed): ``after`` names an earlier instance (the
        descriptor's ``after``) that must be over on every channel before this
        one starts; ``keyed``, keyed(bucket).

        Instances of a tag run one after the other on each channel, not across
        channels: channel 0 of instance k + 1 may run while channel 1 of
        instance k still does.  Instances that lay the staging out alike use
        the same part of it on each channel, so that order is enough; one that
        lays it out differently (another size or channel count) would write
        where another channel of a pending instance still works, so it waits
        for the latest one to be over everywhere (which the earlier ones were
        before it)."""
        st = self._tags.get(key)
        if st is None:
            st = self._tags[key] = _TagState(transient)
        fresh = st.bucket < 0
        if fresh:
            st.bucket = self._claim(key)
        offset = after = 0
        if staging_bytes:
            try:
                offset, after = self._reserve_staging(key, st, staging_bytes, layout)
            except BaseException:
                if fresh:
                    self._owner[st.bucket] = 0
                    st.bucket = -1
                    if st.submitted == 0:
                        del self._tags[key]
                raise
        if st.pending == 0 and not st.poisoned:
            if not fresh:
                self._idle.pop(key, None)
            self.used += 1
        st.submitted += 1
        st.pending += 1
        return st.bucket, st.submitted, offset, after, self._keyed[st.bucket]

    def note_slot(self, key: int, slot_gen: int) -> None:
        """The completion slot and generation of the instance just acquired
        with staging: ((slot + 1) << 32) | gen, for later instances' ``after``."""
        self._tags[key].last_slot_gen = slot_gen

    def drop_failed(self) -> None:
        """Lets failed instances' buffers go: no peer can reach them any more."""
        self._failed_owners = []

    def keyed(self, bucket: int) -> bool:
        """Whether the daemon has surely written a key into ``bucket``: an
        instance placed there has retired (the daemon pulled it).  Until then
        a submission asks the daemon to key it (DFCCL_TASK_KEY_BUCKET), so
        that peers probing past it do not stop there (design decision 31)."""
        return self._keyed[bucket]

    def cancel(self, key: int) -> None:
        """Undoes the last acquire() of ``key`` (its submission failed before
        reaching the daemon): the instance number is given back."""
        st = self._tags[key]
        st.submitted -= 1
        self.release(key, failed=False, ran=False)

    def release(self, key: int, failed: bool, instance_staging: tuple[int, int] | None = None,
                ran: bool = True, owners: object = None) -> None:
        """One instance of ``key`` completed (or failed; ``ran``: it reached
        the daemon).  ``instance_staging`` (offset, bytes): staging that
        instance had alone (alloc_instance_staging), given back unless it
        failed (a peer that has not seen the failure may still read or mark
        it).  ``owners``: what the instance kept alive (its buffers), kept
        until drop_failed() if it failed, for the same reason."""
        if instance_staging is not None and not failed:
            self._staging.free(*instance_staging)
        if failed and owners is not None:
            self._failed_owners.append(owners)
        st = self._tags[key]
        if ran:
            self._keyed[st.bucket] = True
        st.pending -= 1
        if failed:
            # Its bucket and staging stay bound for good: a peer that has not
            # seen the failure may still read the abort marker or write there.
            st.poisoned = True
        if st.pending or st.poisoned:
            return
        self.used -= 1
        for off, n in st.retired_fifos:
            self._staging.free(off, n)
        st.retired_fifos = []
        if st.transient:
            self._unbind(key, st)
            del self._tags[key]
        else:
            self._idle[key] = None

    def instances(self, key: int) -> int:
        st = self._tags.get(key)
        return 0 if st is None else st.submitted

    def staging_of(self, key: int) -> tuple[int, int]:
        """(offset, bytes) of the staging bound to ``key`` (-1, 0: none)."""
        st = self._tags.get(key)
        return (-1, 0) if st is None else (st.fifo, st.fifo_bytes)

    def alloc_instance_staging(self, nbytes: int) -> int:
        """Staging for one instance alone (an all-to-all's split table and
        send copy), given back with free_instance_staging().  Idle tags'
        staging is given back first when the pool runs short."""
        off = self._staging.alloc(nbytes)
        while off is None and self._idle:
            self._evict(next(iter(self._idle)))
            off = self._staging.alloc(nbytes)
        if off is None:
            raise ResourceError(f"staging memory exhausted ({self._staging.in_use} of {self._staging.size} bytes held by "
                                f"pending collectives, {nbytes} more needed); raise CommOptions.staging_bytes or "
                                "synchronize earlier collectives")
        return off

    def free_instance_staging(self, offset: int, nbytes: int) -> None:
        self._staging.free(offset, nbytes)

    # -- internals -------------------------------------------------------------------
    def _unbind(self, key: int, st: _TagState) -> None:
        self._owner[st.bucket] = 0
        st.bucket = -1
        if st.fifo >= 0:
            self._staging.free(st.fifo, st.fifo_bytes)
            st.fifo, st.fifo_bytes = -1, 0

    def _evict(self, key: int) -> None:
        st = self._tags[key]
        del self._idle[key]
        self._unbind(key, st)

    def _claim(self, key: int) -> int:
        cap = self.capacity
        b = home_bucket(key, cap)
        for _ in range(cap):
            owner = self._owner[b]
            if owner == 0 or owner in self._idle:
                if owner != 0:
                    self._evict(owner)
                self._owner[b] = key
                return b
            b = b + 1 if b + 1 < cap else 0
        raise ResourceError(f"all {cap} tag records of this rank are in use (tags pending at once); "
                            "raise CommOptions.max_tags")

    def _reserve_staging(self, key: int, st: _TagState, nbytes: int, layout: object) -> tuple[int, int]:
        """(offset, after): see acquire_staged."""
        if st.fifo >= 0 and st.fifo_bytes >= nbytes:
            after = st.last_slot_gen if st.pending and layout != st.fifo_layout else 0
            st.fifo_layout = layout
            return st.fifo, after
        off = self._staging.alloc(nbytes)
        while off is None and self._idle:
            # Give back the staging of idle tags, oldest first.
            victim = next(iter(self._idle))
            if victim == key:
                break
            self._evict(victim)
            off = self._staging.alloc(nbytes)
        if off is None:
            raise ResourceError(f"staging memory exhausted ({self._staging.in_use} of {self._staging.size} bytes held by "
                     f"tags with pending collectives, {nbytes} more needed); raise CommOptions.staging_bytes or "
                     "synchronize earlier collectives")
        if st.fifo >= 0:
            if st.pending:
                st.retired_fifos.append((st.fifo, st.fifo_bytes))
            else:
                self._staging.free(st.fifo, st.fifo_bytes)
        # A new region: nothing pending uses it, so no wait.
        st.fifo, st.fifo_bytes, st.fifo_layout = off, nbytes, layout
        return off, 0
