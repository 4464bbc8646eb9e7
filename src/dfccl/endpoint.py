"""One rank of a communicator on a daemon: its arena (rank status, tag
records, the LL region and ring-path staging FIFOs, in device memory its peers
map), the host mirror of its tag table, and its registration with the daemon.

Arena layout: | dfccl_rank_status (ARENA_STATUS_BYTES: the state and pid,
written by this rank's host when the state changes, read by the peers'
daemons) + the tag table | LL region (planning.ll_region_bytes) | staging |,
each part 4096-aligned.  The heartbeat and the state that peers' hosts watch
are in the rank's status page (status_page.py), in host shared memory."""

from __future__ import annotations

import ctypes
import os
import socket

import numpy as np

from dfccl import runtime
from dfccl._native.layout import (ARENA_STATUS_BYTES, FIFO_OFFSET_MASK, OWNER_BUCKET_BYTES, RANK_LIVE, RECORD_BYTES,
                                  REG_SLOTS)
from dfccl.errors import BackendError, InvalidArgumentError
from dfccl.host_arena import HostArena
from dfccl.net import NetLink, host_id
from dfccl.planning import fifo_blocks, ll_region_bytes, reserved_staging_bytes
from dfccl.processes import start_time
from dfccl.staging import StagingPool
from dfccl.status_page import StatusPage
from dfccl.tags import TagTable

__all__ = ["Endpoint"]


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


class Endpoint:
    def __init__(self, daemon, *, rank: int, nranks: int, options, shareable: bool):
        self.daemon = daemon
        self.device = daemon.device
        self.rank = rank
        self.nranks = nranks
        self.capacity = options.max_tags   # resolved: equal on every rank
        # Status header + table; the LL region and the staging follow, page aligned.
        self.table_bytes = _align(ARENA_STATUS_BYTES + self.capacity * RECORD_BYTES, 4096)
        self.ll_max_bytes = options.ll_max_bytes or 0
        self.ll_offset = self.table_bytes
        self.ll_bytes = _align(ll_region_bytes(self.capacity, nranks, self.ll_max_bytes), 4096)
        staging_base = self.ll_offset + self.ll_bytes
        self.arena_size = staging_base + options.staging_bytes
        if self.arena_size > FIFO_OFFSET_MASK:
            raise InvalidArgumentError(f"an arena of {self.arena_size} bytes is beyond the {FIFO_OFFSET_MASK + 1} "
                                       "bytes a FIFO word addresses; lower CommOptions.staging_bytes or max_tags")
        self.arena = self.device.alloc_device(self.arena_size, shareable)
        # On a GPU, a communicator spanning hosts moves the arena into host
        # shared memory at connect (host_arena.py says why).
        self._host_arena: HostArena | None = None
        self.shareable = shareable
        # A reserved block for every tag that can be pending here at once
        # (bounded by the records and by the daemon's slots), for a FIFO of
        # up to this daemon's channels.
        channels = min(daemon.nblocks, options.channels or daemon.nblocks)
        block_bytes, blocks = fifo_blocks(reserved_staging_bytes(options), min(self.capacity, daemon.nslots), channels)
        self.staging = StagingPool(staging_base, options.staging_bytes, block_bytes=block_bytes, blocks=blocks)
        self.tags = TagTable(self.capacity, self.staging)
        self.id: int | None = None
        # What only this rank's daemon reads and writes of its records, in
        # device memory (zeroed): across hosts the arena is host memory.
        self.owner_words = self.device.alloc_device(self.capacity * OWNER_BUCKET_BYTES, False)
        self._imported: list[int] = []
        self._imported_host: list[HostArena] = []
        # Peers' registered allocations as mapped here (registration.py);
        # only ranks that peers in other processes reach need one.
        self.reg_table = 0
        if shareable:
            nbytes = nranks * REG_SLOTS * 8
            self.reg_table = self.device.alloc_device(nbytes, False)
            zeros = ctypes.create_string_buffer(nbytes)
            self.device.copy_to_device(self.reg_table, ctypes.addressof(zeros), nbytes)
        self.arenas: list[int] = []        # every rank's arena, as mapped here (after connect)
        self.peers: list[dict] = []        # every rank's describe()
        self._status = np.zeros(3, np.uint64)   # state, heartbeat, pid
        self._status[2] = os.getpid()
        # Peers in other processes watch this rank through its status page.
        self.page: StatusPage | None = StatusPage.create(RANK_LIVE) if shareable else None
        self._peer_pages: dict[int, StatusPage] = {}
        # Ranks on other hosts: mirrors of their arenas and the proxy (connect).
        self.net: NetLink | None = None
        self.write_status(RANK_LIVE)

    # -- bootstrap ---------------------------------------------------------------
    def describe(self) -> dict:
        """What peers need to reach this rank's arena (JSON-able)."""
        info = {
            "pid": os.getpid(),
            "start_time": start_time(os.getpid()),
            "host": socket.gethostname(),
            "host_id": host_id(),
            "backend": self.device.backend,
            "device": self.device.ordinal,
            "blocks": self.daemon.nblocks,
            "arena_ptr": self.arena,
            "capacity": self.capacity,
            "stride": RECORD_BYTES,
            "ll_max_bytes": self.ll_max_bytes,
            "bus_id": getattr(self.device, "pci_bus_id", None),
        }
        if self.shareable:
            info["arena"] = self.device.export_memory(self.arena)
        if self.page is not None:
            info["status_page"] = self.page.path
        return info

    @staticmethod
    def describe_process() -> dict:
        return {"pid": os.getpid(), "host": socket.gethostname()}

    def connect(self, peers: list[dict], comm_key: int, exchange=None) -> str:
        """Maps every peer's arena (a mirror of it for a peer on another
        host, dfccl.net) and registers this rank with the daemon.  Returns
        how peers reach each other for the direct path: "direct" (every rank
        in this process, with peer access between their devices: buffers are
        read in place), "staged" (some in other processes of this host, every
        device pair with peer access: through copies in the arenas) or "ring"
        (some peer out of reach).  ``exchange(phase, value)``: every rank's
        value, through the bootstrap store (needed for peers on other hosts)."""
        me = peers[self.rank]
        mode = "direct"
        arenas = []
        remote = [p for p, info in enumerate(peers) if info.get("host_id") != me.get("host_id")]
        if remote:
            if exchange is None:
                raise BackendError(f"ranks {remote} are on other hosts than rank {self.rank}, but the communicator was "
                                   "built in one process (for_devices, or a split of such a group): the network path "
                                   "is set up for communicators built from a UniqueId and their splits")
            # Every rank has a remote peer when any has, so no rank maps the
            # device arenas described so far: each rank publishes its host
            # arena with its UCX address instead.
            arena_host = self.arena
            if self.device.backend == "cuda":
                self._move_arena_to_host()
                arena_host = self._host_arena.host_ptr
            self.net = NetLink.create(self.device, self.rank, self.nranks, arena_host, self.arena_size,
                                      self.daemon.nblocks, remote, comm_key)
            mine = {"address": self.net.address()}
            if self._host_arena is not None:
                mine.update(arena=self._host_arena.describe(), arena_ptr=self.arena)
            net_info = exchange("net", mine)
            peers = [dict(info, **{k: v for k, v in net_info[p].items() if k in ("arena", "arena_ptr")})
                     for p, info in enumerate(peers)]
            mode = "ring"
        for p, info in enumerate(peers):
            if info["capacity"] != self.capacity or info["stride"] != RECORD_BYTES:
                raise BackendError(f"rank {p} uses {info['capacity']} tag records of {info['stride']} bytes, "
                                   f"rank {self.rank} {self.capacity} of {RECORD_BYTES}: CommOptions differ")
            if info.get("ll_max_bytes", 0) != self.ll_max_bytes:
                raise BackendError(f"rank {p} has an LL region for {info.get('ll_max_bytes', 0)} bytes per peer, "
                                   f"rank {self.rank} for {self.ll_max_bytes}: CommOptions differ")
            if info["backend"] != self.device.backend:
                raise BackendError(f"rank {p} runs the {info['backend']} backend, rank {self.rank} {self.device.backend}")
            same_process = info["pid"] == me["pid"] and info["host"] == me["host"]
            if p == self.rank:
                arenas.append(self.arena)
            elif p in remote:
                arenas.append(self.net.mirror(p))
            elif same_process:
                other = runtime.get_device(info["backend"], info["device"])
                if not (self.device.can_access(other) and other.can_access(self.device)):
                    raise BackendError(f"{self.device.backend} devices {self.device.ordinal} and {info['device']} cannot "
                                       "access each other's memory (no peer access)")
                self.device.enable_access(other)
                arenas.append(info["arena_ptr"])
            else:
                if mode != "ring":
                    mode = "staged" if self._reachable(info, me) else "ring"
                if "arena" not in info:
                    raise BackendError(f"rank {p} is in another process but did not export its arena")
                if info["arena"].get("via") == "host-shm":
                    mapped = HostArena.open(self.device, info["arena"])
                    self._imported_host.append(mapped)
                    ptr = mapped.device_ptr
                else:
                    ptr = self.device.import_memory(info["arena"])
                    self._imported.append(ptr)
                arenas.append(ptr)
                if "status_page" not in info:
                    raise BackendError(f"rank {p} is in another process but did not publish a status page")
                try:
                    self._peer_pages[p] = StatusPage.open(info["status_page"])
                except OSError as exc:
                    raise BackendError(f"cannot open the status page of rank {p} ({info['status_page']}): {exc}; "
                                       "ranks of one host must see the same status directory "
                                       "($DFCCL_STATUS_DIR, else /dev/shm)") from exc
        if self.net is not None:
            self.net.connect({p: net_info[p]["address"] for p in remote})
            self.write_status(int(self._status[0]))
        tables = [a + ARENA_STATUS_BYTES for a in arenas]
        self.id = self.daemon.add_endpoint(self.rank, self.nranks, self.capacity, comm_key,
                                           tables, arenas, self.owner_words, self.reg_table, self.ll_offset, self.ll_max_bytes,
                                           net_remote=self.net.remote_mask if self.net else 0,
                                           net_queues=self.net.queues if self.net else 0)
        self.arenas = arenas
        self.peers = peers
        return mode

    def _reachable(self, info: dict, me: dict) -> bool:
        """Whether this device can load, store and add atomically into the
        peer's device memory (IPC-mapped), the direct path's needs."""
        if info["host"] != me["host"]:
            return False
        if self.device.backend != "cuda":
            return True  # the simulator's arenas are shared memory
        bus = info.get("bus_id")
        if not bus:
            return False
        if bus == me.get("bus_id"):
            return True
        from cuda.bindings import driver

        err, dev = driver.cuDeviceGetByPCIBusId(bus.encode() if isinstance(bus, str) else bus)
        if err != driver.CUresult.CUDA_SUCCESS:
            return False
        err, mine = driver.cuDeviceGet(self.device.ordinal)
        if err != driver.CUresult.CUDA_SUCCESS:
            return False
        err, ok = driver.cuDeviceCanAccessPeer(mine, dev)
        if err != driver.CUresult.CUDA_SUCCESS or not ok:
            return False
        attr = driver.CUdevice_P2PAttribute.CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED
        err, atomics = driver.cuDeviceGetP2PAttribute(attr, mine, dev)
        return err == driver.CUresult.CUDA_SUCCESS and bool(atomics)

    def _move_arena_to_host(self) -> None:
        """Replaces the device arena (no peer mapped it) with a zeroed one in
        host shared memory, with this rank's status written again."""
        host = HostArena.create(self.device, self.arena_size)
        self.device.free_device(self.arena)
        self._host_arena, self.arena = host, host.device_ptr
        self._write_arena_status()

    def unlink_export(self) -> None:
        """Drops the names peers in other processes open this rank's arena
        (a shared-memory file in the simulator, or its host arena) and status
        page by, once they all have mapped them: nothing is left behind
        however this process ends."""
        if self._host_arena is not None:
            self._host_arena.unlink()
        elif self.shareable and self.arena:
            self.device.unlink_export(self.arena)
        if self.page is not None:
            self.page.unlink()

    # -- status ------------------------------------------------------------------
    def write_status(self, state: int | None = None) -> None:
        """Bumps this rank's heartbeat and publishes its state (RANK_*) in
        its status page, where peers' hosts look; a new state also goes to
        the status header of its arena, for the peers' daemons.  A heartbeat
        alone never touches the device (nothing to wait for there)."""
        self._status[1] += np.uint64(1)
        if self.net is not None:
            self.net.set_status(int(state if state is not None else self._status[0]), int(self._status[1]))
        if self.page is not None:
            self.page.write(int(state if state is not None else self._status[0]), int(self._status[1]))
        if state is None or not self.arena:
            return
        self._status[0] = state
        self._write_arena_status()

    def _write_arena_status(self) -> None:
        if self._host_arena is not None:
            self._host_arena.write(0, self._status.tobytes())   # plain stores: no stream on the way
            return
        if self.daemon.device_fault:
            return   # a failed device takes no copy (peers see the status page)
        self.device.copy_to_device(self.arena, self._status.ctypes.data, 24)

    def peer_status(self, rank: int) -> tuple[int, int, int]:
        """(state, heartbeat, pid) of ``rank``, a peer in another process,
        from its status page, or for a peer on another host as it last sent
        them (OSError once its connection failed): plain loads of host
        memory."""
        if self.net is not None and rank in self.net.remote:
            return self.net.peer_status(rank)
        return self._peer_pages[rank].read()

    def transports(self) -> list[str]:
        """How this rank reaches each rank (after connect): "self", "local"
        (this process), "host" (another process of this host: shared memory
        or CUDA IPC) or "ucx" (another host: the network proxy)."""
        me = self.peers[self.rank]
        remote = self.net.remote if self.net is not None else []
        return ["self" if p == self.rank else "ucx" if p in remote
                else "local" if info["pid"] == me["pid"] and info["host"] == me["host"] else "host"
                for p, info in enumerate(self.peers)]

    # -- teardown ----------------------------------------------------------------
    def abort(self, lost_rank: int = -1) -> None:
        self.tags.close()   # no more submissions, from C either
        if self.id is not None:
            self.daemon.abort_endpoint(self.id, lost_rank)

    def release(self, free_memory: bool) -> None:
        """Unregisters from the daemon; frees the arena only when no peer can
        touch it any more (``free_memory``), else leaves it mapped.  What the
        daemon reads while it runs a collective of this endpoint (the peers'
        imported arenas, the registration table, the arena) goes only once it
        holds none: a collective an abort abandoned on the host may still run
        (Daemon.remove_endpoint); until then it stays, and the daemon
        releases it later."""
        self.tags.close()
        for page in self._peer_pages.values():
            page.close()
        self._peer_pages = {}
        if self.page is not None:
            self.page.close()
            self.page = None
        self.unlink_export()
        imported, self._imported = self._imported, []
        imported_host, self._imported_host = self._imported_host, []
        net = self.net
        if net is not None:
            net.close()   # its last status first: the remote peers see this rank leave

        def release_memory() -> None:
            if self.daemon.device_fault:
                return   # the memory of a failed device cannot be freed; it goes with the process
            if net is not None:
                net.free()   # the mirrors and queues the daemon read
            for ptr in imported:
                try:
                    self.device.release_import(ptr)
                except Exception:
                    pass  # the mapping goes with the process
            for mapped in imported_host:
                mapped.close()
            if free_memory:
                self.tags.drop_failed()   # failed collectives' buffers: no peer reaches them now
            if free_memory and self._host_arena is not None:
                self._host_arena.close()
                self._host_arena, self.arena = None, 0
            elif free_memory and self.arena:
                self.device.free_device(self.arena)
                self.arena = 0
            if free_memory and self.reg_table:
                self.device.free_device(self.reg_table)
                self.reg_table = 0
            if self.owner_words:
                self.device.free_device(self.owner_words)   # only this daemon touched them
                self.owner_words = 0

        if self.id is not None:
            idx, self.id = self.id, None
            self.daemon.remove_endpoint(idx, release_memory)
        else:
            release_memory()
