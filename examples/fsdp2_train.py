"""FSDP2 (``fully_shard``) over NCCL or dfccl.

    torchrun --nproc-per-node 2 examples/fsdp2_train.py --backend dfccl

FSDP2 all-gathers parameters and reduce-scatters gradients on side streams
(``_allgather_base`` / ``_reduce_scatter_base``, or the ``*_single`` names of
newer torch, with AVG or PREMUL_SUM), which the dfccl backend orders after the
stream current at the call.  Without GPUs: gloo vs dfccl's simulator.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch_setup import BACKENDS, init


def build(dim: int, layers: int) -> torch.nn.Module:
    blocks = [torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))
              for _ in range(layers)]
    return torch.nn.Sequential(*blocks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=BACKENDS, default="dfccl")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()

    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard

    rank, device, backend = init(args.backend)
    cuda = device.type == "cuda"

    torch.manual_seed(0)
    model = build(args.dim, args.layers).to(device)
    for block in model:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        x = torch.randn(16, args.dim, generator=gen).to(device)
        start = time.perf_counter()
        loss = model(x).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        if rank == 0:
            print(f"[{backend}] step {step:3d}  {(time.perf_counter() - start) * 1e3:8.2f} ms  "
                  f"loss {loss.item():.6e}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
