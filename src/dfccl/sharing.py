"""Ranks that share a device: how a daemon's blocks are split between the
ranks of one process on it, and the warning for ranks of several processes
on one GPU."""

from __future__ import annotations

import os
from typing import Sequence

__all__ = ["daemon_share", "shared_gpu_warning"]


def daemon_share(peers: Sequence[dict], rank: int, channels: int) -> tuple[int, int]:
    """(channels, block offset) of ``rank``: ranks of one process on one
    device share its daemon's blocks, and a collective's channels on those
    ranks must run at the same time (each waits for the others'), so each
    gets a disjoint run of blocks (dfccl_first_block adds the offset): at
    most blocks // (ranks sharing) channels, the same on every rank (the
    smallest share of any daemon), and the k-th sharing rank starts k runs
    further on.  Overlapping runs would make the channels of one collective
    take turns on a block, each preempted in its window while the other
    waits for it."""
    def daemon(info: dict) -> tuple:
        return (info.get("host"), info.get("pid"), info.get("backend"), info.get("device"))

    sharing: dict[tuple, list[int]] = {}
    for r, info in enumerate(peers):
        sharing.setdefault(daemon(info), []).append(r)
    for members in sharing.values():
        channels = min(channels, max(1, peers[members[0]]["blocks"] // len(members)))
    return channels, sharing[daemon(peers[rank])].index(rank) * channels


def shared_gpu_warning(peers: Sequence[dict], rank: int, environ=os.environ) -> str | None:
    """What this rank should be warned of when some peer in another process
    shares its GPU (MPS), or None.  The processes then share the GPU's
    hardware queues: a stream of one process that waits for a collective
    can hold up the other process's stream writes that arm its part, and
    with several side streams waiting at once (FSDP2) every queue of both
    can be held (docs/torch.md, "Known problems"; NCCL refuses two ranks on
    one GPU).  With lazy module loading, a kernel's first launch between
    collectives can also stop both ranks."""
    me = peers[rank]
    if me.get("backend") != "cuda" or not me.get("bus_id"):
        return None
    sharing = [p for p, info in enumerate(peers) if p != rank and info.get("bus_id") == me["bus_id"]
               and (info.get("pid") != me.get("pid") or info.get("host") != me.get("host"))]
    if not sharing:
        return None
    why = (f"dfccl: rank {rank} shares GPU {me['bus_id']} with ranks {sharing} of other processes: the processes "
           "share the GPU's hardware queues, so a stream waiting for a collective in one can hold up what arms "
           "the other's part; with several streams waiting at once both can stop (one process per GPU, or one "
           "process for the ranks of a GPU, avoids it; docs/torch.md, \"Known problems\").")
    if environ.get("CUDA_MODULE_LOADING", "").strip().upper() != "EAGER":
        why += ("  CUDA also loads modules lazily here: a kernel's first launch between collectives can stop the "
                "ranks; set CUDA_MODULE_LOADING=EAGER before CUDA starts.")
    return why
