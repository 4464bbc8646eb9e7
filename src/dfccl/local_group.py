"""The ranks of one communicator that live in this process: their shared
arenas' lifetime, and the rendezvous they agree through without a store
(Communicator.for_devices and the children split from it)."""

from __future__ import annotations

import threading
import time

from dfccl.errors import StartupTimeoutError

__all__ = ["LocalGroup", "LocalRendezvous"]


class LocalRendezvous:
    """The in-process counterpart of the store for ranks that all live in
    this process (for_devices): each rank posts a value under a name and
    waits for the others'."""

    def __init__(self, nranks: int):
        self.nranks = nranks
        self._cond = threading.Condition()
        self._values: dict = {}
        self._shared: dict = {}

    def exchange(self, name, rank: int, value, deadline: float, timeout: float):
        with self._cond:
            slot = self._values.setdefault(name, {})
            slot[rank] = value
            self._cond.notify_all()
            while len(slot) < self.nranks:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [p for p in range(self.nranks) if p not in slot]
                    raise StartupTimeoutError(
                        f"rank {rank}: split timed out after {timeout:g} s: ranks {missing} of this process have not "
                        "called split (each rank of a for_devices group must call split on its own thread, or use "
                        "Communicator.split_all)", rank=rank, missing_ranks=missing, arrived_ranks=sorted(slot))
                self._cond.wait(left)
            return [slot[p] for p in range(self.nranks)]

    def shared(self, name, factory):
        """One object per name for every rank that asks (the first one makes it)."""
        with self._cond:
            obj = self._shared.get(name)
            if obj is None:
                obj = self._shared[name] = factory()
            return obj


class LocalGroup:
    """The ranks of one communicator that live in this process: arenas are
    freed only when the last of them closes (peers may still read them).
    ``closes_memory`` is False for a rank whose peers are in other processes:
    they may map its arena for as long as they live."""

    def __init__(self, size: int, *, closes_memory: bool):
        self.lock = threading.Lock()
        self.open = size
        self.closes_memory = closes_memory
        self.endpoints: list = []
        # A rank closed while the daemon still held some of its collectives
        # (abandoned by an abort): the group's arenas then stay mapped.
        self.held = False
        self.rendezvous = LocalRendezvous(size)  # split() among ranks of this process

    def leave(self) -> bool:
        with self.lock:
            self.open -= 1
            return self.open == 0
