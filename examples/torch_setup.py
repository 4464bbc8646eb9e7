"""What the torch examples share: this rank's device and its process group.

Run by torchrun (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT set).  On
GPUs, local rank r uses GPU r, or r modulo the GPU count where there are
more ranks than GPUs (dfccl runs several ranks on one GPU; NCCL refuses, and
two processes on one GPU need MPS to run at the same time).  Without GPUs the
examples run on CPU tensors: NCCL becomes gloo and dfccl runs on its
simulator.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

__all__ = ["BACKENDS", "init"]

#: --backend choices of every example: gloo is a reference that runs anywhere.
BACKENDS = ("dfccl", "nccl", "gloo")


def init(backend: str) -> tuple[int, torch.device, str]:
    """Initialises the default process group over ``backend``; returns (rank,
    device, the backend actually used)."""
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    cuda = torch.cuda.is_available()
    if cuda:
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if backend == "dfccl":
        import dfccl.torch  # noqa: F401  (registers backend "dfccl")

        if not cuda:
            os.environ.setdefault("DFCCL_TORCH_BACKEND", "sim")
    elif backend == "nccl" and not cuda:
        backend = "gloo"
    dist.init_process_group(backend=backend)
    return rank, device, backend
