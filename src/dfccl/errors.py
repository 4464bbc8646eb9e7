"""Typed errors.  Every error dfccl raises is a :class:`DfcclError` carrying an
:class:`ErrorCode`; collective failures also name the rank, the collective
(:func:`collective_name`) and the reason."""

from __future__ import annotations

import enum

__all__ = [
    "collective_name",
    "ErrorCode",
    "DfcclError",
    "InvalidArgumentError",
    "MismatchError",
    "PeerAbortedError",
    "PeerLostError",
    "AbortedError",
    "CollectiveTimeoutError",
    "StartupTimeoutError",
    "ResourceError",
    "BackendError",
    "ClosedError",
    "NotSupportedError",
]


class ErrorCode(enum.IntEnum):
    INVALID_ARGUMENT = 1
    MISMATCH = 2
    PEER_ABORTED = 3
    ABORTED = 4
    TIMEOUT = 5
    RESOURCE = 6
    BACKEND = 7
    CLOSED = 8
    PEER_LOST = 9


def collective_name(tag: object, instance: int) -> str:
    """How messages name a collective: ``tag 'grad' (instance 3)``, or
    ``untagged #3`` for the third untagged collective of its communicator
    (its tag is None), so that an untagged call never reads like ``tag=3``."""
    if tag is None:
        return f"untagged #{instance}" if instance > 0 else "untagged"
    return f"tag {tag!r} (instance {instance})"


class DfcclError(RuntimeError):
    """Base class.  ``code`` says which kind of failure this is."""

    code: ErrorCode = ErrorCode.BACKEND

    # ``tag``: the collective's tag as given, None for an untagged one.
    def __init__(self, message: str, *, rank: int | None = None, tag: object = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.tag = tag


class InvalidArgumentError(DfcclError, ValueError):
    """A buffer, dtype, count, root or option is not acceptable."""

    code = ErrorCode.INVALID_ARGUMENT


class MismatchError(DfcclError):
    """Ranks submitted the same tag with different signatures (kind, count,
    dtype, op, root).  Every rank of the instance gets it.  ``field`` is the
    first field that differs, ``values`` maps each rank that has submitted
    the instance to its value of that field, ``ranks`` are the ranks out of
    line (not in the largest group of equal values) and ``peer`` a rank whose
    value differs from this rank's (an out-of-line rank where there is one)."""

    code = ErrorCode.MISMATCH

    def __init__(self, message: str, *, rank: int | None = None, tag: object = None, peer: int | None = None,
                 field: str | None = None, values: dict | None = None, ranks: list[int] | None = None) -> None:
        super().__init__(message, rank=rank, tag=tag)
        self.peer = peer
        self.field = field
        self.values = values
        self.ranks = ranks


class PeerAbortedError(DfcclError):
    """A peer gave up this collective (it saw a mismatch, or was aborted);
    ``origin`` is the rank where the failure started."""

    code = ErrorCode.PEER_ABORTED

    def __init__(self, message: str, *, rank: int | None = None, tag: object = None, origin: int | None = None) -> None:
        super().__init__(message, rank=rank, tag=tag)
        self.origin = origin


class PeerLostError(PeerAbortedError):
    """The process of a peer died (killed, crashed, exited) while this rank
    had collectives with it pending, or before it could take part.  ``origin``
    (also ``peer``) is the lost rank.  The communicator is unusable
    afterwards; close it.  Other communicators go on."""

    code = ErrorCode.PEER_LOST

    @property
    def peer(self) -> int | None:
        return self.origin


class AbortedError(DfcclError):
    """The communicator was aborted or closed while the collective was pending."""

    code = ErrorCode.ABORTED


class CollectiveTimeoutError(DfcclError, TimeoutError):
    """``synchronize(timeout)`` ran out.  The collective stays pending.
    ``missing_ranks`` are the ranks that have not joined this instance,
    ``joined_ranks`` those that have (None where unknown); ``waiting_on``
    is the first missing rank, else the rank whose data the transfer
    waits for."""

    code = ErrorCode.TIMEOUT

    def __init__(self, message: str, *, rank: int | None = None, tag: object = None, waiting_on: int | None = None,
                 missing_ranks: list[int] | None = None, joined_ranks: list[int] | None = None) -> None:
        super().__init__(message, rank=rank, tag=tag)
        self.waiting_on = waiting_on
        self.missing_ranks = missing_ranks
        self.joined_ranks = joined_ranks


class StartupTimeoutError(CollectiveTimeoutError):
    """Communicator start-up ran out of time.  ``missing_ranks`` are the ranks
    that had not arrived (or had not finished connecting) when the deadline
    passed, ``arrived_ranks`` those that had; ``missing_ranks`` is None when
    the rendezvous store itself could not be reached."""

    def __init__(self, message: str, *, rank: int | None = None, missing_ranks: list[int] | None = None,
                 arrived_ranks: list[int] | None = None) -> None:
        super().__init__(message, rank=rank, waiting_on=missing_ranks[0] if missing_ranks else None)
        self.missing_ranks = missing_ranks
        self.arrived_ranks = arrived_ranks


class ResourceError(DfcclError):
    """A bounded resource (outstanding collectives, tag records, staging
    memory) is exhausted.  Raised instead of waiting, which could deadlock."""

    code = ErrorCode.RESOURCE


class BackendError(DfcclError):
    """The backend (CUDA driver, simulator) failed.  ``driver_code`` holds the
    CUresult when the CUDA driver is the source."""

    code = ErrorCode.BACKEND

    def __init__(self, message: str, *, driver_code: int | None = None) -> None:
        super().__init__(message)
        self.driver_code = driver_code


class ClosedError(DfcclError):
    """The communicator or daemon is closed."""

    code = ErrorCode.CLOSED


class NotSupportedError(DfcclError, NotImplementedError):
    """An operation dfccl does not implement, or not in this context (a
    collective of the C API under CUDA graph capture, say; torch.distributed
    operations dfccl.torch does not offer)."""

    code = ErrorCode.INVALID_ARGUMENT
