"""A collective call's way from its arguments to the device's daemon: the
checks that need the rank (its tag, root, op, peer and buffers), one task
descriptor filled per call (or a kept one, submitted at the call's buffers),
and the submission.

The Communicator owns the rank and its public API; once the rank has met its
peers (its path, channels and options are then fixed) it builds a Submitter,
which its collectives and its plans (plans.py) go through.  Nothing here
waits for peers."""

from __future__ import annotations

import numbers
from typing import TYPE_CHECKING

from dfccl import runtime
from dfccl._native.descriptor import TaskDescriptor
from dfccl._native.layout import KIND_ALL_REDUCE, KIND_ALL_TO_ALL, KIND_RECV, KIND_SEND, TASK_STAGED
from dfccl._native.work import Work
from dfccl.arguments import check_overlap, is_simple_tag, overlaps
from dfccl.buffers import CPU, CUDA, Buffer, as_buffer, plain_array
from dfccl.errors import DfcclError, InvalidArgumentError
from dfccl.planning import Geometry, plan_geometry
from dfccl.point_to_point import pair_key, plan_all_to_all, plan_p2p, resolve_splits, split_table
from dfccl.streams import stream_handle
from dfccl.tags import tag_key
from dfccl.types import KIND_NAMES, DataType, ReduceOp, as_reduce_op

if TYPE_CHECKING:
    from dfccl.endpoint import Endpoint
    from dfccl.flight import FlightRecorder
    from dfccl.options import CommOptions
    from dfccl.rank_state import RankState
    from dfccl.registration import Registry

__all__ = ["Submitter"]

# Shapes (and tags) of plain calls whose descriptors a communicator keeps
# (Submitter.plain_task); past this many it starts again (a program with ever
# new sizes or tags).
_PLAIN_TASKS_KEPT = 256


class Submitter:
    """One rank's way from a call's arguments to the daemon: their checks,
    its descriptors (and the plain calls' kept ones) and its submissions."""

    def __init__(self, *, rank: int, world_size: int, comm_key: int, backend: str, device: int, daemon,
                 endpoint: "Endpoint", flight: "FlightRecorder", state: "RankState", channels: int,
                 block_offset: int, options: "CommOptions", mode: str, registry: "Registry | None",
                 ll_reach: bool):
        """Submissions of one connected rank.

        Args:
            rank: this rank.
            world_size: the number of ranks.
            comm_key: the communicator's key (tags are hashed under it).
            backend: "cuda" or "sim".
            device: the rank's device.
            daemon: the device's daemon.
            endpoint: the rank's endpoint (its arena and tag table).
            flight: the rank's flight recorder.
            state: the rank's RankState (whether it takes collectives).
            channels: the channels a collective may use.
            block_offset: where this rank's share of the daemon's blocks starts.
            options: the communicator's resolved options.
            mode: the path collectives take: "direct", "staged" or "ring".
            ll_reach: every peer's LL areas can be written (a direct or
                staged path, or peers across hosts through the proxy).
            registry: the memory registered for the staged path, or None.
        """
        self.rank = rank
        self.world_size = world_size
        self.daemon = daemon
        self.state = state
        self._comm_key = comm_key
        self._backend = backend
        self._device = device
        self._endpoint = endpoint
        self._flight = flight
        self._channels = channels
        self._block_offset = block_offset
        self._options = options
        self._mode = mode
        self._direct = mode != "ring"
        self._staged = mode == "staged"
        self._ll_reach = ll_reach
        self._registry = registry
        # Untagged collectives are the instances of one tag: the k-th untagged
        # call on every rank is instance k (NCCL's matching by position).
        self._seq_key = tag_key(comm_key, ("#seq",))
        self._plain_tasks: dict[tuple, TaskDescriptor] = {}   # plain_task's, by shape

    # -- arguments -------------------------------------------------------------------
    def check_root(self, root, what: str) -> None:
        """Refuses a root that is not a rank of this communicator."""
        if isinstance(root, bool) or not isinstance(root, numbers.Integral):
            raise InvalidArgumentError(f"{what}: root must be an int rank, not {type(root).__name__} ({root!r})",
                                       rank=self.rank)
        if not 0 <= root < self.world_size:
            raise InvalidArgumentError(f"{what}: root {root!r} is outside 0..{self.world_size - 1}", rank=self.rank)

    def check_tag(self, tag, what: str) -> None:
        """Refuses a tag that cannot be hashed into a key."""
        # str and int tags are the common case: no hashing twice for them.
        if is_simple_tag(tag):
            return
        try:
            tag_key(self._comm_key, tag)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"{what}: tag {tag!r} is not valid: {exc}", rank=self.rank) from None

    def op(self, op, what: str | None = None) -> ReduceOp:
        """``op`` as a ReduceOp (a ReduceOp or its name)."""
        try:
            return as_reduce_op(op)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"{what + ': ' if what else ''}op: {exc}", rank=self.rank) from None

    def check_peer(self, peer, what: str) -> int:
        """``peer`` as an int: another rank of this communicator."""
        if isinstance(peer, bool) or not isinstance(peer, numbers.Integral):
            raise InvalidArgumentError(f"{what}: peer must be an int rank, not {type(peer).__name__} ({peer!r})",
                                       rank=self.rank)
        peer = int(peer)
        if not 0 <= peer < self.world_size:
            raise InvalidArgumentError(f"{what}: peer {peer} is outside 0..{self.world_size - 1}", rank=self.rank)
        if peer == self.rank:
            raise InvalidArgumentError(f"{what}: peer {peer} is this rank; a rank cannot {what} to itself "
                                       "(copy the buffer instead)", rank=self.rank)
        return peer

    def pair(self, send, recv, what: str, writes_recv: bool = True) -> tuple[Buffer, Buffer]:
        """A collective's send and recv as Buffers of this rank's memory.

        Args:
            send: the input, as the caller passed it.
            recv: the output; None: in place, into ``send``.
            what: the call, for messages.
            writes_recv: whether the collective writes recv on this rank (a
                read-only one is refused then).

        Returns:
            (send, recv).
        """
        if self.state.forked_from:
            self.state.check_open()   # before the buffers: in a forked child, CUDA cannot tell what they are
        try:
            s = as_buffer(send, f"{what} send")
            r = s if recv is None else as_buffer(recv, f"{what} recv")
        except InvalidArgumentError as exc:
            exc.rank = self.rank
            raise
        for b, name in ((s, "send"), (r, "recv")):
            self.check_memory(b, f"{what} {name}")
        if r.readonly and writes_recv:
            raise InvalidArgumentError(f"{what}: the output buffer ({'send, in place' if r is s else 'recv'}) is "
                                       "read-only; it must be writable", rank=self.rank)
        return s, r

    def check_memory(self, b: Buffer, what: str) -> None:
        """Refuses a non-empty buffer that is not this rank's kind of memory
        (host memory on the simulator, this rank's device on cuda).

        Args:
            b: the buffer.
            what: the buffer's name, for messages.
        """
        if b.count == 0:
            return
        if self._backend == "sim":
            if b.device_type != CPU:
                raise InvalidArgumentError(f"{what}: the sim backend moves host memory; got {b.device_type} memory",
                                           rank=self.rank)
        else:
            if b.device_type != CUDA:
                raise InvalidArgumentError(f"{what}: the cuda backend needs device memory; got host memory "
                                           "(move the array to the GPU)", rank=self.rank)
            if b.device != self._device:
                raise InvalidArgumentError(f"{what}: the buffer is on cuda:{b.device}, this rank runs on "
                                           f"cuda:{self._device}", rank=self.rank)

    def check_dtype(self, s: Buffer, r: Buffer, what: str) -> None:
        """Refuses send and recv of different element types."""
        if s.dtype != r.dtype:
            raise InvalidArgumentError(f"{what}: send is {s.dtype.name.lower()}, recv is {r.dtype.name.lower()}",
                                       rank=self.rank)

    def same_shape(self, s: Buffer, r: Buffer, expect_recv: int, what: str, recv_scale: str = "send") -> None:
        """Refuses a recv of another element type or of other than
        ``expect_recv`` elements (``recv_scale``: that count, in words)."""
        self.check_dtype(s, r, what)
        if r.count != expect_recv:
            raise InvalidArgumentError(f"{what}: recv has {r.count} elements, expected {recv_scale} = {expect_recv}",
                                       rank=self.rank)

    # -- descriptors -----------------------------------------------------------------
    def key(self, tag) -> int:
        """The 64-bit key of ``tag`` (None: the untagged sequence's)."""
        return self._seq_key if tag is None else tag_key(self._comm_key, tag)

    def geometry(self, kind: int, count: int, dtype: DataType) -> Geometry:
        """The path and geometry of a collective of this shape on this
        communicator (planning.plan_geometry)."""
        return plan_geometry(kind, count, dtype, self.world_size, self._channels, self._direct, self._options,
                             staged=self._staged, ll_reach=self._ll_reach)

    def task(self, kind: int, s: Buffer, r: Buffer, count: int, op: ReduceOp, root: int, tag, stream,
             geometry: Geometry | None = None, key=None, owned: bool = True) -> TaskDescriptor:
        """The descriptor of one collective (validated buffers in hand);
        ``owned=False`` keeps no reference to the buffers' owners (a
        descriptor kept for later calls on other buffers)."""
        if geometry is None:
            geometry = self.geometry(kind, count, s.dtype)
        if key is None:
            key = self.key(tag)
        flags, staging, send_reg = geometry.flags, geometry.fifo_bytes, 0
        if flags & TASK_STAGED and self.has_registered_memory():
            flags, staging, send_reg = self._registry.task_fields(s.ptr, s.nbytes, flags, staging)
        return TaskDescriptor(
            kind=KIND_NAMES[kind], tag=tag, rank=self.rank, key=key, transient=False, tags=self._endpoint.tags,
            flight=self._flight.ring, endpoint=self._endpoint.id, block_offset=self._block_offset, kind_code=kind,
            dtype=int(s.dtype), op=int(op),
            path=geometry.path, root=root, nchannels=geometry.nchannels, send_addr=s.ptr, recv_addr=r.ptr, count=count,
            slice_bytes=geometry.slice_bytes, fifo_slots=geometry.fifo_slots, flags=flags,
            staging_bytes=staging, stream=None if stream is None else stream_handle(stream),
            owners=(s.owner, r.owner) if owned else None, send_reg=send_reg)

    def plain_task(self, kind: int, s: Buffer, r: Buffer, count: int, op: ReduceOp, root: int, tag=None
                   ) -> TaskDescriptor | None:
        """The descriptor of a collective of this shape and tag (None, a str
        or an int: types whose equal values are the same tag), built on its
        first call and submitted at each later call's buffers
        (``submit_task(task, at)``, ``Daemon.submit_at``): a plain call then
        costs a dict lookup where it built a descriptor.  Each instance of
        the tag is still taken at submission.  None where the buffers decide
        more than the addresses (registered memory)."""
        if self.has_registered_memory():
            return None
        shape = (kind, count, s.dtype, op, root, tag)
        task = self._plain_tasks.get(shape)
        if task is None:
            if len(self._plain_tasks) >= _PLAIN_TASKS_KEPT:
                self._plain_tasks.clear()
            task = self._plain_tasks[shape] = self.task(kind, s, r, count, op, root, tag, None, owned=False)
        return task

    def has_registered_memory(self) -> bool:
        """Whether any memory is registered with this communicator: then a
        staged collective's flags depend on its input's address, and a kept
        descriptor does not serve every buffer of its shape."""
        return self._registry is not None and bool(self._registry.handles)

    # -- submission ------------------------------------------------------------------
    def submit(self, kind: int, s: Buffer, r: Buffer, count: int, op: ReduceOp, root: int, tag, stream,
               geometry: Geometry | None = None, key=None, after: Work | None = None, followed: bool = False,
               order_after: Work | None = None) -> Work:
        """Submits one collective of checked arguments: a Work completed at
        once for no elements, else its shape's kept descriptor (a plain call)
        or a new one.

        Args:
            kind: the collective's kind code.
            s, r: its send and recv (pair()).
            count: elements per rank (the kind's count).
            op: the reduction.
            root: the root rank (0 where the kind has none).
            tag: the collective's tag (None: untagged).
            stream: the CUDA stream it follows; None: run now.
            geometry: its planned geometry (a plan's); None: planned here.
            key: its tag's key (a plan's); None: from ``tag``.
            after, followed: the chain of a hierarchical collective's
                parts (Daemon.submit; with a part's ``key``: part_key).
            order_after: a Work the daemon runs this one after (the tag's
                order across a hierarchical collective: Daemon.submit).

        Returns:
            The Work of this rank's part, at once.
        """
        self.state.check_open()
        name = KIND_NAMES[kind]
        if count == 0:
            return Work.completed(name, tag, self.rank)
        check_overlap(kind, s, r, count, self.rank, self.world_size, name)
        if key is None and is_simple_tag(tag) and order_after is None:
            task = self.plain_task(kind, s, r, count, op, root, tag)
            if task is not None:
                return self.submit_task(task, (s.ptr, r.ptr, None if stream is None else stream_handle(stream),
                                               (s.owner, r.owner)))
        task = self.task(kind, s, r, count, op, root, tag, stream, geometry, key)
        return self.submit_task(task, after=after, followed=followed, order_after=order_after)

    def part_key(self, tag, part: tuple) -> int:
        """The key of part ``part`` (the whole's kind name, the part's
        number) of hierarchical collectives of ``tag``
        on this child (hierarchy.py): a tag of its own, so that the parts
        of one call meet each other whatever their shape, and ranks that
        disagree on the call's shape fail on its signature (MismatchError)
        rather than wait for each other under different tags."""
        return tag_key(self._comm_key, ("#part", part, ("#seq",) if tag is None else ("#tag", tag)))

    def all_reduce_kept(self, x, op, tag) -> Work | None:
        """The plain call's common case, an in-place sum of one plain array
        (buffers.plain_array) whose shape and tag have a kept descriptor
        (plain_task), checked as the general path checks it and submitted
        without a Buffer.  None where anything else holds: the general path
        then does, and explains, everything."""
        state = self.state
        if state.closed or state.aborted or state.lost_rank is not None or state.forked_from:
            return None
        if not (op is ReduceOp.SUM or (type(op) is str and op == "sum")) or not is_simple_tag(tag) \
                or self.has_registered_memory():
            return None
        cuda = self._backend != "sim"
        desc = plain_array(x, cuda)
        if desc is None:
            return None
        ptr, count, dtype, device = desc
        if cuda and (device if device is not None else runtime.cuda_pointer_info(ptr)) != self._device:
            return None
        task = self._plain_tasks.get((KIND_ALL_REDUCE, count, dtype, ReduceOp.SUM, 0, tag))
        if task is None:
            return None
        return self.submit_task(task, (ptr, ptr, None, (x, x)))

    def all_reduce_at(self, ptr: int, count: int, dtype: DataType, op: ReduceOp, stream: int | None,
                      owner: object, tag: object = None) -> Work:
        """In-place all-reduce of ``count`` elements at ``ptr``, memory the
        caller has checked is this communicator's kind and device, under
        ``tag`` (a simple tag: str, int or a tuple of them; None: untagged)
        (the torch backend's path, Communicator._all_reduce_at: no Buffer, no
        argument parsing)."""
        state = self.state
        if state.closed or state.aborted or state.lost_rank is not None:
            state.check_open()
        if count == 0:
            return Work.completed("all_reduce", None, self.rank)
        task = None if self.has_registered_memory() else self._plain_tasks.get((KIND_ALL_REDUCE, count, dtype, op, 0,
                                                                                tag))
        if task is None:
            b = self.buffer_at(ptr, count, dtype, owner)
            return self.submit(KIND_ALL_REDUCE, b, b, count, op, 0, tag, stream)
        return self.submit_task(task, (ptr, ptr, stream, (owner, owner)))

    def buffer_at(self, ptr: int, count: int, dtype: DataType, owner: object) -> Buffer:
        """``count`` elements at ``ptr``, memory the caller has checked is
        this communicator's kind and device (all_reduce_at)."""
        return Buffer(ptr, count, dtype, CPU if self._backend == "sim" else CUDA,
                      -1 if self._backend == "sim" else self._device, False, owner)

    def p2p(self, kind: int, buf, peer, tag, stream) -> Work:
        """Checks and submits a send or a recv (Communicator.send, .recv).

        Args:
            kind: KIND_SEND or KIND_RECV.
            buf: the buffer, as the caller passed it.
            peer: the other rank.
            tag: which exchange this is (None: call order per peer pair).
            stream: the CUDA stream it follows; None: run now.

        Returns:
            The Work of this rank's part, at once.
        """
        what = KIND_NAMES[kind]
        if self.state.forked_from:
            self.state.check_open()
        self.check_tag(tag, what)
        peer = self.check_peer(peer, what)
        try:
            b = as_buffer(buf, f"{what} buffer")
        except InvalidArgumentError as exc:
            exc.rank = self.rank
            raise
        self.check_memory(b, f"{what} buffer")
        if kind == KIND_RECV and b.readonly:
            raise InvalidArgumentError("recv: the buffer is read-only; it must be writable", rank=self.rank)
        self.state.check_open()
        # Empty messages are submitted too: they keep the pair's instance
        # numbers aligned and a count mismatch with the peer is still reported.
        src, dst = (self.rank, peer) if kind == KIND_SEND else (peer, self.rank)
        geometry = plan_p2p(b.count, b.dtype, self._channels, self._mode == "direct", self._options)
        task = TaskDescriptor(
            kind=what, tag=tag, rank=self.rank, key=pair_key(self._comm_key, src, dst, tag), transient=False,
            tags=self._endpoint.tags, flight=self._flight.ring, endpoint=self._endpoint.id,
            block_offset=self._block_offset, kind_code=kind, dtype=int(b.dtype), op=int(ReduceOp.SUM),
            path=geometry.path, root=peer, nchannels=geometry.nchannels,
            send_addr=b.ptr, recv_addr=b.ptr, count=b.count, slice_bytes=geometry.slice_bytes,
            fifo_slots=geometry.fifo_slots, staging_bytes=geometry.fifo_bytes if kind == KIND_RECV else 0,
            stream=None if stream is None else stream_handle(stream), owners=(b.owner,))
        return self.submit_task(task)

    def all_to_all(self, send, recv, send_splits, recv_splits, tag, stream, what: str,
                   order_after: Work | None = None) -> Work:
        """Checks and submits an all-to-all (Communicator.all_to_all,
        .all_to_all_single).

        Args:
            send, recv: the buffers, as the caller passed them.
            send_splits, recv_splits: elements for and from each rank; None:
                equal parts.
            tag: which exchange this is (None: call order).
            stream: the CUDA stream it follows; None: run now.
            what: the call, for messages.
            order_after: as submit() takes it.

        Returns:
            The Work of this rank's part, at once.
        """
        self.check_tag(tag, what)
        s, r = self.pair(send, recv, what)
        self.check_dtype(s, r, what)
        try:
            layout = resolve_splits(s.count, r.count, self.world_size, send_splits, recv_splits, what)
        except InvalidArgumentError as exc:
            exc.rank = self.rank
            raise
        if layout.send_counts[self.rank] != layout.recv_counts[self.rank]:
            raise InvalidArgumentError(
                f"{what}: this rank sends itself {layout.send_counts[self.rank]} elements but expects "
                f"{layout.recv_counts[self.rank]} from itself (send_splits[{self.rank}] != "
                f"recv_splits[{self.rank}])", rank=self.rank)
        if s.count and r.count and overlaps(s, r):
            raise InvalidArgumentError(f"{what}: send and recv overlap; an all-to-all cannot run in place",
                                       rank=self.rank)
        self.state.check_open()
        key = self.key(tag)
        owners = (s.owner, r.owner)
        sid = None if stream is None else stream_handle(stream)
        if self.world_size == 1:
            if s.count == 0:
                return Work.completed(what, tag, self.rank)
            geometry = plan_geometry(KIND_ALL_TO_ALL, s.count, s.dtype, 1, self._channels, True, self._options)
            return self.submit_task(self._a2a_task(what, tag, key, s, r, s.count, geometry, 0, sid, owners),
                                    order_after=order_after)
        plan = plan_all_to_all(layout, s.dtype, self.world_size, self._channels, self._mode, self._options)
        tags = self._endpoint.tags
        aux = tags.alloc_instance_staging(plan.aux_bytes)
        try:
            table = split_table(layout, plan.geometry.nchannels)
            # Not waited for: the stream that copies arms the collective.
            sid = self.daemon.device.stage_to_device(self._endpoint.arena + aux, table.ctypes.data, table.nbytes, sid)
            # The tag table takes the table back when the instance retires
            # (TagTable.release; a failed instance keeps it).
            return self.submit_task(self._a2a_task(what, tag, key, s, r, plan.count, plan.geometry, aux, sid,
                                                   owners, plan.aux_bytes), order_after=order_after)
        except BaseException:
            tags.free_instance_staging(aux, plan.aux_bytes)
            raise

    def _a2a_task(self, what, tag, key, s: Buffer, r: Buffer, count: int, geometry: Geometry, aux: int, stream,
                  owners, aux_bytes: int = 0) -> TaskDescriptor:
        return TaskDescriptor(
            kind=what, tag=tag, rank=self.rank, key=key, transient=False, tags=self._endpoint.tags,
            flight=self._flight.ring, endpoint=self._endpoint.id, block_offset=self._block_offset,
            kind_code=KIND_ALL_TO_ALL, dtype=int(s.dtype),
            op=int(ReduceOp.SUM), path=geometry.path, root=0, nchannels=geometry.nchannels, send_addr=s.ptr,
            recv_addr=r.ptr, count=count, flags=geometry.flags, stream=stream, owners=owners, aux_offset=aux,
            aux_bytes=aux_bytes)

    def submit_task(self, task: TaskDescriptor, at: tuple | None = None, after: Work | None = None,
                    followed: bool = False, order_after: Work | None = None) -> Work:
        """Submits ``task``, or with ``at`` = (send pointer, recv pointer,
        stream handle or None, owners) the same descriptor at those buffers;
        ``after``, ``followed``, ``order_after``: as submit() takes them."""
        try:
            if at is None:
                return self.daemon.submit(task, after=after, followed=followed, order_after=order_after)
            return self.daemon.submit_at(task, *at)
        except DfcclError as exc:
            if exc.rank is None:
                exc.rank = self.rank
            raise
