"""The DDP example's step over two backends in one process, alternating step
by step: one process (world size 1) on GPU 0, or on CPU tensors where there
is no GPU.  The reference backend is the default process group, the other a
second group over the same rank; each has its own copy of the model (same
seed, same batches), so both see the same machine at the same time and the
ratio does not carry the millisecond that step medians move by from one
process to the next (docs/performance-log.md, section 19).

    python benchmarks/ddp_ab_probe.py [--reference nccl|gloo] [--steps 200] [--warmup 20] [--out FILE]

Prints, and appends to --out, one JSON line: each backend's median and
fastest step (ms), dfccl's median over the reference's, the median of the
per-pair ratios, and the largest relative loss difference.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from ddp_train import TinyTransformer  # noqa: E402


class Run:
    """One backend's model, optimiser and batches."""

    def __init__(self, name: str, group, device: torch.device, cuda: bool) -> None:
        self.name = name
        torch.manual_seed(0)
        self.model = DDP(TinyTransformer().to(device), device_ids=[0] if cuda else None, process_group=group)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.gen = torch.Generator().manual_seed(1234)
        self.device = device
        self.steps: list[float] = []
        self.losses: list[float] = []

    def step(self, sync) -> None:
        tokens = torch.randint(0, 512, (8, 65), generator=self.gen).to(self.device)
        sync()
        s = time.perf_counter()
        logits = self.model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        sync()
        self.steps.append((time.perf_counter() - s) * 1e3)
        self.losses.append(loss.item())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reference", default=None, help="nccl (default on a GPU) or gloo")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    faulthandler.dump_traceback_later(600, exit=True)   # a hang prints where it stopped
    cuda = torch.cuda.is_available()
    reference = args.reference or ("nccl" if cuda else "gloo")
    if reference == "nccl" and not cuda:
        raise SystemExit("nccl needs a GPU")
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    import dfccl.torch  # noqa: F401  (registers the backend)

    dist.init_process_group(reference, store=dist.HashStore(), rank=0, world_size=1)
    runs = [Run(reference, dist.group.WORLD, device, cuda), Run("dfccl", dist.new_group([0], backend="dfccl"),
                                                                 device, cuda)]
    for i in range(args.steps):
        # Alternate which backend goes first, so that neither always follows the other.
        for r in (runs if i % 2 == 0 else runs[::-1]):
            r.step(sync)
    ref, ours = runs
    w = args.warmup
    pairs = [b / a for a, b in zip(ref.steps[w:], ours.steps[w:])]
    loss_diff = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(ref.losses, ours.losses))
    res = {"reference": reference, "device": torch.cuda.get_device_name(0) if cuda else "cpu",
           "steps": args.steps, "warmup": w,
           f"{reference}_ms_median": statistics.median(ref.steps[w:]), f"{reference}_ms_min": min(ref.steps[w:]),
           "dfccl_ms_median": statistics.median(ours.steps[w:]), "dfccl_ms_min": min(ours.steps[w:]),
           "ratio_of_medians": statistics.median(ours.steps[w:]) / statistics.median(ref.steps[w:]),
           "median_pair_ratio": statistics.median(pairs), "max_rel_loss_diff": loss_diff}
    print(json.dumps(res), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(res) + "\n")
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    main()
