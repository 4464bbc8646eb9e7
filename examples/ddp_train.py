"""A small transformer trained with DistributedDataParallel, over NCCL or dfccl.

    torchrun --nproc-per-node 2 examples/ddp_train.py --backend dfccl
    torchrun --nproc-per-node 2 examples/ddp_train.py --backend nccl

Prints the step time and the loss.  Without GPUs it runs on CPU tensors:
``--backend nccl`` becomes gloo and dfccl runs on its simulator.  ``--hook``
registers dfccl's tagged all-reduce hook (buckets complete in any order).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


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
    parser.add_argument("--backend", choices=["nccl", "dfccl"], default="dfccl")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--hook", action="store_true", help="dfccl only: tagged all-reduce DDP hook")
    args = parser.parse_args()

    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    backend = args.backend
    if backend == "dfccl":
        import dfccl.torch  # registers backend "dfccl"

        if not cuda:
            os.environ.setdefault("DFCCL_TORCH_BACKEND", "sim")
    elif not cuda:
        backend = "gloo"
    dist.init_process_group(backend=backend)

    torch.manual_seed(0)
    model = DDP(TinyTransformer().to(device), device_ids=[local_rank] if cuda else None)
    if args.hook:
        if args.backend != "dfccl":
            raise SystemExit("--hook needs --backend dfccl")
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
            print(f"[{backend}] step {step:3d}  {elapsed * 1e3:8.2f} ms  loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
