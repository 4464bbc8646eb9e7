"""Two process groups over the same ranks, used in rank-divergent order.

    torchrun --nproc-per-node 2 examples/divergent_groups.py --backend nccl   # hangs: reported after --timeout s
    torchrun --nproc-per-node 2 examples/divergent_groups.py --backend dfccl  # finishes

Rank 0 issues an all-reduce on group A, then one on group B; every other rank
issues B first, then A.  Both are issued with ``async_op=True`` on the current
stream.  NCCL runs each rank's collectives in stream order, so rank 0 waits in
A for peers that are stuck in B: a deadlock.  dfccl's daemon preempts the
collective whose peers have not arrived and runs the other one, so both finish.
Without GPUs, dfccl runs on its simulator (NCCL needs GPUs).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch_setup import init


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["nccl", "dfccl"], default="dfccl")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=20.0, help="seconds before a hang is reported")
    args = parser.parse_args()

    if args.backend == "nccl" and not torch.cuda.is_available():
        raise SystemExit("--backend nccl needs GPUs; run --backend dfccl for the simulator")
    rank, device, _ = init(args.backend)
    cuda = device.type == "cuda"
    world = dist.get_world_size()
    ranks = list(range(world))
    group_a, group_b = dist.new_group(ranks), dist.new_group(ranks)

    start = time.monotonic()
    for r in range(args.rounds):
        a = torch.full((1 << 20,), float(rank + 1), device=device)
        b = torch.full((1 << 12,), float(10 * (rank + 1)), device=device)
        order = [(a, group_a), (b, group_b)] if rank == 0 else [(b, group_b), (a, group_a)]
        works = [dist.all_reduce(t, group=g, async_op=True) for t, g in order]
        for w in works:
            w.wait()
        if cuda:
            # Poll instead of synchronizing, so that a hang is reported.
            done = torch.cuda.Event()
            done.record()
            deadline = time.monotonic() + args.timeout
            while not done.query():
                if time.monotonic() > deadline:
                    print(f"rank {rank}: round {r} did not finish within {args.timeout} s: the collectives "
                          f"deadlocked under {args.backend}", flush=True)
                    os._exit(1)  # a hung communicator cannot be shut down cleanly
                time.sleep(0.01)
        expect_a, expect_b = world * (world + 1) / 2, 10 * world * (world + 1) / 2
        if not (bool((a == expect_a).all()) and bool((b == expect_b).all())):
            print(f"rank {rank}: round {r}: wrong result", flush=True)
            sys.exit(1)
    if rank == 0:
        print(f"[{args.backend}] {args.rounds} rounds of divergent-order collectives on {world} ranks finished in "
              f"{time.monotonic() - start:.3f} s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
