"""Communicators: a rank's API, its start-up and its life.

A collective call checks its arguments and buffers, names its instance (tag
-> key, k-th use), picks its path and geometry (planning.py), reserves a tag
record and, on the ring path, staging FIFOs, then hands one descriptor to the
device's daemon (Daemon.submit), all through its rank's Submitter
(submission.py).  It returns a Work at once; nothing here waits for peers.
Prepared collectives (prepare_*) are in plans.py."""

from __future__ import annotations

import logging
import secrets
import threading
import time
import warnings
from dataclasses import replace
from typing import Sequence

from dfccl import liveness, runtime
from dfccl._deprecated import renamed_keywords
from dfccl._native.layout import (KIND_ALL_GATHER, KIND_ALL_REDUCE, KIND_BROADCAST, KIND_RECV, KIND_REDUCE,
                                  KIND_REDUCE_SCATTER, KIND_SEND, MAX_RANKS, RANK_ABORTED, RANK_CLOSED)
from dfccl._native.work import Work
from dfccl.arguments import check_int, check_options, check_seconds
from dfccl.bootstrap import StoreBootstrap
from dfccl.buffers import CPU, CUDA, Buffer, as_buffer
from dfccl.diagnostics import EndpointDiagnostics
from dfccl.endpoint import Endpoint
from dfccl.errors import DfcclError, InvalidArgumentError
from dfccl.flight import CommStatus, FlightRecorder, PendingStatus
from dfccl.hierarchy import Hierarchy, HierarchyInfo, host_layout
from dfccl.local_group import LocalGroup
from dfccl.options import CommOptions, DaemonOptions
from dfccl.planning import default_ll_max_bytes, ll_capable
from dfccl.plans import BoundPlan, Plan
from dfccl.rank_state import RankState
from dfccl.registration import Registry, RegistrationHandle
from dfccl.sharing import daemon_share, shared_gpu_warning
from dfccl.split import check_color, check_key, split_local, split_through_store
from dfccl.submission import Submitter
from dfccl.types import KIND_NAMES, DataType, ReduceOp, as_data_type
from dfccl.unique_id import UniqueId

__all__ = ["Communicator", "Plan", "BoundPlan", "DEFAULT_STARTUP_TIMEOUT"]

_log = logging.getLogger("dfccl")

#: Seconds a communicator's start-up may take by default.  Long enough for
#: ranks that a job launcher starts tens of seconds apart (interpreter, CUDA
#: and framework start-up), short enough that a rank that never comes is
#: reported within two minutes rather than looking like a hang.
DEFAULT_STARTUP_TIMEOUT = 120.0


# Marks an argument that a kind of collective does not take (None is a value
# users pass, and must be rejected as a root or op).
_UNUSED = object()


class Communicator:
    """A group of ranks that run collectives together.

    Create one per rank with a shared :class:`UniqueId` (any mix of threads,
    processes and hosts), or several at once in this process with
    :meth:`for_devices`.  Collectives return a :class:`Work` immediately.
    Collectives are matched by tag: the k-th use of a tag on one rank meets
    the k-th use of that tag on every rank, in whatever order ranks issue
    them; without a tag, the k-th untagged collective of this communicator.

    What every collective takes:

    - ``tag``: which collective this is: the k-th use of a tag on every rank
      is one collective (None: the k-th untagged one).
    - ``stream``: a CUDA stream (torch, CuPy or a handle) the collective
      follows and that later work on it waits for; None: run now.
    - ``op`` (the reducing ones): a ReduceOp or its name: sum, prod, min,
      max, avg.
    """

    @renamed_keywords(context_options="daemon_options")
    def __init__(self, unique_id: UniqueId, rank: int, world_size: int, *, device: int | None = None,
                 backend: str | None = None, options: CommOptions | None = None,
                 daemon_options: DaemonOptions | None = None, timeout: float = DEFAULT_STARTUP_TIMEOUT):
        """Joins the communicator of ``unique_id`` as ``rank``.

        Args:
            unique_id: the id rank 0 created (UniqueId.create) and shared.
            rank: this rank, 0 <= rank < world_size.
            world_size: the number of ranks.
            device: the GPU (or simulated device); None: rank modulo the
                visible devices.
            backend: "cuda", "sim" or None (cuda where a GPU is visible).
            options: how this communicator moves data.
            daemon_options: how the device's daemon runs (its first user sets them).
            timeout: seconds that start-up may take in all (reaching the
                store, every rank arriving, every rank mapping its peers).

        Raises:
            StartupTimeoutError: past ``timeout``, naming the ranks that did not arrive.
            PeerAbortedError: another rank's start-up failed.
        """
        if not isinstance(unique_id, UniqueId):
            raise InvalidArgumentError(f"unique_id must be a dfccl.UniqueId, not {type(unique_id).__name__} "
                                       "(decode a shared string with UniqueId.from_string)")
        world_size = check_int("world_size", world_size, 1)
        if world_size > MAX_RANKS:
            raise InvalidArgumentError(f"world_size {world_size} is above the {MAX_RANKS} ranks a communicator "
                                       "supports")
        rank = check_int("rank", rank, 0)
        if rank >= world_size:
            raise InvalidArgumentError(f"rank {rank} is outside 0..{world_size - 1} (world_size {world_size})")
        if device is not None:
            device = check_int("device", device, 0)
        check_options(backend, options, daemon_options)
        timeout = check_seconds("timeout", timeout, positive=True)
        deadline = time.monotonic() + timeout
        backend = runtime.resolve_backend(backend)
        if device is None:
            device = rank % runtime.device_count(backend) if backend == "cuda" else rank
        boot = StoreBootstrap(unique_id, rank, world_size, timeout, deadline)
        try:
            # Peers in other processes may map our arena for as long as they live.
            self._init_local(backend, device, rank, world_size, options, daemon_options, unique_id.comm_key(),
                             shareable=True, group=LocalGroup(1, closes_memory=False), unique_id=unique_id)
        except DfcclError as exc:
            boot.tell_peers(exc)
            raise
        try:
            boot.run(self._endpoint.describe(), self._finish_init)
        except BaseException:
            # Once published, peers may hold our arena's address: keep the
            # memory, drop only the shared-memory name.
            self._state.closed = True
            self._endpoint.release(free_memory=not boot.published)
            raise
        # Every peer has mapped our arena: its name is no longer needed.
        self._endpoint.unlink_export()
        self._build_hierarchy(deadline)

    def _build_hierarchy(self, deadline: float) -> None:
        """Across hosts with several ranks on each: the children that
        hierarchical all-reduces run on (hierarchy.py), split off now, while
        every rank is here (two splits, collective)."""
        layout = host_layout(self._host_ids)
        if layout is None or not self._options.hierarchy_min_bytes:
            return
        left = max(deadline - time.monotonic(), 1.0)
        try:
            local = self.split(layout.host[self._rank], timeout=left)
            cross = self.split(layout.local[self._rank], timeout=max(deadline - time.monotonic(), 1.0))
        except BaseException:
            self.close()
            raise
        self._hierarchy = Hierarchy.create(rank=self._rank, layout=layout,
                                           min_bytes=self._options.hierarchy_min_bytes, submitter=self._submitter,
                                           local=local, cross=cross,
                                           local_submitter=local._submitter, cross_submitter=cross._submitter,
                                           daemon=self._daemon)
        local._speak_as_part(self._hierarchy.local_ranks, "in the communicator of its host's ranks, which runs "
                             "parts of hierarchical all-reduces")
        cross._speak_as_part(self._hierarchy.cross_ranks, "in the communicator of the ranks of its place on every "
                             "host, which runs parts of hierarchical all-reduces")

    @classmethod
    @renamed_keywords(context_options="daemon_options")
    def for_devices(cls, devices: Sequence[int], *, backend: str | None = None, options: CommOptions | None = None,
                    daemon_options: DaemonOptions | None = None) -> list["Communicator"]:
        """One communicator per entry of ``devices``, all in this process.
        Like ncclCommInitAll.

        Args:
            devices: rank i runs on devices[i] (a device may appear several times).
            backend: "cuda", "sim" or None (cuda where a GPU is visible).
            options: how the communicators move data.
            daemon_options: how the devices' daemons run.

        Returns:
            The communicators, rank order.
        """
        try:
            if isinstance(devices, (str, bytes)):
                raise TypeError
            devices = list(devices)
        except TypeError:
            raise InvalidArgumentError(f"devices must be a sequence of device numbers, not {type(devices).__name__}") \
                from None
        devices = [check_int(f"devices[{i}]", d, 0) for i, d in enumerate(devices)]
        if not devices:
            raise InvalidArgumentError("for_devices needs at least one device")
        if len(devices) > MAX_RANKS:
            raise InvalidArgumentError(f"for_devices got {len(devices)} devices; a communicator has at most "
                                       f"{MAX_RANKS} ranks")
        check_options(backend, options, daemon_options)
        backend = runtime.resolve_backend(backend)
        comm_key = int.from_bytes(secrets.token_bytes(8), "little") or 1
        group = LocalGroup(len(devices), closes_memory=True)
        comms = [cls._create_local(backend, dev, rank, len(devices), options, daemon_options, comm_key, group)
                 for rank, dev in enumerate(devices)]
        peers = [c._endpoint.describe() for c in comms]
        for c in comms:
            c._finish_init(peers)
        return comms

    @classmethod
    def _create_local(cls, backend, device, rank, world_size, options, daemon_options, comm_key,
                      group: LocalGroup) -> "Communicator":
        """A rank of a communicator whose ranks all live in this process
        (``group``), before it meets its peers (_finish_init)."""
        self = cls.__new__(cls)
        self._init_local(backend, device, rank, world_size, options, daemon_options, comm_key, shareable=False,
                         group=group, unique_id=None)
        return self

    # -- construction ------------------------------------------------------------
    def _init_local(self, backend, device, rank, world_size, options, daemon_options, comm_key, shareable,
                    group: LocalGroup, unique_id: UniqueId | None):
        self._backend = backend
        self._device = device
        self._rank = rank
        self._size = world_size
        self._comm_key = comm_key
        self._user_options = options
        self._options = (options or CommOptions()).resolved(backend)
        self._unique_id = unique_id   # set when created from one (split and register use its store)
        self._group = group
        self._registry: Registry | None = None
        self._splits = 0
        self._daemon = runtime.get_daemon(backend, device, daemon_options)
        opts = self._options
        if opts.protocol == "simple":
            self._options = replace(opts, ll_max_bytes=0)
        elif opts.ll_max_bytes is None:
            capacity = opts.max_tags
            ll = default_ll_max_bytes(capacity, world_size, opts.ll_memory_bytes) if ll_capable(world_size, True) else 0
            self._options = replace(opts, ll_max_bytes=ll)
        self._channels = min(self._daemon.nblocks, self._options.channels or self._daemon.nblocks)
        self._endpoint = Endpoint(self._daemon, rank=rank, nranks=world_size, options=self._options,
                                  shareable=shareable)
        self._plans = 0
        self._diag: EndpointDiagnostics | None = None
        self._flight = FlightRecorder(rank=rank, world_size=world_size, comm_key=comm_key, backend=backend,
                                      device=device, maxlen=self._options.flight_events)
        # Closed, aborted, a lost peer: shared with the threads that watch this rank.
        self._state = RankState(rank=rank, comm_key=comm_key, where=f"{backend}:{device}", endpoint=self._endpoint,
                                daemon=self._daemon, flight=self._flight, peer_timeout=self._options.peer_timeout)
        self._submitter: Submitter | None = None   # once the rank has met its peers (_finish_init)
        self._host_ids: list | None = None        # every rank's host (_finish_init)
        self._hierarchy: Hierarchy | None = None   # children for hierarchical all-reduces (_build_hierarchy)
        self._barrier_ptr = 0   # barrier()'s word in this rank's arena, taken at its first call

    def _finish_init(self, peers, exchange=None):
        self._channels, self._block_offset = daemon_share(peers, self._rank, self._channels)
        self._host_ids = [info.get("host_id") for info in peers]
        mode = self._endpoint.connect(peers, self._comm_key, exchange)
        if self._endpoint.net is not None:
            self._options = (self._user_options or CommOptions()).resolved_for_network(self._options)
        why = shared_gpu_warning(peers, self._rank)
        if why is not None:
            warnings.warn(why, RuntimeWarning, stacklevel=3)
        if self._options.path == "direct" and mode == "ring":
            raise InvalidArgumentError("path='direct' needs every peer reachable (ranks of this process, or of this "
                                       "host with peer access between the devices); use 'auto' or 'ring'")
        if self._options.path == "ring":
            mode = "ring"
        # LL writes into every peer's arena: mapped, or across hosts a mirror
        # that the proxy carries (every rank of such a communicator has a
        # remote peer, so all plan alike).
        ll_reach = mode != "ring" or self._endpoint.net is not None
        if self._options.protocol == "ll" and not (ll_capable(self._size, ll_reach) and self._options.ll_max_bytes):
            raise InvalidArgumentError(f"protocol='ll' needs 2..8 ranks whose arenas all map each other or span "
                                       f"hosts (path {mode!r}, {self._size} ranks) and ll_max_bytes > 0; use "
                                       f"'auto' or 'simple'")
        self._mode = mode
        self._direct = mode != "ring"
        self._ll_reach = ll_reach
        self._staged = mode == "staged"
        self._registry = (Registry(self._endpoint, self._rank, self._size, self._unique_id)
                          if self._staged and self._unique_id is not None else None)
        # Everything a descriptor holds is fixed from here on.
        self._submitter = Submitter(
            rank=self._rank, world_size=self._size, comm_key=self._comm_key, backend=self._backend,
            device=self._device, daemon=self._daemon, endpoint=self._endpoint, flight=self._flight, state=self._state,
            channels=self._channels, block_offset=self._block_offset, options=self._options, mode=mode,
            registry=self._registry, ll_reach=ll_reach)
        # Failures are explained from the peers' records; peers in other
        # processes are watched (liveness.py).
        self._diag = EndpointDiagnostics(self._endpoint, self._endpoint.arenas)
        self._state.attach(self._diag)
        self._daemon.diagnostics[self._endpoint.id] = self._diag
        liveness.register(self, self._state)

    # -- properties --------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._size

    @property
    def device(self) -> int:
        return self._device

    @property
    def backend(self) -> str:
        return self._backend

    @property
    def path(self) -> str:
        """The data path collectives take: "direct" (peers' buffers read in
        place), "staged" (the direct path through copies in the arenas, for
        peers in other processes, up to CommOptions.staged_max_bytes; the ring
        above) or "ring" (also whenever a peer is on another host:
        :attr:`transports`)."""
        return self._mode

    @property
    def transports(self) -> tuple[str, ...]:
        """How this rank reaches each rank, by rank: "self", "local" (a rank
        of this process), "host" (another process of this host: shared
        memory or CUDA IPC) or "ucx" (another host: the network proxy,
        docs/multi-node.md)."""
        return tuple(self._endpoint.transports())

    @property
    def hierarchy(self) -> HierarchyInfo | None:
        """Where this communicator's ranks span hosts with the same number
        (two or more) on each: how its all-reduces run hierarchically
        (CommOptions.hierarchy_min_bytes, docs/multi-node.md); None where
        none does."""
        return None if self._hierarchy is None else self._hierarchy.info()

    @property
    def ll_max_bytes(self) -> int:
        """Largest per-rank piece that takes the LL protocol (0: none)."""
        if not ll_capable(self._size, self._ll_reach) or self._options.protocol == "simple":
            return 0
        return self._options.ll_max_bytes or 0

    @property
    def channels(self) -> int:
        return self._channels

    @property
    def closed(self) -> bool:
        return self._state.closed

    def __repr__(self) -> str:
        return (f"<dfccl.Communicator rank {self._rank}/{self._size} {self._backend}:{self._device} "
                f"path={self.path}{' closed' if self._state.closed else ''}>")

    # -- collectives ---------------------------------------------------------------
    def all_reduce(self, send, recv=None, *, op: str | ReduceOp = "sum", tag=None, stream=None) -> Work:
        """recv[i] = op over ranks of send[i].

        Args:
            send: this rank's input (any array with the CUDA array
                interface, the array interface or DLPack).
            recv: the output, same shape; None: in place, into ``send``.
            op: the reduction (class docstring).
            tag, stream: as every collective takes them (class docstring).

        Returns:
            The Work of this rank's part, at once (nothing here waits for peers).
        """
        sub = self._submitter
        if recv is None and stream is None and self._hierarchy is None:
            work = sub.all_reduce_kept(send, op, tag)
            if work is not None:
                return work
        sub.check_tag(tag, "all_reduce")
        s, r = sub.pair(send, recv, "all_reduce")
        sub.same_shape(s, r, s.count, "all_reduce")
        op = sub.op(op, "all_reduce")
        return self._submit(KIND_ALL_REDUCE, s, r, s.count, op, 0, tag, stream)

    def barrier(self, *, tag=None, stream=None) -> Work:
        """Completes once every rank has reached its barrier of this tag
        (the k-th barrier of a tag meets the k-th on every rank), like
        every collective without blocking the host: ``synchronize()`` it, or
        ``wait(stream)`` so that what follows on the stream waits for every
        rank.  On a stream that captures a CUDA graph it is captured: every
        replay waits for every rank's replay (docs/architecture.md, "CUDA
        graphs").  It is a one-element all-reduce (max) of a word this rank
        keeps in its arena, whose value nobody reads; its Work's kind is
        all_reduce.

        Args:
            tag, stream: as every collective takes them (class docstring).

        Returns:
            The Work of this rank's part, at once.
        """
        self._submitter.check_tag(tag, "barrier")
        self._state.check_open()
        if not self._barrier_ptr:
            # Staging taken for good (a few bytes): no allocation, so that a
            # first barrier may be issued under capture too.
            self._barrier_ptr = self._endpoint.arena + self._endpoint.tags.alloc_instance_staging(16)
        sim = self._backend == "sim"
        word = Buffer(self._barrier_ptr, 1, DataType.INT32, CPU if sim else CUDA, -1 if sim else self._device, False,
                      None)
        return self._submit(KIND_ALL_REDUCE, word, word, 1, ReduceOp.MAX, 0, tag, stream)

    def all_gather(self, send, recv, *, tag=None, stream=None) -> Work:
        """recv[rank * n : (rank + 1) * n] = send of every rank (n = send size).

        Args:
            send: this rank's piece; in place when it is its slice of ``recv``.
            recv: the output, world_size x the size of ``send``.
            tag, stream: as every collective takes them (class docstring).

        Returns:
            The Work of this rank's part, at once (nothing here waits for peers).
        """
        sub = self._submitter
        sub.check_tag(tag, "all_gather")
        s, r = sub.pair(send, recv, "all_gather")
        sub.same_shape(s, r, s.count * self._size, "all_gather", recv_scale=f"{self._size} x send")
        return self._submit(KIND_ALL_GATHER, s, r, s.count, ReduceOp.SUM, 0, tag, stream)

    def reduce_scatter(self, send, recv, *, op: str | ReduceOp = "sum", tag=None, stream=None) -> Work:
        """recv = op over ranks of send[rank * n : (rank + 1) * n] (n = recv size).

        Args:
            send: the input, world_size x the size of ``recv``.
            recv: this rank's piece; in place when it is its slice of ``send``.
            op: the reduction (class docstring).
            tag, stream: as every collective takes them (class docstring).

        Returns:
            The Work of this rank's part, at once (nothing here waits for peers).
        """
        sub = self._submitter
        sub.check_tag(tag, "reduce_scatter")
        s, r = sub.pair(send, recv, "reduce_scatter")
        if s.count != r.count * self._size:
            raise InvalidArgumentError(f"reduce_scatter: send has {s.count} elements, expected {self._size} x recv "
                                       f"({r.count}) = {r.count * self._size}", rank=self._rank, tag=tag)
        sub.check_dtype(s, r, "reduce_scatter")
        return self._submit(KIND_REDUCE_SCATTER, s, r, r.count, sub.op(op, "reduce_scatter"), 0, tag, stream)

    def broadcast(self, send, recv=None, *, root: int = 0, tag=None, stream=None) -> Work:
        """recv = send of ``root``.

        Args:
            send: the root's data (read on the root only).
            recv: the output, same shape; None: in place, into ``send``.
            root: the rank whose data every rank receives.
            tag, stream: as every collective takes them (class docstring).

        Returns:
            The Work of this rank's part, at once (nothing here waits for peers).
        """
        sub = self._submitter
        sub.check_root(root, "broadcast")
        sub.check_tag(tag, "broadcast")
        s, r = sub.pair(send, recv, "broadcast")
        sub.same_shape(s, r, s.count, "broadcast")
        return self._submit(KIND_BROADCAST, s, r, s.count, ReduceOp.SUM, root, tag, stream)

    def reduce(self, send, recv=None, *, op: str | ReduceOp = "sum", root: int = 0, tag=None, stream=None) -> Work:
        """recv on ``root`` = op over ranks of send.

        Args:
            send: this rank's input.
            recv: the output on ``root`` (None: in place there); not written
                on other ranks (may be None).
            op: the reduction (class docstring).
            root: the rank that receives the result.
            tag, stream: as every collective takes them (class docstring).

        Returns:
            The Work of this rank's part, at once (nothing here waits for peers).
        """
        sub = self._submitter
        sub.check_root(root, "reduce")
        sub.check_tag(tag, "reduce")
        # Only the root's recv is written: another rank's may be read-only.
        s, r = sub.pair(send, recv, "reduce", writes_recv=root == self._rank)
        sub.same_shape(s, r, s.count, "reduce")
        return self._submit(KIND_REDUCE, s, r, s.count, sub.op(op, "reduce"), root, tag, stream)

    # -- registration --------------------------------------------------------------------
    def register(self, buf, *, timeout: float = DEFAULT_STARTUP_TIMEOUT) -> RegistrationHandle:
        """Registers ``buf`` so that peers in other processes read it in place
        instead of through the staged copy (like ncclCommRegister).
        Collective: every rank calls it (the k-th register of every rank is
        one exchange).  See dfccl/registration.py for what is mapped and when.

        Args:
            buf: a device buffer (on the simulator: memory from
                dfccl.registration.mem_alloc).
            timeout: seconds the exchange with the peers may take.

        Returns:
            A handle: close it, or use it as a context manager, once no
            pending collective uses the buffer.
        """
        self._state.check_open()
        timeout = check_seconds("register: timeout", timeout, positive=True)
        try:
            b = as_buffer(buf, "register")
        except InvalidArgumentError as exc:
            exc.rank = self._rank
            raise
        self._submitter.check_memory(b, "register")
        if b.nbytes == 0:
            raise InvalidArgumentError("register: the buffer is empty", rank=self._rank)
        if self._registry is None:
            return RegistrationHandle(None, b.ptr, b.nbytes)   # no staged path: nothing to map
        return self._registry.register(b.ptr, b.nbytes, timeout)

    def deregister(self, handle: RegistrationHandle) -> None:
        """``handle.close()``.

        Args:
            handle: what register() returned.
        """
        if not isinstance(handle, RegistrationHandle):
            raise InvalidArgumentError(f"deregister needs a RegistrationHandle, not {type(handle).__name__}",
                                       rank=self._rank)
        handle.close()

    # -- new communicators -----------------------------------------------------------
    def split(self, color: int | None, key: int | None = None, *,
              timeout: float = DEFAULT_STARTUP_TIMEOUT) -> "Communicator | None":
        """A new communicator of the ranks that pass the same ``color``, ranked
        by (``key``, this rank); None for a rank whose color is None or
        negative.  Collective over this communicator (every rank calls it; the
        k-th split of every rank is one split).  The child runs on the same
        daemon as this one, with the same options.  Ranks of a
        ``for_devices`` group must each call it on their own thread (or use
        :meth:`split_all`).  Like ncclCommSplit.

        Args:
            color: the child this rank joins; None or negative: none.
            key: this rank's order in its child (ties: parent rank); None: its rank.
            timeout: seconds the agreement with the other ranks may take.

        Returns:
            The child communicator, or None for a rank without a color.
        """
        self._state.check_open()
        color = check_color(color)
        key = check_key(key, self._rank)
        timeout = check_seconds("split: timeout", timeout, positive=True)
        self._splits += 1
        deadline = time.monotonic() + timeout
        if self._unique_id is None:
            local = split_local(self._group, self._splits, self._rank, color, key, deadline, timeout)
            if local is None:
                return None
            child = Communicator._create_local(self._backend, self._device, local.rank, local.size,
                                               self._user_options, None, local.comm_key, local.group)
            peers = local.group.rendezvous.exchange("describe", local.rank, child._endpoint.describe(), deadline,
                                                    timeout)
            child._finish_init(peers)
            return child
        joined = split_through_store(self._unique_id, self._splits, self._rank, self._size, color, key, deadline,
                                     timeout)
        if joined is None:
            return None
        return Communicator(joined.unique_id, joined.rank, joined.size, device=self._device, backend=self._backend,
                            options=self._user_options, timeout=max(deadline - time.monotonic(), 0.05))

    @staticmethod
    def split_all(comms: Sequence["Communicator"], colors: Sequence[int | None],
                  keys: Sequence[int | None] | None = None, *,
                  timeout: float = DEFAULT_STARTUP_TIMEOUT) -> list["Communicator | None"]:
        """:meth:`split` for several ranks of this process at once (one thread
        per rank): ``comms[i].split(colors[i], keys[i])`` for every i.

        Args:
            comms: ranks of one communicator.
            colors: each rank's color (None: it joins no child).
            keys: each rank's key; None: their ranks.
            timeout: seconds each split may take.

        Returns:
            Each rank's child (or None), in the order of ``comms``.
        """
        comms, colors = list(comms), list(colors)
        keys = [None] * len(comms) if keys is None else list(keys)
        if not (len(comms) == len(colors) == len(keys)):
            raise InvalidArgumentError(f"split_all: {len(comms)} communicators, {len(colors)} colors and "
                                       f"{len(keys)} keys; give one of each per communicator")
        results: list = [None] * len(comms)
        errors: list = [None] * len(comms)

        def one(i):
            try:
                results[i] = comms[i].split(colors[i], keys[i], timeout=timeout)
            except BaseException as exc:  # re-raised below, on the caller's thread
                errors[i] = exc

        threads = [threading.Thread(target=one, args=(i,), name=f"dfccl-split-{i}") for i in range(len(comms))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for exc in errors:
            if exc is not None:
                for c in results:
                    if c is not None:
                        c.close()
                raise exc
        return results
    # -- point to point and all-to-all ------------------------------------------------
    def send(self, buf, peer: int, *, tag=None, stream=None) -> Work:
        """Sends ``buf`` to rank ``peer``.  The k-th send to ``peer`` with
        ``tag`` pairs with the k-th recv from this rank with ``tag`` on
        ``peer`` (untagged ones in call order per peer pair), whatever else
        either rank submits in between or in which order.  Completes once the
        peer has taken the data (``buf`` may then be reused).

        Args:
            buf: the data.
            peer: the receiving rank.
            tag: which exchange this is (see above; None: call order).
            stream: a CUDA stream the operation follows; None: run now.

        Returns:
            The Work of this rank's part, at once.
        """
        return self._submitter.p2p(KIND_SEND, buf, peer, tag, stream)

    def recv(self, buf, peer: int, *, tag=None, stream=None) -> Work:
        """Receives into ``buf`` what rank ``peer`` sends with ``tag``; the
        send must have the same element count and dtype (else MismatchError on
        both ranks).

        Args:
            buf: where the data lands.
            peer: the sending rank.
            tag: which exchange this is (see above; None: call order).
            stream: a CUDA stream the operation follows; None: run now.

        Returns:
            The Work of this rank's part, at once.
        """
        return self._submitter.p2p(KIND_RECV, buf, peer, tag, stream)

    def all_to_all(self, send, recv, *, tag=None, stream=None) -> Work:
        """Equal splits: rank r's send[p * n : (p + 1) * n] lands in rank p's
        recv[r * n : (r + 1) * n] (n = send size / world size; recv has the
        same size).

        Args:
            send: world_size equal parts, part p for rank p.
            recv: world_size equal parts, part r from rank r.
            tag: which exchange this is (see above; None: call order).
            stream: a CUDA stream the operation follows; None: run now.

        Returns:
            The Work of this rank's part, at once.
        """
        return self._all_to_all(send, recv, None, None, tag, stream, "all_to_all")

    def all_to_all_single(self, send, recv, *, send_splits: Sequence[int] | None = None,
                          recv_splits: Sequence[int] | None = None, tag=None, stream=None) -> Work:
        """All-to-all with per-peer element counts (torch's all_to_all_single
        with input / output split sizes): this rank sends ``send_splits[p]``
        elements to rank p, taken in rank order from ``send``, and receives
        ``recv_splits[p]`` from rank p, placed in rank order in ``recv``.
        Counts may differ per peer and be zero; each split list must sum to its
        buffer's size (None: equal parts).  ``send_splits[p]`` here must equal
        ``recv_splits[rank]`` on rank p, else MismatchError on both.

        Args:
            send: the parts for every rank, in rank order.
            recv: the parts from every rank, in rank order.
            send_splits: elements for each rank; None: equal parts.
            recv_splits: elements from each rank; None: equal parts.
            tag: which exchange this is (see above; None: call order).
            stream: a CUDA stream the operation follows; None: run now.

        Returns:
            The Work of this rank's part, at once.
        """
        return self._all_to_all(send, recv, send_splits, recv_splits, tag, stream, "all_to_all_single")

    # -- plans -------------------------------------------------------------------------
    def prepare_all_reduce(self, count: int, dtype, *, op: str | ReduceOp = "sum", tag=None) -> "Plan":
        """All-reduces of one shape, checked and planned once.

        Args:
            count: elements of the buffer.
            dtype: the element type (a DataType, its name, a numpy or torch dtype).
            op: the reduction.
            tag: the tag every instance uses (None: the untagged sequence).

        Returns:
            A Plan: call it (or bind() it) with buffers to submit an instance.
        """
        return self._prepare(KIND_ALL_REDUCE, count, dtype, op, _UNUSED, tag)

    def prepare_all_gather(self, count: int, dtype, *, tag=None) -> "Plan":
        """All-gathers of one shape, checked and planned once.

        Args:
            count: elements each rank contributes.
            dtype: the element type.
            tag: the tag every instance uses.

        Returns:
            A Plan: call it (or bind() it) with buffers to submit an instance.
        """
        return self._prepare(KIND_ALL_GATHER, count, dtype, _UNUSED, _UNUSED, tag)

    def prepare_reduce_scatter(self, count: int, dtype, *, op: str | ReduceOp = "sum", tag=None) -> "Plan":
        """Reduce-scatters of one shape, checked and planned once.

        Args:
            count: elements each rank receives.
            dtype: the element type.
            op: the reduction.
            tag: the tag every instance uses.

        Returns:
            A Plan: call it (or bind() it) with buffers to submit an instance.
        """
        return self._prepare(KIND_REDUCE_SCATTER, count, dtype, op, _UNUSED, tag)

    def prepare_broadcast(self, count: int, dtype, *, root: int = 0, tag=None) -> "Plan":
        """Broadcasts of one shape, checked and planned once.

        Args:
            count: elements of the buffer.
            dtype: the element type.
            root: the rank whose data every rank receives.
            tag: the tag every instance uses.

        Returns:
            A Plan: call it (or bind() it) with buffers to submit an instance.
        """
        return self._prepare(KIND_BROADCAST, count, dtype, _UNUSED, root, tag)

    def prepare_reduce(self, count: int, dtype, *, op: str | ReduceOp = "sum", root: int = 0, tag=None) -> "Plan":
        """Reduces of one shape, checked and planned once.

        Args:
            count: elements of the buffer.
            dtype: the element type.
            op: the reduction.
            root: the rank that receives the result.
            tag: the tag every instance uses.

        Returns:
            A Plan: call it (or bind() it) with buffers to submit an instance.
        """
        return self._prepare(KIND_REDUCE, count, dtype, op, root, tag)

    def _prepare(self, kind, count, dtype, op, root, tag) -> "Plan":
        what = f"prepare_{KIND_NAMES[kind]}"
        sub = self._submitter
        self._state.check_open()
        if root is _UNUSED:
            root = 0
        else:
            sub.check_root(root, what)
        sub.check_tag(tag, what)
        try:
            count = check_int(f"{what}: count", count, 0)
            dtype = as_data_type(dtype)
        except InvalidArgumentError as exc:
            exc.rank = self._rank
            raise
        op = ReduceOp.SUM if op is _UNUSED else sub.op(op, what)
        if tag is None:
            # Untagged plans are named by creation order (Plan's docstring).
            self._plans += 1
            tag = ("#plan", self._plans)
        return Plan(self, sub, kind, count, dtype, op, root, tag)

    # -- lifetime ------------------------------------------------------------------------
    def abort(self, timeout: float = 10.0) -> None:
        """Fails every pending collective of this rank (AbortedError here;
        PeerAbortedError naming this rank on peers that wait for it, even for
        collectives this rank never submitted) without waiting for peers, and
        returns within ``timeout`` seconds whatever the traffic: a collective
        the daemon has not let go of by then fails at once all the same (its
        memory stays reserved until the daemon is done with it).  The
        communicator accepts no new collectives afterwards; a new one on the
        same devices works.

        Args:
            timeout: seconds to wait for the daemon to let go of this rank's collectives.
        """
        timeout = check_seconds("abort: timeout", timeout)
        if self._state.closed:
            return
        if self._hierarchy is not None:
            self._hierarchy.abort(timeout)
        if not self._state.aborted:
            self._state.aborted = True
            if not self._daemon.closed:
                # Our daemon first, then the peers (who read the status).
                if self._state.lost_rank is None:
                    self._endpoint.abort()
                self._endpoint.write_status(RANK_ABORTED)
            self._flight.note("abort", detail=f"rank {self._rank} aborted")
        self._settle(timeout)

    def _settle(self, timeout: float) -> None:
        """Waits (bounded) for this rank's pending collectives to fail, then
        fails the rest host-side (Daemon.abandon)."""
        ep = self._endpoint
        if ep.id is None or self._daemon.closed:
            return
        deadline = time.monotonic() + timeout
        for w in self._daemon.pending_works(ep.id):
            while not w.done() and time.monotonic() < deadline:
                time.sleep(1e-4)
            if not w.done():
                self._daemon.abandon(w)
        # Collectives submitted through the C API (dfccl_api.h) report the
        # abort through their handles.
        while self._daemon.pending_handles(ep.id) and time.monotonic() < deadline:
            time.sleep(1e-4)
        self._daemon.abandon_handles(ep.id)

    def close(self, timeout: float = 30.0) -> None:
        """Releases this rank.  Collectives still pending are aborted (call
        synchronize() first to finish them); peers waiting for this rank fail
        with PeerAbortedError naming it.  Idempotent.

        Args:
            timeout: seconds an abort of pending collectives may take.
        """
        timeout = check_seconds("close: timeout", timeout)
        if self._state.closed:
            return
        if self._hierarchy is not None:
            # Their pending parts are this rank's collectives: they go first.
            self._hierarchy.close(timeout)
        ep = self._endpoint
        pending = [] if ep.id is None or self._daemon.closed else self._daemon.pending_works(ep.id)
        pending = [w for w in pending if not w.done()]
        if pending or (ep.id is not None and not self._daemon.closed and self._daemon.pending_handles(ep.id)):
            self.abort(timeout)
        elif not self._state.aborted and ep.id is not None and not self._daemon.closed:
            ep.write_status(RANK_CLOSED)
        self._flight.note("close", detail=f"rank {self._rank} closed")
        self._state.mark_closed()
        # Abandoned collectives keep their slot (and our memory) until the daemon
        # lets go, whether this close or an earlier abort() abandoned them.
        unfinished = ep.id is not None and not self._daemon.closed and self._daemon.held_by_daemon(ep.id) > 0
        if self._registry is not None and not unfinished:
            self._registry.close()
        if unfinished:
            self._group.held = True
        last = self._group.leave()
        # Free the arena only when no peer can touch it: every in-process rank
        # of the communicator has closed and nothing is left in flight.
        free = last and self._group.closes_memory and not self._group.held
        self._endpoint.release(free_memory=free)
        if free:
            for ep in self._group.endpoints:
                ep.release(free_memory=True)
            self._group.endpoints = []
        elif self._group.closes_memory:
            self._group.endpoints.append(self._endpoint)
        if not self._daemon.closed:
            self._daemon.reclaim_endpoints()   # earlier closes' endpoints the daemon has let go of since

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------
    def _all_reduce_at(self, ptr: int, count: int, dtype: DataType, op: ReduceOp, stream: int | None,
                       owner: object, tag: object = None) -> Work:
        """In-place all-reduce of ``count`` elements at ``ptr``, memory the
        caller has checked is this communicator's kind and device, under
        ``tag`` (a simple tag: str, int or a tuple of them; None: untagged)
        (the torch backend's path for one contiguous tensor: no Buffer, no
        argument parsing; Submitter.all_reduce_at)."""
        if self._hierarchy is not None:
            b = self._submitter.buffer_at(ptr, count, dtype, owner)
            return self._submit(KIND_ALL_REDUCE, b, b, count, op, 0, tag, stream)
        return self._submitter.all_reduce_at(ptr, count, dtype, op, stream, owner, tag)

    def _all_to_all(self, send, recv, send_splits, recv_splits, tag, stream, what: str) -> Work:
        """Submitter.all_to_all, in its tag's order across this
        communicator's hierarchy where it has one (hierarchy.py)."""
        sub = self._submitter
        if self._hierarchy is None:
            return sub.all_to_all(send, recv, send_splits, recv_splits, tag, stream, what)
        sub.check_tag(tag, what)
        return self._hierarchy.in_order(tag, lambda order_after: sub.all_to_all(
            send, recv, send_splits, recv_splits, tag, stream, what, order_after=order_after))

    def _submit(self, kind: int, s: Buffer, r: Buffer, count: int, op: ReduceOp, root: int, tag, stream) -> Work:
        """Submits one collective of checked arguments (Submitter.submit's):
        through the hierarchy where this communicator has one, which keeps
        a tag's order across its children (hierarchy.py)."""
        if self._hierarchy is None:
            return self._submitter.submit(kind, s, r, count, op, root, tag, stream)
        self._state.check_open()
        try:
            return self._hierarchy.submit(kind, s, r, count, op, root, tag, stream)
        except DfcclError as exc:
            exc.rank = self._rank
            if self._hierarchy.broken:
                # Its children gave up (hierarchy.py): so does this rank.
                self.abort()
            raise

    def _speak_as_part(self, parent_ranks: tuple[int, ...], role: str) -> None:
        """This child of a hierarchy (hierarchy.py) names its parent's ranks
        in what it logs."""
        self._state.parent_ranks = parent_ranks
        self._state.role = role

    # -- diagnostics -------------------------------------------------------------------
    def status(self) -> CommStatus:
        """What this rank is doing now: every pending collective, how long
        it has been pending, whom it waits for (the ranks that have not
        joined it, else the rank whose data it waits for), and the last
        events of the flight recorder.

        Returns:
            A CommStatus (``print(comm.status())`` formats it).
        """
        if self._state.lost_rank is not None:
            state = f"peer rank {self._state.lost_rank} lost"
        else:
            state = "closed" if self._state.closed else "aborted" if self._state.aborted else "open"
        if not self._state.closed and self._daemon.device_fault:
            state = f"device failed ({self._daemon.device.fault_name(self._daemon.device_fault)})"
        st = CommStatus(rank=self._rank, world_size=self._size, backend=self._backend, device=self._device,
                        path=getattr(self, "_mode", "?"), state=state)
        ep = self._endpoint
        if not self._state.closed and ep.id is not None and not self._daemon.closed:
            now = time.monotonic_ns()
            for w in self._daemon.pending_works(ep.id):
                if w.done():
                    continue
                waiting = w.waiting_for()
                joined = missing = None
                if self._diag is not None:
                    try:
                        joined, missing = self._diag.joined_ranks(w.key, w.instance)
                    except Exception:
                        pass
                if missing:
                    what = "waiting for ranks to join"
                elif waiting is not None:
                    what = "every rank has joined; waiting for data"
                else:
                    what = "queued or transferring"
                kind, tag, _rank = w.submitted_as   # a hierarchical part's own kind, not its whole's
                st.pending.append(PendingStatus(kind=kind, tag=tag, instance=w.instance,
                                                age_s=(now - w.submitted_ns) / 1e9, state=what,
                                                waiting_for=missing[0] if missing else waiting,
                                                joined_ranks=joined, missing_ranks=missing))
            st.captured = [{"kind": n["kind"], "tag": n["tag"], "error": n["error"]}
                           for n in self._daemon.captured if n["endpoint"] == ep.id]
            if self._hierarchy is not None:
                st.pending.extend(self._hierarchy.pending())
        st.recent = self._flight.events()[-20:]
        return st

