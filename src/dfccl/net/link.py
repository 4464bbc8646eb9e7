"""One communicator rank's side of the network (docs/multi-node.md): its
mirrors of the remote peers' arenas, its net queues (one per daemon block)
and its proxy (csrc/proxy.cpp, UCX; a thread per lane), which carries what
the daemon posts and lands what the peers send."""

from __future__ import annotations

import ctypes
import os

import numpy as np

from dfccl.errors import BackendError, InvalidArgumentError
from dfccl.net._build import NetUnavailableError, load
from dfccl.net.hop_trace import TRACE_ENV, parse_format, save_trace

__all__ = ["NetLink", "ucx_settings", "inline_bytes", "lanes", "INLINE_BYTES_ENV", "LANES_ENV", "DEFAULT_LANES"]

_ERR_BYTES = 512
_ADDRESS_BYTES = 1 << 16
#: Seconds a closing rank gives its proxy to send what is queued (its
#: leaving above all) before the connections drop.
CLOSE_LINGER = 1.0
#: Messages the hop trace keeps per rank ($DFCCL_NET_TRACE): the first ones.
TRACE_EVENTS = 1 << 18
#: Overrides the bytes a message carries inside its header's UCX message
#: (0..the proxy's capacity; 0: never).
INLINE_BYTES_ENV = "DFCCL_NET_INLINE_BYTES"
#: Overrides the proxy's lanes (threads, each with its own connection to
#: every remote peer); equal on every rank.
LANES_ENV = "DFCCL_NET_LANES"
#: Lanes when $DFCCL_NET_LANES is unset.  One TCP stream per peer moves
#: what one core copies; two spread a collective's channels over two
#: streams and cores (docs/multi-node.md, "The proxy"; measured in
#: docs/performance-log.md, section 50).
DEFAULT_LANES = 2


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    u32, u64, vp, cp, sz = ctypes.c_uint32, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t
    lib.dfccl_net_queue_bytes.restype = sz
    lib.dfccl_net_ucx_defaults.restype = cp
    lib.dfccl_net_create.restype = vp
    lib.dfccl_net_create.argtypes = [u32, u32, u64, u64, u64, u32, u32, cp, sz]
    lib.dfccl_net_max_lanes.restype = u32
    lib.dfccl_net_address.argtypes = [vp, cp, sz, ctypes.POINTER(sz)]
    lib.dfccl_net_connect.argtypes = [vp, u32, cp, sz, u64, cp, sz]
    lib.dfccl_net_start.argtypes = [vp]
    lib.dfccl_net_set_status.argtypes = [vp, u64, u64, u64]
    lib.dfccl_net_peer_lost.argtypes = [vp, u32, cp, sz]
    lib.dfccl_net_counters.argtypes = [vp, ctypes.POINTER(u64)]
    lib.dfccl_net_close.argtypes = [vp, u64]
    lib.dfccl_net_destroy.argtypes = [vp]
    lib.dfccl_net_trace_start.argtypes = [vp, u64]
    lib.dfccl_net_trace_format.restype = cp
    lib.dfccl_net_trace_read.restype = u64
    lib.dfccl_net_trace_read.argtypes = [vp, vp, u64]
    lib.dfccl_net_inline_capacity.restype = u64
    lib.dfccl_net_set_inline_bytes.argtypes = [vp, u64]
    return lib


def _setting(name: str, default: int, low: int, high: int) -> tuple[int, str]:
    """``(value, source)`` of the integer setting $``name``: ``default``
    from ``"dfccl"`` where it is unset, else its value from
    ``"environment"``, refused unless in ``low..high``."""
    text = os.environ.get(name)
    if text is None:
        return default, "dfccl"
    try:
        value = int(text, 0)
    except ValueError:
        value = low - 1
    if not low <= value <= high:
        raise InvalidArgumentError(f"${name} must be an integer in {low}..{high}, not {text!r}")
    return value, "environment"


def inline_bytes() -> tuple[int, str]:
    """The most bytes (a ring slice's, LL lines') a proxy sends inside its
    header's message instead of as a second message.

    Returns:
        ``(bytes, source)``: the proxy's capacity, source ``"dfccl"``; or
        $DFCCL_NET_INLINE_BYTES, source ``"environment"``.

    Raises:
        InvalidArgumentError: $DFCCL_NET_INLINE_BYTES is not an integer in
            0..the capacity.
        NetUnavailableError: UCX or a C++ compiler is missing.
    """
    capacity = int(_declare(load()).dfccl_net_inline_capacity())
    return _setting(INLINE_BYTES_ENV, capacity, 0, capacity)


def lanes() -> tuple[int, str]:
    """How many lanes a proxy runs: threads, each with its own UCX worker
    and connection to every remote peer, among which the daemon's blocks
    (and so the channels) are spread.

    Returns:
        ``(lanes, source)``: ``DEFAULT_LANES``, source ``"dfccl"``; or
        $DFCCL_NET_LANES, source ``"environment"``.

    Raises:
        InvalidArgumentError: $DFCCL_NET_LANES is not an integer in 1..the
            proxy's most.
        NetUnavailableError: UCX or a C++ compiler is missing.
    """
    return _setting(LANES_ENV, DEFAULT_LANES, 1, int(_declare(load()).dfccl_net_max_lanes()))


def ucx_settings() -> list[tuple[str, str, str]]:
    """The UCX settings a proxy applies where the environment does not set
    them, and what each one's value is here.

    Returns:
        ``(name, value, source)`` per setting: the proxy's value, source
        ``"dfccl"``; or, where ``UCX_<name>`` is set, that value, source
        ``"environment"``.

    Raises:
        NetUnavailableError: UCX or a C++ compiler is missing.
    """
    text = _declare(load()).dfccl_net_ucx_defaults().decode()
    out = []
    for item in text.split():
        name, value = item.split("=", 1)
        env = os.environ.get(f"UCX_{name}")
        out.append((name, value, "dfccl") if env is None else (name, env, "environment"))
    return out


class NetLink:
    """The network side of one rank whose communicator has ranks on other
    hosts.  Built with :meth:`create`; :meth:`connect` starts the proxy;
    :meth:`close` stops it (idempotent); :meth:`free` gives the memory back
    once the daemon holds nothing of the rank."""

    def __init__(self):
        raise TypeError("NetLink is built with NetLink.create()")

    @staticmethod
    def create(device, rank: int, nranks: int, arena: int, arena_bytes: int, nblocks: int,
               remote: list[int], comm_key: int = 0) -> "NetLink":
        """Mirrors for the ``remote`` ranks (arenas of ``arena_bytes``) and
        a proxy for this rank's ``arena`` with ``nblocks`` queues.

        Args:
            arena: the host address of this rank's arena: host memory the
                daemon maps (the simulator's device memory; on a GPU, a
                HostArena), which the proxy reads and writes with plain
                host loads and stores.
            comm_key: the communicator's key, which names its hop trace.

        Raises:
            NetUnavailableError: UCX or a C++ compiler is missing.
            InvalidArgumentError: $DFCCL_NET_INLINE_BYTES or
                $DFCCL_NET_LANES is out of range.
        """
        lib = _declare(load())
        inline, _ = inline_bytes()
        nlanes, _ = lanes()
        self = NetLink.__new__(NetLink)
        self._lib = lib
        self._device = device
        self.rank = rank
        self.remote = list(remote)
        self.remote_mask = sum(1 << p for p in remote)
        self._mirrors: dict[int, tuple[int, int]] = {}   # rank -> (host, device) address
        self._nranks = nranks
        self._comm_key = comm_key
        self._trace_dir = None
        self._queues_host, self.queues = device.alloc_mapped(nblocks * lib.dfccl_net_queue_bytes())
        for p in remote:
            self._mirrors[p] = device.alloc_mapped(arena_bytes)
        err = ctypes.create_string_buffer(_ERR_BYTES)
        self._handle = lib.dfccl_net_create(rank, nranks, arena, arena_bytes, self._queues_host, nblocks, nlanes, err,
                                            _ERR_BYTES)
        if not self._handle:
            self.free()
            raise NetUnavailableError(f"dfccl: rank {rank}: cannot start UCX: {err.value.decode()}")
        if lib.dfccl_net_set_inline_bytes(self._handle, inline) != 0:
            self.close()
            self.free()
            raise BackendError(f"dfccl: rank {rank}: the proxy refused {inline} inline bytes")
        self._started = False
        self._trace_dir = os.environ.get(TRACE_ENV) or None
        if self._trace_dir is not None:
            self._trace_format = lib.dfccl_net_trace_format().decode()
            lib.dfccl_net_trace_start(self._handle, TRACE_EVENTS)
        return self

    def mirror(self, rank: int) -> int:
        """Where the daemon finds ``rank``'s arena: this rank's mirror of it."""
        return self._mirrors[rank][1]

    def address(self) -> str:
        """This rank's address for its peers (hex): its lane count and each
        lane's UCX worker address."""
        buf = ctypes.create_string_buffer(_ADDRESS_BYTES)
        n = ctypes.c_size_t(0)
        if self._lib.dfccl_net_address(self._handle, buf, _ADDRESS_BYTES, ctypes.byref(n)) != 0:
            raise BackendError(f"dfccl: rank {self.rank}: cannot read the UCX worker address")
        return buf.raw[:n.value].hex()

    def connect(self, addresses: dict[int, str]) -> None:
        """Connects every lane to the same lane of every remote rank (its
        :meth:`address`) and starts the proxy's threads.

        Raises:
            BackendError: a peer's proxy runs another number of lanes, or UCX
                cannot connect.
        """
        err = ctypes.create_string_buffer(_ERR_BYTES)
        for p in self.remote:
            addr = bytes.fromhex(addresses[p])
            if self._lib.dfccl_net_connect(self._handle, p, addr, len(addr), self._mirrors[p][0], err,
                                           _ERR_BYTES) != 0:
                raise BackendError(f"dfccl: rank {self.rank}: cannot connect to rank {p} through UCX: "
                                   f"{err.value.decode()}")
        self._lib.dfccl_net_start(self._handle)
        self._started = True

    def set_status(self, state: int, heartbeat: int) -> None:
        """This rank's status as its remote peers should see it (pushed when
        it changes)."""
        if self._handle:
            self._lib.dfccl_net_set_status(self._handle, state, heartbeat, os.getpid())

    def peer_status(self, rank: int) -> tuple[int, int, int]:
        """(state, heartbeat, pid) of a remote ``rank`` as it last sent them.

        Raises:
            OSError: its connection failed while it had not left.
        """
        words = (ctypes.c_uint64 * 3).from_address(self._mirrors[rank][0])
        state, beat, pid = int(words[0]), int(words[1]), int(words[2])
        if state == 0 and self._handle:
            err = ctypes.create_string_buffer(_ERR_BYTES)
            if self._lib.dfccl_net_peer_lost(self._handle, rank, err, _ERR_BYTES):
                raise OSError(f"its network connection failed ({err.value.decode()})")
        return state, beat, pid

    def counters(self) -> dict[str, int]:
        """Bytes of slices sent and received, messages sent."""
        out = (ctypes.c_uint64 * 3)()
        if self._handle:
            self._lib.dfccl_net_counters(self._handle, out)
        return {"bytes_sent": out[0], "bytes_received": out[1], "messages": out[2]}

    def _trace(self, handle) -> np.ndarray:
        """The hop trace ($DFCCL_NET_TRACE): one record per message sent or
        applied, laid out as the proxy says (hop_trace.parse_format)."""
        dtype, _ = parse_format(self._trace_format)
        out = np.zeros(TRACE_EVENTS, dtype)
        n = self._lib.dfccl_net_trace_read(handle, out.ctypes.data, TRACE_EVENTS)
        return out[:n].copy()

    def close(self) -> None:
        """Sends what is queued (this rank's last status above all), then
        stops the proxy and drops the connections; with $DFCCL_NET_TRACE,
        then writes the hop trace there (complete once the proxy stopped)."""
        handle, self._handle = self._handle, None
        if handle:
            self._lib.dfccl_net_close(handle, int(CLOSE_LINGER * 1e9))
            if self._trace_dir is not None:
                save_trace(self._trace_dir, self._comm_key, self.rank, self._nranks, self._trace(handle),
                           self._trace_format)
            self._lib.dfccl_net_destroy(handle)

    def free(self) -> None:
        """Gives the mirrors and queues back (after close, once the daemon
        holds nothing of this rank)."""
        self.close()
        for host, _dev in self._mirrors.values():
            self._device.free_mapped(host)
        self._mirrors = {}
        if self._queues_host:
            self._device.free_mapped(self._queues_host)
            self._queues_host = self.queues = 0
