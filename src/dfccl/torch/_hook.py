"""Tagged all-reduce and DDP's communication hook built on it."""

# No "from __future__ import annotations": DDP inspects the hook's annotations
# and wants the classes themselves.
import itertools
import weakref
from typing import Any

import torch
import torch.distributed as dist

from dfccl.errors import InvalidArgumentError
from dfccl.torch._group import ProcessGroupDfccl

__all__ = ["TaggedAllreduceState", "backend_of", "tagged_allreduce", "tagged_allreduce_hook"]


def backend_of(group: Any = None, device: Any = "cpu") -> Any:
    """The dfccl backend of ``group`` (default: the default group) for
    tensors on ``device``: the compiled backend (its ``group`` attribute is
    the Python side), or a ProcessGroupDfccl (the Python backend)."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if isinstance(pg, ProcessGroupDfccl):
        return pg
    try:
        backend = pg._get_backend(torch.device(device))
    except RuntimeError:
        backend = None
    if isinstance(getattr(backend, "group", None), ProcessGroupDfccl):
        return backend
    raise InvalidArgumentError(f"{pg!r} is not a dfccl process group for {device} tensors "
                               "(init_process_group(backend='dfccl'))")


def tagged_allreduce(tensor: torch.Tensor, tag: Any, op: Any = dist.ReduceOp.SUM, group: Any = None) -> dist.Work:
    """All-reduce matched by ``tag`` instead of call order: the k-th use of a
    tag on one rank meets the k-th use on every rank, whatever else the ranks
    issue in between.  The tag (a str, an int, or a tuple of those) must be
    the same on all ranks.  Returns the torch Work (``wait()``,
    ``get_future()``)."""
    backend = backend_of(group, tensor.device)
    if isinstance(backend, ProcessGroupDfccl):
        return backend.tagged_allreduce(tensor, tag, op)
    return backend.tagged_allreduce(tensor, backend.group._tag_id(tag), op)


_ddp_ids = itertools.count()


class TaggedAllreduceState:
    """State of :func:`tagged_allreduce_hook`: the process group, the DDP
    instance id and the step counter.

    ``ddp_id`` names the DDP model in the tags; by default the n-th state
    created in this process gets n, so create states in the same order on all
    ranks, or pass the same explicit ``ddp_id`` (an int or str) on all ranks."""

    def __init__(self, process_group: dist.ProcessGroup | None = None, ddp_id: int | str | None = None) -> None:
        self.process_group = process_group
        self.ddp_id = next(_ddp_ids) if ddp_id is None else ddp_id
        self.step = 0


# States for hooks registered with a process group (or None) as state.
_implicit_states: "weakref.WeakKeyDictionary[Any, TaggedAllreduceState]" = weakref.WeakKeyDictionary()
_implicit_default: dict[int, TaggedAllreduceState] = {}


def _state_of(state: Any) -> TaggedAllreduceState:
    if isinstance(state, TaggedAllreduceState):
        return state
    if state is None:
        pg = dist.distributed_c10d._get_default_group()
        st = _implicit_default.get(id(pg))
        if st is None:
            st = _implicit_default[id(pg)] = TaggedAllreduceState(pg, ddp_id="default")
        return st
    st = _implicit_states.get(state)
    if st is None:
        st = _implicit_states[state] = TaggedAllreduceState(state, ddp_id=f"pg:{state.group_name}")
    return st


def tagged_allreduce_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: averages each gradient bucket with an
    all-reduce tagged ``("ddp", ddp_id, bucket index)``, so buckets (and
    other groups' collectives) may complete in any order; step k's bucket
    is the tag's k-th instance on every rank.

    ``state``: a :class:`TaggedAllreduceState` (recommended), a dfccl process
    group or None (the default group).  Tags must be the same on all ranks,
    which holds when every rank registers the hook on the same model in the
    same order.  Returns a future resolving to the averaged flat bucket."""
    st = _state_of(state)
    buf = bucket.buffer()
    work = tagged_allreduce(buf, ("ddp", st.ddp_id, bucket.index()), dist.ReduceOp.AVG, st.process_group)
    if bucket.is_last():
        st.step += 1
    return work.get_future().then(lambda fut: fut.value()[0])
