"""Prepared collectives: a Plan fixes a collective's shape once (checked and
planned by Communicator.prepare_*), a BoundPlan its buffers too.  Both
submit through their communicator's Submitter (submission.py)."""

from __future__ import annotations

from dfccl._native.layout import KIND_ALL_GATHER, KIND_REDUCE, KIND_REDUCE_SCATTER
from dfccl._native.work import Work
from dfccl.arguments import check_int, check_overlap
from dfccl.buffers import Buffer
from dfccl.errors import DfcclError, InvalidArgumentError
from dfccl.submission import Submitter
from dfccl.types import KIND_NAMES, DataType, ReduceOp, as_data_type

__all__ = ["Plan", "BoundPlan"]


class Plan:
    """A collective with its shape fixed once ("prepare"); calling it submits
    one instance with the given buffers.  All calls of a plan share its tag,
    so the k-th call on one rank meets the k-th call on the others.  Without
    ``tag``, plans are named by creation order: prepare them in the same order
    on every rank, or pass a tag."""

    def __init__(self, comm: object, submitter: Submitter, kind: int, count: int, dtype, op: ReduceOp, root: int,
                 tag):
        """Communicator.prepare_* builds plans.

        Args:
            comm: the Communicator, held and not used: it lives (and its
                peers are watched, liveness.py) as long as its plans.
            submitter: what the plan submits through (the communicator's).
            kind: the collective's kind code.
            count, dtype, op, root: the collective's shape (op and root
                checked; the kind's defaults where it has none).
            tag: the plan's tag (an untagged plan's is named by creation
                order by the communicator).
        """
        count = check_int(f"prepare_{KIND_NAMES[kind]}: count", count, 0)
        self._comm = comm
        self._submitter = submitter
        self.kind = KIND_NAMES[kind]
        self._kind = kind
        self.count = int(count)
        self.dtype: DataType = as_data_type(dtype)
        self.op = op
        self.root = int(root)
        self.tag = tag
        self._key = submitter.key(tag)
        self._geometry = submitter.geometry(kind, self.count, self.dtype)

    def __call__(self, send, recv=None, *, stream=None) -> Work:
        sub = self._submitter
        s, r = sub.pair(send, recv, self.kind, writes_recv=self._kind != KIND_REDUCE or self.root == sub.rank)
        self._check(s, r)
        return sub.submit(self._kind, s, r, self.count, self.op, self.root, self.tag, stream, self._geometry,
                          self._key)

    def bind(self, send, recv=None, *, stream=None) -> "BoundPlan":
        """Fixes the buffers (and stream) too.

        Args:
            send: the input of every instance.
            recv: the output (None: in place, where the kind allows it).
            stream: the CUDA stream every instance follows; None: run now.

        Returns:
            A BoundPlan: calling it submits one instance with no argument
            parsing or validation left to do.
        """
        return BoundPlan(self, send, recv, stream)

    def _check(self, s: Buffer, r: Buffer):
        n = self._submitter.world_size
        want_s, want_r = {
            KIND_ALL_GATHER: (self.count, self.count * n),
            KIND_REDUCE_SCATTER: (self.count * n, self.count),
        }.get(self._kind, (self.count, self.count))
        for b, want, name in ((s, want_s, "send"), (r, want_r, "recv")):
            if b.count != want or b.dtype != self.dtype:
                raise InvalidArgumentError(
                    f"plan {self.kind} tag {self.tag!r}: {name} must hold {want} x {self.dtype.name.lower()}, "
                    f"got {b.count} x {b.dtype.name.lower()}", rank=self._submitter.rank, tag=self.tag)

    def __repr__(self) -> str:
        return f"<dfccl.Plan {self.kind} count={self.count} {self.dtype.name.lower()} tag={self.tag!r}>"


class BoundPlan:
    """A plan with its buffers fixed (``Plan.bind``): the lowest-overhead way to
    submit the same collective repeatedly (training steps, benchmarks)."""

    def __init__(self, plan: Plan, send, recv, stream):
        sub = plan._submitter
        s, r = sub.pair(send, recv, plan.kind, writes_recv=plan._kind != KIND_REDUCE or plan.root == sub.rank)
        plan._check(s, r)
        check_overlap(plan._kind, s, r, plan.count, sub.rank, sub.world_size, plan.kind)
        self.plan = plan
        self._state = sub.state
        self._daemon = sub.daemon
        self._task = None if plan.count == 0 else sub.task(plan._kind, s, r, plan.count, plan.op, plan.root,
                                                             plan.tag, stream, plan._geometry, plan._key)
        self._submit = sub.daemon.submit

    def __call__(self) -> Work:
        state = self._state
        if state.closed or state.aborted:
            state.check_open()
        task = self._task
        if task is None:
            return Work.completed(self.plan.kind, self.plan.tag, state.rank)
        try:
            return self._submit(task)   # Submitter.submit_task, one frame less
        except DfcclError as exc:
            if exc.rank is None:
                exc.rank = state.rank
            raise

    @property
    def c_plan(self) -> int:
        """The address of this collective for the C API
        (``cuda/include/dfccl/dfccl_api.h``: a ``const dfccl_plan *``).  It
        stays valid while this BoundPlan is alive; C code that must outlive
        it calls the table's ``plan_retain`` (and ``plan_release`` when done).
        Submissions through it are the same instances of the plan's tag as
        calls of this object (they share its instance numbers), but have no
        Work: they are not in ``status()`` or the flight recorder."""
        state = self._state
        state.check_open()
        if self._task is None:
            raise InvalidArgumentError(f"{self.plan!r} has no elements: there is nothing to submit", rank=state.rank)
        return self._daemon.c_plan(self._task)

    def __repr__(self) -> str:
        return f"<dfccl.BoundPlan {self.plan!r}>"
