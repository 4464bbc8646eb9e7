"""Which host a rank is on: ranks of one host reach each other's memory
(shared memory, CUDA IPC), ranks of different hosts only through the
network (docs/multi-node.md)."""

from __future__ import annotations

import os
import socket

__all__ = ["HOST_ID_ENV", "host_id", "machine_id"]

#: Overrides the host identity: ranks of one machine given different values
#: talk as if on different hosts (the network path), e.g. to test it.
HOST_ID_ENV = "DFCCL_HOST_ID"

_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def host_id() -> str:
    """$DFCCL_HOST_ID, else machine_id()."""
    override = os.environ.get(HOST_ID_ENV)
    if override:
        return override
    return machine_id()


def machine_id() -> str:
    """The hostname and the kernel's boot id (two containers or machines
    that share a hostname differ in their boot id when they do not share a
    kernel), whatever $DFCCL_HOST_ID says."""
    try:
        with open(_BOOT_ID) as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    name = socket.gethostname()
    return f"{name}/{boot}" if boot else name
