"""A two-stage pipeline (GPipe-style micro-batches) with send / recv, over NCCL or dfccl.

    torchrun --nproc-per-node 2 examples/pipeline_send_recv.py --backend dfccl
    torchrun --nproc-per-node 2 examples/pipeline_send_recv.py --backend nccl

Rank 0 holds the first half of an MLP, rank 1 the second half and the loss.
Forward: rank 0 sends each micro-batch's activations to rank 1; backward:
rank 1 sends the activation gradients back.  After a few steps every rank
checks its parameters against the same training run in one process.  Without
GPUs it runs on CPU tensors: ``--backend nccl`` becomes gloo and dfccl runs on
its simulator.  With dfccl the sends are posted before the recvs of the other
direction (``--eager``), an order that needs matching by (peer, tag).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch_setup import BACKENDS, init


def build_stages(dim: int, seed: int) -> list[torch.nn.Sequential]:
    torch.manual_seed(seed)
    return [torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim)),
            torch.nn.Sequential(torch.nn.GELU(), torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(),
                                torch.nn.Linear(4 * dim, 1))]


def batches(step: int, micro: int, batch: int, dim: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for _ in range(micro):
        x = torch.randn(batch, dim, generator=g)
        out.append((x, x.sum(1, keepdim=True).sin()))
    return out


def reference(args) -> list[torch.nn.Sequential]:
    """The same training run in one process."""
    stages = build_stages(args.dim, args.seed)
    opt = torch.optim.SGD([p for s in stages for p in s.parameters()], lr=args.lr)
    for step in range(args.steps):
        opt.zero_grad()
        for x, y in batches(step, args.micro, args.batch, args.dim):
            loss = torch.nn.functional.mse_loss(stages[1](stages[0](x)), y) / args.micro
            loss.backward()
        opt.step()
    return stages


def pipeline_step(stage: torch.nn.Module, rank: int, step: int, args, device: torch.device) -> float:
    micro = batches(step, args.micro, args.batch, args.dim)
    shape = (args.batch, args.dim)
    total = 0.0
    if rank == 0:
        outs = []
        sends = []
        for m, (x, _) in enumerate(micro):
            act = stage(x.to(device))
            outs.append(act)
            sends.append(dist.isend(act.detach().contiguous(), dst=1))
        grads = [torch.empty(shape, device=device) for _ in micro]
        # dfccl: every recv is posted while the sends may still be pending.
        recvs = [dist.irecv(g, src=1) for g in grads] if args.eager else []
        for m in range(len(micro)):
            if args.eager:
                recvs[m].wait()
            else:
                dist.recv(grads[m], src=1)
            outs[m].backward(grads[m])
        for s in sends:
            s.wait()
    else:
        acts = [torch.empty(shape, device=device) for _ in micro]
        recvs = [dist.irecv(a, src=0) for a in acts]
        sends = []
        for m, (_, y) in enumerate(micro):
            recvs[m].wait()
            a = acts[m].requires_grad_()
            loss = torch.nn.functional.mse_loss(stage(a), y.to(device)) / args.micro
            loss.backward()
            total += loss.item()
            sends.append(dist.isend(a.grad.contiguous(), dst=0))
        for s in sends:
            s.wait()
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=BACKENDS, default="dfccl")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--micro", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eager", action=argparse.BooleanOptionalAction, default=None,
                        help="post all recvs of the backward before waiting for the forward sends "
                             "(default: on for dfccl)")
    args = parser.parse_args()

    if args.eager is None:
        args.eager = args.backend == "dfccl"
    rank, device, backend = init(args.backend)
    cuda = device.type == "cuda"
    if dist.get_world_size() != 2:
        raise SystemExit("this example runs two pipeline stages: torchrun --nproc-per-node 2")

    stage = build_stages(args.dim, args.seed)[rank].to(device)
    opt = torch.optim.SGD(stage.parameters(), lr=args.lr)
    start = time.perf_counter()
    for step in range(args.steps):
        opt.zero_grad()
        loss = pipeline_step(stage, rank, step, args, device)
        opt.step()
        if rank == 1:
            print(f"step {step}: loss {loss:.5f}", flush=True)
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start

    want = reference(args)[rank]
    for (name, p), q in zip(stage.named_parameters(), want.parameters()):
        if not torch.allclose(p.detach().cpu(), q.detach(), rtol=1e-4, atol=1e-5):
            raise SystemExit(f"rank {rank}: parameter {name} differs from the single-process run "
                             f"(max error {(p.detach().cpu() - q.detach()).abs().max():.3g})")
    print(f"rank {rank}: {args.steps} steps in {elapsed:.3f} s over {backend}; parameters match the "
          "single-process run", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
