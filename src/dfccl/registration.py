"""User-buffer registration: ``comm.register(buf)`` (like ncclCommRegister).

On the staged direct path (ranks in other processes of the host) peers cannot
map a user's buffer, so every rank copies its input into its arena, where
peers read it.  A registered buffer skips that copy: its *allocation* (the
range cuMemGetAddressRange reports on a GPU; a shared-memory allocation from
:func:`mem_alloc` in the simulator) is exported once, every peer maps it once
(CUDA IPC; the shared-memory file), and collectives whose input lies in it
publish a word naming the registration slot and the offset, which peers
translate through a per-communicator table in device memory
(``dfccl_endpoint.reg_table``, cuda/daemon/transfer_direct.cuh,
``staged_address``).

* Registration is collective over the communicator: the k-th ``register``
  of every rank is one exchange (through the communicator's rendezvous
  store), and returns once every peer has mapped every rank's allocation.
* Both sides cache by allocation: the owner by (base, allocation id), a
  peer by (rank, slot, base, allocation id); registering another buffer of
  an allocation already registered maps nothing new.
* The allocation id (CU_POINTER_ATTRIBUTE_BUFFER_ID; the simulator's
  shared-memory name) is checked at every submission: a buffer freed and
  reallocated at the same address is not the registered one, so the
  registration is dropped and the collective takes the staged copy.
* Communicators without a staged path need no registration (peers in this
  process read buffers in place; the ring moves data through FIFOs): there
  ``register`` only validates the buffer and returns a handle.
* What is used: a registered *input* (send buffer) on the staged path, for
  every collective kind.  The two-shot all-reduce's reduced segment still goes
  through the arena (registering outputs is not done).

Deregistration (``handle.close()``, ``comm.deregister(handle)``, leaving the
``with`` block) is local; the peers' mappings are released when a slot is
reused or the communicator closes.
"""

from __future__ import annotations

import ctypes
import time
from dfccl._native.layout import REG_BIT, REG_SLOT_SHIFT, REG_SLOTS, TASK_SEND_REGISTERED
from dfccl.bootstrap import gather_through_store
from dfccl.errors import BackendError, InvalidArgumentError, ResourceError
from dfccl.unique_id import UniqueId

__all__ = ["RegistrationHandle", "Registry", "mem_alloc", "mem_free", "allocation_of", "REG_SLOTS"]

_MAX_OFFSET = 1 << REG_SLOT_SHIFT


def mem_alloc(nbytes: int, *, backend: str | None = None, device: int = 0) -> int:
    """Device memory that can be registered (like ncclMemAlloc); returns its
    address.  On GPUs any cuMemAlloc / cudaMalloc memory (PyTorch's, CuPy's)
    can be registered too; in the simulator only memory from here can."""
    from dfccl import runtime

    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 1:
        raise InvalidArgumentError(f"mem_alloc: nbytes must be an int >= 1, not {nbytes!r}")
    dev = runtime.get_device(runtime.resolve_backend(backend), device)
    return dev.alloc_device(nbytes, True)


def mem_free(ptr: int, *, backend: str | None = None, device: int = 0) -> None:
    """Frees memory from :func:`mem_alloc`."""
    from dfccl import runtime

    runtime.get_device(runtime.resolve_backend(backend), device).free_device(ptr)


def allocation_of(device, ptr: int) -> tuple[int, int, str]:
    """(base, size, allocation id) of the allocation holding ``ptr``."""
    if device.backend == "sim":
        found = device.shared_allocation(ptr)
        if found is None:
            raise InvalidArgumentError("register: in the simulator only memory from dfccl.registration.mem_alloc "
                                       "(shared memory peers can map) can be registered")
        return found
    from cuda.bindings import driver

    device.make_current()
    err, base, size = driver.cuMemGetAddressRange(ptr)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise BackendError(f"cuMemGetAddressRange failed: {err}", driver_code=int(err))
    err, buffer_id = driver.cuPointerGetAttribute(driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_BUFFER_ID, ptr)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise BackendError(f"cuPointerGetAttribute(BUFFER_ID) failed: {err}", driver_code=int(err))
    return int(base), int(size), str(int(buffer_id))


class RegistrationHandle:
    """One registered buffer.  Close it (or leave its ``with`` block) when the
    buffer is no longer used by pending collectives."""

    def __init__(self, registry: "Registry | None", ptr: int, nbytes: int, base: int = 0, alloc_id: str = "",
                 slot: int = -1):
        self._registry = registry
        self.ptr = ptr
        self.nbytes = nbytes
        self.base = base
        self.alloc_id = alloc_id
        self.slot = slot
        self.closed = False

    @property
    def active(self) -> bool:
        """Whether peers read this buffer in place (staged path, still valid)."""
        return not self.closed and self.slot >= 0

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._registry is not None and self.slot >= 0:
            self._registry.release(self)

    def __enter__(self) -> "RegistrationHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("active" if self.slot >= 0 else "not needed")
        return f"<dfccl.RegistrationHandle 0x{self.ptr:x} {self.nbytes} B slot={self.slot} {state}>"


class _Export:
    __slots__ = ("slot", "base", "size", "alloc_id", "desc", "refs")

    def __init__(self, slot, base, size, alloc_id, desc):
        self.slot, self.base, self.size, self.alloc_id, self.desc, self.refs = slot, base, size, alloc_id, desc, 0


class Registry:
    """One rank's registrations on one communicator with a staged path:
    ``endpoint`` is the rank's (its registration table and device), and
    register() exchanges through the store of ``unique_id``."""

    def __init__(self, endpoint, rank: int, nranks: int, unique_id: UniqueId):
        self.endpoint = endpoint
        self.rank = rank
        self.nranks = nranks
        self.unique_id = unique_id
        self.device = endpoint.device
        self.table = endpoint.reg_table
        self.exports: dict[tuple[int, str], _Export] = {}
        self.free_slots = list(range(REG_SLOTS - 1, -1, -1))
        self.imports: dict[tuple[int, int], tuple[int, str, int, bool]] = {}  # (rank, slot) -> base, id, local, ours
        self.handles: list[RegistrationHandle] = []
        self.rounds = 0

    # -- register (collective) -------------------------------------------------------
    def register(self, ptr: int, nbytes: int, timeout: float) -> RegistrationHandle:
        rank = self.rank
        base, size, alloc_id = allocation_of(self.device, ptr)
        if ptr + nbytes > base + size:
            raise InvalidArgumentError(f"register: the buffer [0x{ptr:x}, +{nbytes}) runs past its allocation "
                                       f"[0x{base:x}, +{size})", rank=rank)
        exp = self.exports.get((base, alloc_id))
        if exp is None:
            if not self.free_slots:
                raise ResourceError(f"all {REG_SLOTS} registration slots of this rank are in use; close handles of "
                                    "buffers no longer needed", rank=rank)
            exp = _Export(self.free_slots.pop(), base, size, alloc_id, self.device.export_memory(base))
            self.exports[(base, alloc_id)] = exp
        exp.refs += 1
        try:
            self.rounds += 1
            uid = self.unique_id
            prefix = f"comm/{uid.comm_key():016x}/reg/{self.rounds}"
            me = self.endpoint.describe_process()
            entry = {"slot": exp.slot, "base": base, "alloc_id": alloc_id, "export": exp.desc, **me}
            deadline = time.monotonic() + timeout
            with uid.connect(timeout=max(deadline - time.monotonic(), 0.05)) as store:
                entries = gather_through_store(store, prefix + "/entry", rank, self.nranks, entry, deadline,
                                               timeout, what="register")
                for p, e in enumerate(entries):
                    if p != rank:
                        self._map(p, e, me)
                gather_through_store(store, prefix + "/mapped", rank, self.nranks, {}, deadline, timeout,
                                     what="register (mapping peers' buffers)")
        except BaseException:
            self._unref(exp)
            raise
        handle = RegistrationHandle(self, ptr, nbytes, base, alloc_id, exp.slot)
        self.handles.append(handle)
        return handle

    def _map(self, p: int, e: dict, me: dict) -> None:
        """Maps rank p's allocation (once) and points reg_table[p][slot] at it."""
        key = (p, int(e["slot"]))
        cur = self.imports.get(key)
        if cur is not None and cur[0] == e["base"] and cur[1] == e["alloc_id"]:
            return
        if cur is not None and cur[3]:
            self.device.release_import(cur[2])
        if e["pid"] == me["pid"] and e["host"] == me["host"]:
            local, ours = int(e["base"]), False
        else:
            local, ours = int(self.device.import_memory(e["export"])), True
        self.imports[key] = (e["base"], e["alloc_id"], local, ours)
        word = ctypes.c_uint64(local)
        self.device.copy_to_device(self.table + 8 * (key[0] * REG_SLOTS + key[1]), ctypes.addressof(word), 8)

    # -- submission --------------------------------------------------------------------
    def send_word(self, ptr: int, nbytes: int) -> int:
        """The registered word of an input at [ptr, ptr + nbytes), or 0 when it
        is in no valid registration (take the staged copy).  A registration
        whose allocation was freed and replaced is dropped here."""
        for h in self.handles:
            if h.ptr <= ptr and ptr + nbytes <= h.ptr + h.nbytes:
                try:
                    base, _size, alloc_id = allocation_of(self.device, ptr)
                except (InvalidArgumentError, BackendError):
                    base, alloc_id = -1, ""
                if base != h.base or alloc_id != h.alloc_id:
                    h.close()     # freed (and maybe reallocated): never read it through the old mapping
                    return self.send_word(ptr, nbytes)
                offset = ptr - h.base
                if offset >= _MAX_OFFSET:
                    return 0
                return REG_BIT | (h.slot << REG_SLOT_SHIFT) | offset
        return 0

    def task_fields(self, send_ptr: int, send_nbytes: int, flags: int,
                    staging_bytes: int) -> tuple[int, int, int]:
        """(flags, staging bytes, send word) of a staged collective whose
        input may be registered."""
        word = self.send_word(send_ptr, send_nbytes)
        if not word:
            return flags, staging_bytes, 0
        # Only a two-shot all-reduce still stages (its reduced segment); the
        # input copy is not made, but the layout keeps its place, and the
        # staging stays: it is the FIFO of the ring the collective falls back
        # to when a peer could not stage (docs/architecture.md, "Staging budget").
        return flags | TASK_SEND_REGISTERED, staging_bytes, word

    # -- release -------------------------------------------------------------------------
    def release(self, handle: RegistrationHandle) -> None:
        if handle in self.handles:
            self.handles.remove(handle)
        exp = self.exports.get((handle.base, handle.alloc_id))
        if exp is not None:
            self._unref(exp)

    def _unref(self, exp: _Export) -> None:
        exp.refs -= 1
        if exp.refs <= 0:
            self.exports.pop((exp.base, exp.alloc_id), None)
            self.free_slots.append(exp.slot)

    def close(self) -> None:
        """At communicator close: unmaps every peer allocation mapped here."""
        for h in list(self.handles):
            h.closed = True
        self.handles = []
        for base, _aid, local, ours in self.imports.values():
            if ours:
                try:
                    self.device.release_import(local)
                except Exception:
                    pass
        self.imports = {}
