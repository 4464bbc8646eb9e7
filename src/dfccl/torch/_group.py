"""dfccl.torch's process group in Python: the whole backend where the
compiled one cannot be built (no C++ compiler), and the compiled backend's
Python side everywhere (its communicators, the plans it submits, and the
forms it hands over: lists, all-to-all, point-to-point, non-contiguous
tensors, PREMUL_SUM).

Each group gets one dfccl :class:`~dfccl.Communicator` per backend it
moves: "cuda" for CUDA tensors (device = the tensor's ordinal) and "sim" for
CPU tensors (simulated GPU = this process's global rank).  Ranks of a group
share a :class:`~dfccl.UniqueId` through the group's store.
"""

# No "from __future__ import annotations": DDP inspects the hook's annotations
# and wants the classes themselves.
import hashlib
import itertools
import queue
import threading
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

import dfccl
from dfccl.errors import CollectiveTimeoutError, DfcclError, InvalidArgumentError
from dfccl.termination import block_async_signals
from dfccl.torch._common import (DEFAULT_TIMEOUT, NotSupportedError, TorchCollectiveTimeoutError, as_buffer,
                                 capture_error, captured_wait_error, capturing, contiguous_or_copy,
                                 current_stream_handle, data_type, group_backend, map_error, op_name, plain_ops,
                                 reduce_op, seconds, shape_tag, status_error)

__all__ = ["BACKEND_NAME", "DEVICE_TYPES", "DfcclWork", "ProcessGroupDfccl"]

BACKEND_NAME = "dfccl"

#: The torch device types a dfccl group serves: CUDA tensors on the GPU daemon,
#: CPU tensors on the simulator.
DEVICE_TYPES = ("cuda", "cpu")

_UID_KEY = "dfccl/uid"


# -- completion thread -----------------------------------------------------------

class _Completer:
    """Completes torch futures of CPU (simulator) collectives.  Runs apart from
    dfccl's progress thread: future callbacks are user code and may block."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def post(self, fn: Callable[[], None]) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="dfccl-torch-completer", daemon=True)
                self._thread.start()
        self._queue.put(fn)

    def _run(self) -> None:
        block_async_signals()
        while True:
            fn = self._queue.get()
            try:
                fn()
            except Exception as exc:  # never let the thread die
                import warnings
                warnings.warn(f"dfccl.torch completion: {exc!r}", RuntimeWarning)


_completer = _Completer()


# -- work ------------------------------------------------------------------------

class DfcclWork(dist._Work):
    """The torch Work of one torch collective (one or more dfccl collectives).

    Keeps every tensor the collective touches alive until completion is
    observed.  CUDA: ``wait()`` makes the current stream wait, without
    blocking the host (with an explicit timeout it blocks the host, like
    torch's NCCL backend).  CPU: ``wait()`` blocks until completion, or,
    where the collectives follow a simulated stream (``cpu_stream``), makes
    that stream wait as CUDA's does."""

    def __init__(self, works: list, outputs: list[torch.Tensor], *, cuda: bool, device: int | None,
                 finish: Callable[[], None] | None = None, keepalive: object = None,
                 timeout: float | None = None, host_blocking: bool = False,
                 result: Callable[[], Any] | None = None, cpu_stream: int | None = None) -> None:
        super().__init__()
        self._works = works
        self._outputs = outputs
        self._cuda = cuda
        self._device = device
        self._cpu_stream = None if cuda else cpu_stream
        self._finish = finish
        self._keepalive = keepalive
        self._timeout = timeout
        self._host_blocking = host_blocking
        self._result_fn = result
        self._finished = False
        self._lock = threading.Lock()
        self._future: torch.futures.Future | None = None
        self._error: BaseException | None = None

    # Post-processing (copy-back of non-contiguous outputs, list outputs) runs
    # once: on CUDA on the stream that waited, on CPU after completion.
    def _run_finish(self) -> None:
        with self._lock:
            if self._finished:
                return
            self._finished = True
            fn, self._finish = self._finish, None
        if fn is not None:
            fn()
        self._keepalive = None

    def _synchronize(self, timeout: float | None) -> None:
        try:
            for w in self._works:
                w.synchronize(timeout)
        except BaseException as exc:
            raise map_error(exc) from exc.__cause__

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        limit = seconds(timeout)
        ordered = self._cuda or self._cpu_stream is not None
        if not ordered or self._host_blocking or limit is not None:
            self._synchronize(limit if limit is not None else self._timeout)
        if ordered:
            # The stream is released when a collective fails too; a failure
            # already seen is raised here rather than left to a later call.
            exc = self.exception()
            if exc is not None:
                raise exc
            stream = current_stream_handle(self._device) if self._cuda else self._cpu_stream
            for w in self._works:
                w.wait(stream)
        self._run_finish()
        return True

    def synchronize(self) -> None:
        """Blocks the host until the collective completes, raising its error
        if it failed (and, on CUDA, until the current stream has caught up
        with it)."""
        if self._cuda:
            self._synchronize(self._timeout)
        self.wait()
        if self._cuda:
            torch.cuda.current_stream(self._device).synchronize()

    def is_completed(self) -> bool:
        return all(w.done() for w in self._works)

    def is_success(self) -> bool:
        return self.is_completed() and all(w.exception() is None for w in self._works)

    def exception(self) -> BaseException | None:  # type: ignore[override]
        for w in self._works:
            exc = w.exception()
            if exc is not None:
                return map_error(exc)
        return None

    def result(self) -> list[torch.Tensor]:
        return self._outputs

    def _value(self) -> Any:
        return self._result_fn() if self._result_fn is not None else self._outputs

    def get_future(self) -> torch.futures.Future:
        with self._lock:
            if self._future is not None:
                return self._future
            if self._cuda:
                # Stream-ordered: the future's value is ready once the current
                # stream (which waits for the collective) reaches this point.
                fut = torch.futures.Future(devices=[torch.device("cuda", self._device)])
            else:
                fut = torch.futures.Future()
            self._future = fut
        if self._cuda:
            self.wait()
            fut.set_result(self._value())
            return fut
        remaining = [len(self._works)]
        count_lock = threading.Lock()

        def complete() -> None:
            exc = self.exception()
            if exc is not None:
                fut.set_exception(exc)
                return
            try:
                self._run_finish()
            except BaseException as e:
                fut.set_exception(e)
                return
            fut.set_result(self._value())

        def one_done(_w: Any) -> None:
            with count_lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                _completer.post(complete)

        if not self._works:
            _completer.post(complete)
        for w in self._works:
            w.add_done_callback(one_done)
        return fut

    @property
    def dfccl_works(self) -> list:
        """The dfccl :class:`~dfccl.Work` objects behind this work (stats, tags)."""
        return list(self._works)


# -- the process group -------------------------------------------------------------

def _derived_uid(uid: dfccl.UniqueId, backend: str) -> dfccl.UniqueId:
    """Same store, another communicator: one UniqueId (one store server) per
    group serves both its cuda and its sim communicator."""
    sub = hashlib.blake2b(uid.uid + backend.encode(), digest_size=16).digest()
    return dfccl.UniqueId(uid.host, uid.port, uid.secret, sub)


class ProcessGroupDfccl(dist.ProcessGroup):
    """A ``torch.distributed`` process group whose collectives run on dfccl.

    Created by ``dist.init_process_group("dfccl")`` / ``dist.new_group(...,
    backend="dfccl")``; the communicator of the group's default backend
    is created at once (a collective rendezvous, as group creation is), the
    other backend's on first use."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta | None = None, *,
                 compiled: bool = False, options: dfccl.CommOptions | None = None) -> None:
        # The (store, rank, size) constructor refuses Python subclasses in
        # torch 2.13 ("not an alias instance"); the store is kept here instead.
        super().__init__(rank, size)
        if options is not None and not isinstance(options, dfccl.CommOptions):
            raise InvalidArgumentError(f"the dfccl backend's pg_options must be a dfccl.CommOptions (the options of "
                                       f"the group's communicators), not {type(options).__name__}", rank=rank)
        self._options = options
        self._rank = rank
        self._size = size
        self._store = store
        self._timeout = timeout if isinstance(timeout, timedelta) and timeout.total_seconds() > 0 \
            else DEFAULT_TIMEOUT
        self._group_name = ""
        self._group_desc = ""
        self._timeout_s = self._timeout.total_seconds()
        self._comms: dict[str, dfccl.Communicator] = {}
        # torch device -> (communicator, is CUDA, CUDA index): where tensors on
        # that device go, once a collective there found it (allreduce's fast path).
        self._placed: dict[torch.device, tuple] = {}
        self._comm_lock = threading.Lock()
        self._closed = False
        # Serving the compiled backend (which submits the common forms
        # itself): this side's all-reduce fast path is not needed.
        self._compiled = compiled
        self._tag_ids: dict[Any, int] = {}
        self._tags: list[Any] = [None]
        # The simulated stream CPU tensors' collectives follow (None: none).
        self._cpu_stream: Any = None
        self._uid = self._exchange_uid()
        self._default_backend = group_backend()
        self._communicator(self._default_backend, self._default_device(self._default_backend))

    # -- identity ------------------------------------------------------------------
    def getBackendName(self) -> str:
        return BACKEND_NAME

    def getRank(self) -> int:
        return self._rank

    def getSize(self) -> int:
        return self._size

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def getGroupDesc(self) -> str:
        return self._group_desc

    # What torch may ask of a group's backend (see _get_backend): the p2p ops of
    # a batch are issued one by one (each is matched on its own), and groups
    # are made by rendezvous, not by splitting a communicator.
    supports_coalescing = False
    supports_splitting = False
    supports_shrinking = False
    supports_time_estimate = False

    def _get_backend(self, device: torch.device | str) -> "ProcessGroupDfccl":
        # torch >= 2.14 asks a group for its per-device backend (batch_isend_irecv
        # reads its supports_coalescing); a Python group registers none and
        # acts as its own backend, the way torch expects of Python groups.
        device_type = device.type if isinstance(device, torch.device) else torch.device(device).type
        if device_type not in DEVICE_TYPES:
            raise RuntimeError(f"No backend type associated with device type {device_type}")
        return self

    def __repr__(self) -> str:
        return f"<ProcessGroupDfccl {self._group_name or '?'} rank {self._rank}/{self._size}>"

    @property
    def timeout(self) -> timedelta:
        return self._timeout

    # -- communicators -------------------------------------------------------------
    def _exchange_uid(self) -> dfccl.UniqueId:
        if self._rank == 0:
            uid = dfccl.UniqueId.create()
            self._store.set(_UID_KEY, str(uid))
            return uid
        self._store.wait([_UID_KEY], self._timeout)
        value = self._store.get(_UID_KEY)
        return dfccl.UniqueId.from_string(value.decode() if isinstance(value, bytes) else value)

    def _default_device(self, backend: str) -> int:
        if backend == "cuda":
            return torch.cuda.current_device()
        # One simulated GPU per process (like one GPU per process on CUDA): every
        # group of this process shares its daemon.
        return dist.get_rank() if dist.is_initialized() else self._rank

    def _communicator(self, backend: str, device: int) -> dfccl.Communicator:
        key = backend
        with self._comm_lock:
            if self._closed:
                raise dfccl.ClosedError(f"process group {self._group_name!r} is shut down", rank=self._rank)
            comm = self._comms.get(key)
            if comm is None:
                uid = self._uid if backend == self._default_backend else _derived_uid(self._uid, backend)
                comm = dfccl.Communicator(uid, self._rank, self._size, device=device, backend=backend,
                                          timeout=self._timeout.total_seconds(), options=self._options)
                self._comms[key] = comm
        if comm.device != device:
            raise InvalidArgumentError(f"process group {self._group_name!r} runs on {backend}:{comm.device}; got a "
                                       f"tensor on {backend}:{device} (one device per rank, like NCCL)",
                                       rank=self._rank)
        return comm

    def _comm_for(self, t: torch.Tensor) -> dfccl.Communicator:
        if t.is_cuda:
            comm = self._communicator("cuda", t.device.index)
        elif t.device.type == "cpu":
            comm = self._communicator("sim", self._default_device("sim"))
        else:
            comm = None
        if comm is not None:
            if t.device not in self._placed:
                with self._comm_lock:
                    if not self._closed:
                        self._placed[t.device] = (comm, t.is_cuda, t.device.index if t.is_cuda else None)
            return comm
        raise InvalidArgumentError(f"dfccl moves CUDA tensors (and CPU tensors in the simulator), not "
                                   f"{t.device.type} tensors", rank=self._rank)

    def communicator(self, device: torch.device | str | None = None) -> dfccl.Communicator:
        """The dfccl communicator of this group for ``device`` (default: the
        communicator the group created first), for the low-level API (tags, plans, stats)."""
        if device is None:
            return self._communicator(self._default_backend, self._default_device(self._default_backend))
        device = torch.device(device)
        if device.type == "cuda":
            return self._communicator("cuda", device.index if device.index is not None
                                      else torch.cuda.current_device())
        return self._communicator("sim", self._default_device("sim"))

    # -- submission ------------------------------------------------------------------
    def _launch(self, name: str, tensors: Sequence[torch.Tensor],
                submit: Callable[[dfccl.Communicator, dict], list], outputs: list[torch.Tensor],
                opts: Any = None, finish: Callable[[], None] | None = None, keepalive: object = None,
                host_blocking: bool = False, result: Callable[[], Any] | None = None) -> DfcclWork:
        """Checks ``tensors`` (all on one device), calls ``submit(comm, kw)``
        (kw: the stream argument) and wraps the dfccl works it returns."""
        if not tensors:
            raise InvalidArgumentError(f"{name}: no tensors", rank=self._rank)
        first = tensors[0]
        for t in tensors:
            if t.device != first.device:
                raise InvalidArgumentError(f"{name}: tensors on {first.device} and {t.device}; a collective "
                                           "moves one device's memory", rank=self._rank)
        comm = self._comm_for(first)
        cuda = first.is_cuda
        kw: dict = {}
        cpu_stream = None if cuda or self._cpu_stream is None else self._cpu_stream.handle
        if cuda or cpu_stream is not None:
            if host_blocking and self._capturing(first):
                raise capture_error(name, self._rank)
            kw["stream"] = current_stream_handle(first.device.index) if cuda else cpu_stream
        works = submit(comm, kw)
        timeout = seconds(getattr(opts, "timeout", None)) if opts is not None else None
        return DfcclWork(works, outputs, cuda=cuda, device=first.device.index if cuda else None, finish=finish,
                         keepalive=keepalive, timeout=timeout or self._timeout_s,
                         host_blocking=host_blocking, result=result, cpu_stream=cpu_stream)

    def _capturing(self, t: torch.Tensor) -> bool:
        """Whether the stream ``t``'s collective follows captures a graph."""
        if t.is_cuda:
            return bool(capturing())
        return self._cpu_stream is not None and self._cpu_stream.capturing

    def set_cpu_stream(self, stream: Any) -> None:
        """Makes the collectives of CPU tensors (the simulator) follow the
        simulated stream ``stream`` (a SimStream of this group's simulated
        device; None: none, they run at once), as CUDA tensors' follow
        torch's current stream: stream-ordered, and captured while the
        stream captures a graph."""
        self._cpu_stream = stream

    @property
    def cpu_stream(self) -> Any:
        """The simulated stream CPU tensors' collectives follow, or None."""
        return self._cpu_stream

    def _tag(self, kind: str, t: torch.Tensor, count: int, op: Any, root: int) -> tuple:
        """The tag of a collective of a kind the compiled backend submits
        through plans (shape_tag).  The Python backend tags them the same
        way, so that both implementations match the same programs."""
        return shape_tag(kind, t, count, op, root)

    # -- the compiled backend's Python side ---------------------------------------------
    def _c_plan(self, kind: str, send: torch.Tensor, recv: torch.Tensor, op: Any, root: int,
                tag_id: int) -> tuple[int, Any]:
        """(address, owner) of the C API plan of a collective of this shape:
        the compiled backend submits it at each call's tensors.  Bound to
        no memory of its own (every submission names its buffers).  (0,
        None) for an all-reduce, reduce-scatter or all-gather that runs
        hierarchically (its communicator spans hosts: dfccl.hierarchy): the
        backend hands each call of the shape to this side, which chains its
        parts; on such a communicator also for every tagged all-reduce
        (``tag_id``), whose tag may carry shapes of both ways, which only
        this side keeps in order."""
        count = recv.numel() if kind == "reduce_scatter" else send.numel()
        if kind in ("all_reduce", "reduce_scatter", "all_gather"):
            hierarchy = self._comm_for(send).hierarchy
            if hierarchy is not None and ((tag_id and kind == "all_reduce")
                                          or hierarchy.takes(count, send.element_size(), kind)):
                return 0, None
        name = op_name(dist.ReduceOp.RedOpType(op)) if kind in ("all_reduce", "reduce", "reduce_scatter") \
            else "sum"
        tag = self._tags[tag_id] if tag_id else shape_tag(kind, send, count, name, root)
        comm = self._comm_for(send)
        kw: dict = {"tag": tag}
        if kind in ("all_reduce", "reduce", "reduce_scatter"):
            kw["op"] = name
        if kind in ("broadcast", "reduce"):
            kw["root"] = root
        plan = getattr(comm, f"prepare_{kind}")(count, data_type(send.dtype, kind), **kw)
        s = as_buffer(send, kind, owner=None)
        in_place = kind in ("all_reduce", "broadcast", "reduce") and send.data_ptr() == recv.data_ptr()
        bound = plan.bind(s, s if in_place else as_buffer(recv, kind, owner=None))
        return bound.c_plan, bound

    def _default_device_type(self) -> str:
        """"cuda" or "cpu": the device of the group's first communicator
        (where a barrier without a device goes)."""
        return "cuda" if self._default_backend == "cuda" else "cpu"

    def _captured_error(self, what: str, name: str) -> BaseException:
        return captured_wait_error(what, name, self._rank)

    def _tag_id(self, tag: Any) -> int:
        """A small int naming ``tag`` for the compiled backend's plan cache."""
        tag_id = self._tag_ids.get(tag)
        if tag_id is None:
            dfccl.tags.tag_key(0, tag)   # an invalid tag is refused here
            tag_id = self._tag_ids[tag] = len(self._tags)
            self._tags.append(tag)
        return tag_id

    def _tagged_allreduce_by_id(self, tensor: torch.Tensor, tag_id: int, op: Any) -> "DfcclWork":
        return self.tagged_allreduce(tensor, self._tags[tag_id], op)

    def _collective_error(self, what: str, status: int, detail: int) -> BaseException:
        return map_error(status_error(self._rank, what, status, detail))

    def _api_error(self, what: str, message: str) -> BaseException:
        return DfcclError(f"rank {self._rank}: {what}: {message}", rank=self._rank)

    def _timeout_error(self, what: str, timeout_s: float) -> BaseException:
        return TorchCollectiveTimeoutError(
            f"rank {self._rank}: {what} did not complete within {timeout_s:g} s (comm.status() of the group's "
            "communicator on every rank shows what each waits for)", rank=self._rank)

    @staticmethod
    def _copy_back(copy_back: list, extra: Callable[[], None] | None = None) -> Callable[[], None] | None:
        if not copy_back and extra is None:
            return None

        def finish() -> None:
            if extra is not None:
                extra()
            for dst, src in copy_back:
                dst.copy_(src)
        return finish

    def _one(self, tensors: Sequence[torch.Tensor], name: str) -> torch.Tensor:
        if len(tensors) != 1:
            raise InvalidArgumentError(f"{name}: dfccl takes one tensor per rank (got {len(tensors)}); multi-GPU "
                                       "per process lists are deprecated in torch", rank=self._rank)
        return tensors[0]

    # -- all-reduce -------------------------------------------------------------------
    def _all_reduce(self, tensors: Sequence[torch.Tensor], op: Any, opts: Any, tag: Any = None,
                    name: str = "allreduce") -> DfcclWork:
        dop, factor = reduce_op(op)
        copy_back: list = []
        bufs = [contiguous_or_copy(t, copy_back) for t in tensors]

        def submit(comm, kw):
            if factor is not None:
                for b in bufs:  # on the current stream, so before the collective
                    b.mul_(factor)
            return [comm.all_reduce(as_buffer(b, name), op=dop, tag=self._tag("all_reduce", b, b.numel(), dop, 0)
                                    if tag is None else tag, **kw) for b in bufs]
        return self._launch(name, list(tensors), submit, list(tensors), opts, self._copy_back(copy_back),
                            keepalive=bufs)

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> DfcclWork:
        t = self._one(tensors, "allreduce")
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        # The common case (DDP's gradient buckets): one contiguous tensor of a
        # dtype seen before, a plain reduction, on a device this group has
        # run on.  It goes straight to the communicator's plain-call path:
        # inside a backward pass, where caches are cold, every Python layer
        # skipped counts several times over (docs/torch.md, "Host time").
        placed = self._placed.get(t.device)
        # (CPU tensors on a simulated stream take _launch, which orders them.)
        if placed is not None and not self._compiled and t.is_contiguous() and \
                (t.is_cuda or self._cpu_stream is None):
            red_op = op.op if hasattr(op, "op") else op
            dop = plain_ops.get(red_op)
            dtype = data_type(t.dtype, "allreduce")
            if dop is not None and dtype is not None:
                comm, cuda, index = placed
                stream = None
                if cuda:
                    stream = current_stream_handle(index)
                count = t.numel()
                work = comm._all_reduce_at(t.data_ptr(), count, dtype, dop, stream, t,
                                           self._tag("all_reduce", t, count, op_name(red_op), 0))
                timeout = seconds(opts.timeout) if opts is not None else None
                return DfcclWork([work], tensors, cuda=cuda, device=index, timeout=timeout or self._timeout_s)
        return self._all_reduce([t], op, opts)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> DfcclWork:
        return self._all_reduce(list(tensors), opts.reduceOp if opts is not None else dist.ReduceOp.SUM, opts,
                                name="allreduce_coalesced")

    def tagged_allreduce(self, tensor: torch.Tensor, tag: Any, op: Any = dist.ReduceOp.SUM) -> DfcclWork:
        """All-reduce matched by ``tag`` instead of call order: the k-th use of
        a tag on one rank meets the k-th use on every rank, whatever else the
        ranks issue in between.  The tag (a str, an int, or a tuple of those)
        must be the same on all ranks."""
        return self._all_reduce([tensor], op, None, tag=tag, name="tagged_allreduce")

    # -- broadcast / reduce -----------------------------------------------------------
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> DfcclWork:
        t = self._one(tensors, "broadcast")
        root = opts.rootRank if opts is not None else 0
        copy_back: list = []
        b = contiguous_or_copy(t, copy_back)

        def submit(comm, kw):
            return [comm.broadcast(as_buffer(b, "broadcast"), root=root,
                                   tag=self._tag("broadcast", b, b.numel(), "sum", root), **kw)]
        return self._launch("broadcast", [t], submit, [t], opts, self._copy_back(copy_back), keepalive=b)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> DfcclWork:
        t = self._one(tensors, "reduce")
        root = opts.rootRank if opts is not None else 0
        dop, factor = reduce_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        copy_back: list = []
        b = contiguous_or_copy(t, copy_back)

        def submit(comm, kw):
            if factor is not None:
                b.mul_(factor)
            return [comm.reduce(as_buffer(b, "reduce"), op=dop, root=root,
                                tag=self._tag("reduce", b, b.numel(), dop, root), **kw)]
        return self._launch("reduce", [t], submit, [t], opts, self._copy_back(copy_back), keepalive=b)

    # -- all-gather -------------------------------------------------------------------
    def _gather_into(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any,
                     name: str) -> DfcclWork:
        pairs = []
        copy_back: list = []
        for out, inp in zip(outputs, inputs, strict=True):
            if out.numel() != inp.numel() * self._size:
                raise InvalidArgumentError(f"{name}: output has {out.numel()} elements, expected world size "
                                           f"{self._size} x input ({inp.numel()})", rank=self._rank)
            pairs.append((contiguous_or_copy(out, copy_back), inp.contiguous()))

        def submit(comm, kw):
            return [comm.all_gather(as_buffer(i, name), as_buffer(o, name),
                                    tag=self._tag("all_gather", i, i.numel(), "sum", 0), **kw) for o, i in pairs]
        return self._launch(name, list(outputs) + list(inputs), submit, list(outputs), opts,
                            self._copy_back(copy_back), keepalive=pairs)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> DfcclWork:
        return self._gather_into([output], [input], opts, "all_gather_into_tensor")

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> DfcclWork:
        return self._gather_into(list(outputs), list(inputs), opts, "allgather_into_tensor_coalesced")

    # torch >= 2.13 names (dist.all_gather_single / all_gather_into_tensor and
    # their coalesced forms); earlier releases call the two methods above.
    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> DfcclWork:
        return self._gather_into([output], [input], opts, "all_gather_single")

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts: Any = None) -> DfcclWork:
        return self._gather_into(list(outputs), list(inputs), opts, "all_gather_single_coalesced")

    def _gather_lists(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any,
                      name: str) -> DfcclWork:
        # Each list goes through a flat temporary: one dfccl all-gather per input.
        flats = []
        for outs, inp in zip(output_lists, inputs, strict=True):
            if len(outs) != self._size:
                raise InvalidArgumentError(f"{name}: {len(outs)} output tensors, expected world size {self._size}",
                                           rank=self._rank)
            for o in outs:
                if o.numel() != inp.numel() or o.dtype != inp.dtype:
                    raise InvalidArgumentError(f"{name}: every output must match the input ({inp.numel()} x "
                                               f"{inp.dtype}); got {o.numel()} x {o.dtype}", rank=self._rank)
            flat = torch.empty(inp.numel() * self._size, dtype=inp.dtype, device=inp.device)
            flats.append((flat, inp.contiguous(), outs))

        def submit(comm, kw):
            return [comm.all_gather(as_buffer(i, name), as_buffer(f, name),
                                    tag=self._tag("all_gather", i, i.numel(), "sum", 0), **kw) for f, i, _ in flats]

        def finish():
            for flat, inp, outs in flats:
                n = inp.numel()
                for r, o in enumerate(outs):
                    o.copy_(flat[r * n:(r + 1) * n].view(o.shape))
        outputs = [o for outs in output_lists for o in outs]
        return self._launch(name, outputs + list(inputs), submit, outputs, opts, finish, keepalive=flats,
                            result=lambda: [list(outs) for outs in output_lists])

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
                  opts: Any = None) -> DfcclWork:
        self._one(input_tensors, "allgather")
        return self._gather_lists(output_tensors, input_tensors, opts, "allgather")

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], input_list: list[torch.Tensor],
                            opts: Any = None) -> DfcclWork:
        # Here output_lists[rank][i] receives input i of that rank (allgather's
        # lists are the other way round: outputs[i][rank]).
        if len(output_lists) != self._size or any(len(o) != len(input_list) for o in output_lists):
            raise InvalidArgumentError(f"allgather_coalesced: expected {self._size} output lists of "
                                       f"{len(input_list)} tensors", rank=self._rank)
        per_input = [[output_lists[r][i] for r in range(self._size)] for i in range(len(input_list))]
        work = self._gather_lists(per_input, input_list, opts, "allgather_coalesced")
        work._result_fn = lambda: [list(o) for o in output_lists]
        return work

    # -- reduce-scatter ---------------------------------------------------------------
    def _scatter_into(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any,
                      name: str) -> DfcclWork:
        dop, factor = reduce_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        pairs = []
        copy_back: list = []
        for out, inp in zip(outputs, inputs, strict=True):
            if inp.numel() != out.numel() * self._size:
                raise InvalidArgumentError(f"{name}: input has {inp.numel()} elements, expected world size "
                                           f"{self._size} x output ({out.numel()})", rank=self._rank)
            # The premultiplied input is a copy: the caller's input stays intact.
            src = inp.contiguous() if factor is None else inp.contiguous().clone()
            pairs.append((contiguous_or_copy(out, copy_back), src))

        def submit(comm, kw):
            works = []
            for o, i in pairs:
                if factor is not None:
                    i.mul_(factor)
                works.append(comm.reduce_scatter(as_buffer(i, name), as_buffer(o, name), op=dop,
                                                 tag=self._tag("reduce_scatter", o, o.numel(), dop, 0), **kw))
            return works
        return self._launch(name, list(outputs) + list(inputs), submit, list(outputs), opts,
                            self._copy_back(copy_back), keepalive=pairs)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> DfcclWork:
        return self._scatter_into([output], [input], opts, "reduce_scatter_tensor")

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> DfcclWork:
        return self._scatter_into(list(outputs), list(inputs), opts, "reduce_scatter_tensor_coalesced")

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> DfcclWork:
        return self._scatter_into([output], [input], opts, "reduce_scatter_single")

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> DfcclWork:
        return self._scatter_into(list(outputs), list(inputs), opts, "reduce_scatter_single_coalesced")

    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                       opts: Any = None) -> DfcclWork:
        out = self._one(output_tensors, "reduce_scatter")
        if len(input_tensors) != 1 or len(input_tensors[0]) != self._size:
            raise InvalidArgumentError(f"reduce_scatter: expected one list of {self._size} input tensors",
                                       rank=self._rank)
        for i in input_tensors[0]:
            if i.numel() != out.numel() or i.dtype != out.dtype:
                raise InvalidArgumentError(f"reduce_scatter: every input must match the output ({out.numel()} x "
                                           f"{out.dtype}); got {i.numel()} x {i.dtype}", rank=self._rank)
        # A flat temporary holding the inputs back to back (torch.cat copies on
        # the current stream, before the collective).
        flat = torch.cat([i.reshape(-1) for i in input_tensors[0]])
        return self._scatter_into([out], [flat], opts, "reduce_scatter")

    # -- barrier ----------------------------------------------------------------------
    def barrier(self, opts: Any = None) -> DfcclWork:
        device = getattr(opts, "device", None) if opts is not None else None
        backend = self._default_backend
        if device is not None and device.type == "cpu":
            backend = "sim"
        if backend == "cuda":
            index = device.index if device is not None and device.type == "cuda" and device.index is not None \
                else torch.cuda.current_device()
            t = torch.zeros(1, dtype=torch.int32, device=torch.device("cuda", index))
        else:
            t = torch.zeros(1, dtype=torch.int32)

        def submit(comm, kw):
            return [comm.all_reduce(as_buffer(t, "barrier"), tag=self._tag("all_reduce", t, 1, "sum", 0), **kw)]
        # A barrier blocks the host in wait(), as torch's other backends do;
        # under CUDA graph capture it is captured, and wait() makes the
        # stream (so every replay) wait for every rank's barrier instead.
        blocking = not self._capturing(t)
        return self._launch("barrier", [t], submit, [t], opts, keepalive=t, host_blocking=blocking)

    # -- what dfccl does not have (yet) -------------------------------------------------
    def _missing(self, what: str) -> NotSupportedError:
        return NotSupportedError(f"{what} is not implemented by dfccl yet (dfccl has all_reduce, all_gather, "
                                 "reduce_scatter, broadcast, reduce, send / recv and all-to-all)", rank=self._rank)

    # -- point to point --------------------------------------------------------------
    # torch's tag 0 (its default) is dfccl's untagged send / recv: matched in
    # call order per peer pair, like NCCL.  Other tags are matched by tag.
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> DfcclWork:
        t = self._one(tensors, "send")
        b = t.contiguous()

        def submit(comm, kw):
            return [comm.send(as_buffer(b, "send"), dst, tag=tag or None, **kw)]
        return self._launch("send", [t], submit, [], None, keepalive=b)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> DfcclWork:
        t = self._one(tensors, "recv")
        copy_back: list = []
        b = contiguous_or_copy(t, copy_back)

        def submit(comm, kw):
            return [comm.recv(as_buffer(b, "recv"), src, tag=tag or None, **kw)]
        return self._launch("recv", [t], submit, [t], None, self._copy_back(copy_back), keepalive=b)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> DfcclWork:
        raise NotSupportedError("recv from any source is not supported by dfccl: a recv is matched to one "
                                "sender by (peer, tag) so that it cannot deadlock; pass src", rank=self._rank)

    # -- all-to-all -------------------------------------------------------------------
    def _rows_to_elements(self, t: torch.Tensor, splits: list[int]) -> list[int] | None:
        """torch splits count rows (dim 0); dfccl's count elements."""
        if not splits:
            return None
        row = t.numel() // t.shape[0] if t.dim() > 0 and t.shape[0] else 1
        return [int(s) * row for s in splits]

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                      input_split_sizes: list[int], opts: Any = None) -> DfcclWork:
        send_splits = self._rows_to_elements(input, list(input_split_sizes))
        recv_splits = self._rows_to_elements(output, list(output_split_sizes))
        copy_back: list = []
        out = contiguous_or_copy(output, copy_back)
        inp = input.contiguous()

        def submit(comm, kw):
            return [comm.all_to_all_single(as_buffer(inp, "all_to_all_single"), as_buffer(out, "all_to_all_single"),
                                           send_splits=send_splits, recv_splits=recv_splits, **kw)]
        return self._launch("all_to_all_single", [output, input], submit, [output], opts,
                            self._copy_back(copy_back), keepalive=(out, inp))

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                          input_split_sizes: list[int], opts: Any = None) -> DfcclWork:
        return self.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts: Any = None) -> DfcclWork:
        if len(output_tensors) != self._size or len(input_tensors) != self._size:
            raise InvalidArgumentError(f"alltoall: expected {self._size} input and {self._size} output tensors, got "
                                       f"{len(input_tensors)} and {len(output_tensors)}", rank=self._rank)
        dtypes = {t.dtype for t in list(output_tensors) + list(input_tensors)}
        if len(dtypes) != 1:
            raise InvalidArgumentError(f"alltoall: tensors of several dtypes ({sorted(map(str, dtypes))})",
                                       rank=self._rank)
        # Flat temporaries: inputs back to back (torch.cat copies on the current
        # stream, before the all-to-all), outputs copied out after it.
        flat_in = torch.cat([t.reshape(-1) for t in input_tensors])
        flat_out = torch.empty(sum(t.numel() for t in output_tensors), dtype=flat_in.dtype, device=flat_in.device)
        send_splits = [t.numel() for t in input_tensors]
        recv_splits = [t.numel() for t in output_tensors]

        def submit(comm, kw):
            return [comm.all_to_all_single(as_buffer(flat_in, "alltoall"), as_buffer(flat_out, "alltoall"),
                                           send_splits=send_splits, recv_splits=recv_splits, **kw)]

        def finish():
            at = 0
            for o in output_tensors:
                o.copy_(flat_out[at:at + o.numel()].view(o.shape))
                at += o.numel()
        return self._launch("alltoall", list(output_tensors) + list(input_tensors), submit, list(output_tensors),
                            opts, finish, keepalive=(flat_in, flat_out), result=lambda: list(output_tensors))

    def gather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
               opts: Any = None) -> DfcclWork:
        raise self._missing("gather (rooted, point-to-point based)")

    def scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                opts: Any = None) -> DfcclWork:
        raise self._missing("scatter (rooted, point-to-point based)")

    # -- lifetime ---------------------------------------------------------------------
    def shutdown(self) -> None:
        """Closes this group's communicators (collectives still pending are
        aborted)."""
        with self._comm_lock:
            self._closed = True
            comms, self._comms = list(self._comms.values()), {}
            self._placed = {}
        for c in comms:
            c.close()
        if self._rank == 0:
            self._uid.close()

    def abort(self) -> None:
        """Fails every pending collective of this group on this rank without
        waiting for peers, then closes the communicators."""
        with self._comm_lock:
            comms = list(self._comms.values())
        for c in comms:
            c.abort()
        self.shutdown()

