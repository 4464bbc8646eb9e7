"""A small transformer trained with DistributedDataParallel, over NCCL or dfccl.

    torchrun --nproc-per-node 2 examples/ddp_train.py --backend dfccl
    torchrun --nproc-per-node 2 examples/ddp_train.py --backend nccl

Prints the step time and the loss of every step (rank 0); the same seed gives
the same loss curve over any backend.  Without GPUs it runs on CPU tensors:
``--backend nccl`` becomes gloo and dfccl runs on its simulator.  ``--hook``
registers dfccl's tagged all-reduce hook (buckets complete in any order).
"""

from __future__ import annotations

import argparse
import gc
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch_setup import BACKENDS, init


class TinyTransformer(torch.nn.Module):
    def __init__(self, vocab: int = 512, dim: int = 128, layers: int = 2, heads: int = 4):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        layer = torch.nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, layers)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=BACKENDS, default="dfccl")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--hook", action="store_true", help="dfccl only: tagged all-reduce DDP hook")
    args = parser.parse_args()

    if args.hook and args.backend != "dfccl":
        raise SystemExit("--hook needs --backend dfccl")
    rank, device, backend = init(args.backend)
    cuda = device.type == "cuda"

    torch.manual_seed(0)
    model = DDP(TinyTransformer().to(device), device_ids=[device.index] if cuda else None)
    if args.hook:
        from dfccl.torch import TaggedAllreduceState, tagged_allreduce_hook

        model.register_comm_hook(TaggedAllreduceState(), tagged_allreduce_hook)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1234 + rank)

    for step in range(args.steps):
        tokens = torch.randint(0, 512, (args.batch, args.seq + 1), generator=gen).to(device)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if rank == 0:
            print(f"[{backend}] step {step:3d}  {elapsed * 1e3:8.2f} ms  loss {loss.item():.6f}", flush=True)
    # DDP's reducer holds the process group and sits in reference cycles: drop
    # it now so that the group is torn down here, not during interpreter
    # shutdown (where gloo's worker threads can abort the process).
    del model, opt
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
