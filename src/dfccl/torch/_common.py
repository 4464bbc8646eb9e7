"""What both backends (compiled and Python) share: dfccl.torch's errors,
torch reductions and dtypes as dfccl's, tensors as dfccl buffers, the
tags that match a collective across ranks."""

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import dfccl
from dfccl.buffers import Buffer
from dfccl.errors import (AbortedError, CollectiveTimeoutError, DfcclError, ErrorCode, InvalidArgumentError,
                          MismatchError, NotSupportedError, PeerAbortedError, PeerLostError)
from dfccl.types import ReduceOp, as_data_type, as_reduce_op

__all__ = ["BACKEND_ENV", "DEFAULT_TIMEOUT", "NotSupportedError", "TorchCollectiveTimeoutError",
           "premul_sum_supported", "map_error", "reduce_op", "plain_ops", "op_name", "data_type", "as_buffer",
           "contiguous_or_copy", "seconds", "current_stream_handle", "capturing", "capture_error",
           "captured_wait_error", "group_backend",
           "shape_tag", "status_error"]

#: Environment variable forcing the backend of a group's first
#: communicator ("cuda" or "sim"); default: "cuda" where torch and dfccl see a
#: GPU, else "sim".
BACKEND_ENV = "DFCCL_TORCH_BACKEND"

DEFAULT_TIMEOUT = timedelta(minutes=30)


class TorchCollectiveTimeoutError(CollectiveTimeoutError, dist.DistBackendError):
    """A collective did not complete within the timeout: both dfccl's
    :class:`~dfccl.CollectiveTimeoutError` and torch's ``DistBackendError``
    (what torch's own backends raise on timeouts)."""


def map_error(exc: BaseException) -> BaseException:
    """dfccl's timeout as a TorchCollectiveTimeoutError; others unchanged."""
    if isinstance(exc, CollectiveTimeoutError) and not isinstance(exc, TorchCollectiveTimeoutError):
        mapped = TorchCollectiveTimeoutError(str(exc), rank=exc.rank, tag=exc.tag, waiting_on=exc.waiting_on,
                                             missing_ranks=getattr(exc, "missing_ranks", None),
                                             joined_ranks=getattr(exc, "joined_ranks", None))
        mapped.__cause__ = exc
        return mapped
    return exc


def status_error(rank: int, what: str, status: int, detail: int) -> DfcclError:
    """The error of a collective the C API reports failed with ``status``
    (a dfccl_status) naming rank ``detail``: the class a dfccl Work raises
    for that status."""
    from dfccl._native import layout as abi

    if status == abi.STATUS_MISMATCH:
        return MismatchError(f"rank {rank}: {what} does not match rank {detail}'s submission of the same collective "
                             "(kind, count, dtype, op or root differ)", rank=rank, peer=detail)
    if status == abi.STATUS_PEER_LOST:
        return PeerLostError(f"rank {rank}: {what} failed: rank {detail} is lost (its process died or stopped, or "
                             "its device failed)", rank=rank, origin=detail)
    if status == abi.STATUS_PEER_ABORTED and detail != rank:
        return PeerAbortedError(f"rank {rank}: {what} was abandoned: rank {detail} failed it (signature mismatch "
                                "or abort)", rank=rank, origin=detail)
    if status in (abi.STATUS_ABORTED, abi.STATUS_PEER_ABORTED):
        return AbortedError(f"rank {rank}: {what} was aborted", rank=rank)
    return DfcclError(f"rank {rank}: {what} failed with status {status}", rank=rank)


# -- streams ---------------------------------------------------------------------

# The raw cudaStream_t of the current stream, without building a torch Stream
# object (3-4 us a call on the host path of every collective).
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream_handle(device: int) -> int:
    """The CUstream handle of torch's current stream on ``device``."""
    if _raw_stream is not None:
        return _raw_stream(device)
    return torch.cuda.current_stream(device).cuda_stream


# Whether torch's current CUDA stream is capturing a graph, without the
# Python wrapper's lazy-initialisation check (a CUDA tensor is in hand).
capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) or torch.cuda.is_current_stream_capturing


def capture_error(name: str, rank: int) -> NotSupportedError:
    """What a collective that blocks the host (barrier) raises under CUDA
    graph capture: a replay cannot block the host."""
    return NotSupportedError(
        f"{name}: cannot be captured in a CUDA graph: it blocks the host until its peers arrive, which a replayed "
        "graph cannot do; issue it outside torch.cuda.graph", rank=rank)


def captured_wait_error(what: str, name: str, rank: int) -> NotSupportedError:
    """What a host wait (``what``) on a captured torch collective ``name``
    raises: the words of dfccl's Work, which the Python backend's works
    raise, for the compiled backend's."""
    return NotSupportedError(
        f"{what}: rank {rank}'s {name} was captured in a CUDA graph: it has no completion on the host, it runs at "
        "each replay.  Wait on a stream instead: work.wait() under the same capture orders what follows in the "
        "graph after it, and synchronizing the graph's stream after a replay (torch.cuda.synchronize()) waits for "
        "it; a failed replay is raised by the next dfccl call", rank=rank)


# -- reductions ------------------------------------------------------------------

_OPS = {
    dist.ReduceOp.RedOpType.SUM: "sum",
    dist.ReduceOp.RedOpType.PRODUCT: "prod",
    dist.ReduceOp.RedOpType.MIN: "min",
    dist.ReduceOp.RedOpType.MAX: "max",
    dist.ReduceOp.RedOpType.AVG: "avg",
}

#: The same, as dfccl's ReduceOp, for the ops that need no premultiplication.
plain_ops: dict[Any, ReduceOp] = {op: as_reduce_op(name) for op, name in _OPS.items()}


def op_name(op: Any) -> str:
    """dfccl's name of a plain torch reduction (a RedOpType)."""
    return _OPS[op]


def premul_sum_supported() -> bool:
    """Whether this torch shows a backend a PREMUL_SUM op's factor
    (``ReduceOp.factor``; not every torch release does)."""
    return hasattr(dist.ReduceOp, "factor")


def reduce_op(op: Any) -> tuple[str, float | None]:
    """(dfccl op, premultiply factor or None) for a torch ReduceOp."""
    red_op = op.op if hasattr(op, "op") else op
    if red_op == dist.ReduceOp.RedOpType.PREMUL_SUM:
        if not premul_sum_supported():
            raise NotSupportedError(f"PREMUL_SUM: torch {torch.__version__} does not give a backend the op's "
                                    "factor (ReduceOp.factor); multiply the tensor by the factor and use SUM")
        factor = getattr(op, "factor", None)
        if factor is None:
            raise InvalidArgumentError("PREMUL_SUM needs a factor (use dist._make_nccl_premul_sum(factor))")
        if isinstance(factor, torch.Tensor):
            factor = factor.item()
        return "sum", float(factor)
    try:
        return _OPS[red_op], None
    except (KeyError, TypeError):
        raise NotSupportedError(f"reduction {red_op} is not supported by dfccl (supported: SUM, PRODUCT, MIN, MAX, "
                                "AVG, PREMUL_SUM; bitwise BAND/BOR/BXOR are not)") from None


# -- tensors ---------------------------------------------------------------------

_DATA_TYPES: dict[torch.dtype, Any] = {}   # torch dtype -> dfccl DataType, filled on first use


def data_type(dtype: torch.dtype, what: str) -> Any:
    """dfccl's DataType of a torch dtype (InvalidArgumentError if none)."""
    dt = _DATA_TYPES.get(dtype)
    if dt is None:
        try:
            dt = _DATA_TYPES[dtype] = as_data_type(str(dtype))
        except InvalidArgumentError:
            raise InvalidArgumentError(f"{what}: dtype {dtype} is not supported by dfccl (supported: int8, uint8, "
                                       "int32, uint32, int64, uint64, float16, bfloat16, float32, float64)") from None
    return dt


def as_buffer(t: torch.Tensor, what: str, owner: object = True) -> Buffer:
    """dfccl view of a contiguous tensor, built from data_ptr so that neither
    DLPack's stream handshake nor a missing bfloat16 typestr gets in the way.
    ``owner``: what the view keeps alive (True: the tensor; None: nothing)."""
    device = t.device.index if t.is_cuda else None
    return Buffer.from_pointer(t.data_ptr(), t.numel(), data_type(t.dtype, what), device=device,
                               owner=t if owner is True else owner)


def contiguous_or_copy(t: torch.Tensor, copy_back: list) -> torch.Tensor:
    """``t`` itself when contiguous, else a contiguous copy; outputs that got a
    copy are recorded in ``copy_back`` to be written back after completion."""
    if t.is_contiguous():
        return t
    tmp = t.contiguous()
    copy_back.append((t, tmp))
    return tmp


def seconds(timeout: Any) -> float | None:
    """Seconds of a timedelta; None for torch's 'unset' values (0 or negative)."""
    if timeout is None:
        return None
    s = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    return s if s > 0 else None


def shape_tag(kind: str, t: torch.Tensor, count: int, op: str, root: int) -> tuple:
    """The tag of a collective the compiled backend submits through a plan:
    the k-th collective of this kind, shape, reduction and root on one rank
    meets the k-th on the others (whichever path, compiled or Python, each
    rank's call took)."""
    return ("torch", kind, count, str(t.dtype), op, root)


def group_backend() -> str:
    """The backend ("cuda" or "sim") of a group's first communicator."""
    env = os.environ.get(BACKEND_ENV, "").strip()
    if env:
        if env not in ("cuda", "sim"):
            raise InvalidArgumentError(f"{BACKEND_ENV} must be 'cuda' or 'sim', not {env!r}")
        return env
    if torch.cuda.is_available():
        try:
            if dfccl.runtime.cuda_device_count() > 0:
                return "cuda"
        except DfcclError:
            pass
    return "sim"
