"""Where a DDP step's time goes, one process (world size 1) on GPU 0, or on
CPU tensors where there is no GPU: the DDP example's model and loop over
nccl, gloo or dfccl (with daemon options), its step time, phase times (GPU
events and host enqueue time), the process group's calls per step and their
host time, and how often dfccl launched its daemon.  One JSON line per run
(appended to --out); run each configuration in its own process, several
times, interleaved: step medians move by a millisecond from one process to
the next (docs/performance-log.md, section 19).

    python benchmarks/ddp_step_probe.py nccl|gloo|dfccl[,blocks=N][,idle_ms=M][,empty_us=U]
        [--steps 80] [--warmup 20] [--profile] [--breakdown] [--out FILE]
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from ddp_train import TinyTransformer  # noqa: E402


def parse(config: str):
    name, *kv = config.split(",")
    return name, {k: float(v) for k, v in (x.split("=") for x in kv)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("config")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--breakdown", action="store_true",
                   help="also time dfccl's pieces of an all-reduce (wall and thread CPU time)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    faulthandler.dump_traceback_later(300, exit=True)   # a hang prints where it stopped
    backend, kv = parse(args.config)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t0 = time.perf_counter()
    calls: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}   # the same calls' thread CPU time
    daemon = None
    if backend == "dfccl":
        # The calls timed below are the Python backend's methods (the
        # compiled backend's: torch_host_path_probe.py).
        os.environ.setdefault("DFCCL_TORCH_IMPL", "python")
        import dfccl
        import dfccl.torch as dt
        from dfccl.options import DaemonOptions

        opts = DaemonOptions(blocks=int(kv["blocks"]) if "blocks" in kv else None,
                             idle_quit_ns=int(kv["idle_ms"] * 1e6) if "idle_ms" in kv else None,
                             empty_quit_ns=int(kv["empty_us"] * 1e3) if "empty_us" in kv else None)
        daemon = dfccl.runtime.get_daemon("cuda" if cuda else "sim", 0, opts)
        timed = [(dt.ProcessGroupDfccl, meth, meth)
                 for meth in ("allreduce", "allgather", "broadcast", "_allgather_base", "_reduce_scatter_base")]
        if args.breakdown:
            from dfccl.communicator import Communicator
            from dfccl.submission import Submitter

            # The tag table's part of a submission is C inside the daemon's
            # submit (hotpath.pyx): no Python call of its own to time.
            timed += [(Communicator, "_all_reduce_at", "communicator all_reduce_at"),
                      (Submitter, "submit_task", "daemon submit_at"),
                      (dt.DfcclWork, "__init__", "DfcclWork()"),
                      (dt.DfcclWork, "get_future", "get_future")]
        for owner, meth, label in timed:
            orig = getattr(owner, meth)

            def wrapped(*a, __orig=orig, __name=label, **k):
                s, c = time.perf_counter(), time.thread_time()
                try:
                    return __orig(*a, **k)
                finally:
                    calls.setdefault(__name, []).append(time.perf_counter() - s)
                    cpu.setdefault(__name, []).append(time.thread_time() - c)
            setattr(owner, meth, wrapped)
    if backend == "nccl" and not cuda:
        raise SystemExit("nccl needs a GPU")
    dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
    print(f"[{args.config}] init {time.perf_counter() - t0:.2f} s", flush=True)
    torch.manual_seed(0)
    model = DDP(TinyTransformer().to(device), device_ids=[0] if cuda else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1234)
    nparams = sum(p.numel() for p in model.parameters())
    calls.clear()
    cpu.clear()

    def batch():
        return torch.randint(0, 512, (8, 65), generator=gen).to(device)

    def fwd(tokens):
        logits = model(tokens[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))

    steps, losses = [], []
    for step in range(args.steps):
        tokens = batch()
        sync()
        s = time.perf_counter()
        loss = fwd(tokens)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sync()
        steps.append((time.perf_counter() - s) * 1e3)
        losses.append(loss.item())
    n_calls = {k: len(v) / args.steps for k, v in calls.items()}
    call_us = {k: statistics.median(v) * 1e6 for k, v in calls.items() if v}
    call_cpu_us = {k: statistics.median(v) * 1e6 for k, v in cpu.items() if v}
    # Phases: GPU time between events and host enqueue time, no sync inside a step.
    ph = {"fwd_gpu": [], "bwd_gpu": [], "opt_gpu": [], "fwd_host": [], "bwd_host": [], "opt_host": []}
    for step in range(30 if cuda else 0):
        tokens = batch()
        torch.cuda.synchronize()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        h = [time.perf_counter()]
        ev[0].record()
        loss = fwd(tokens)
        ev[1].record()
        h.append(time.perf_counter())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        ev[2].record()
        h.append(time.perf_counter())
        opt.step()
        ev[3].record()
        h.append(time.perf_counter())
        torch.cuda.synchronize()
        for i, k in enumerate(("fwd", "bwd", "opt")):
            ph[f"{k}_gpu"].append(ev[i].elapsed_time(ev[i + 1]))
            ph[f"{k}_host"].append((h[i + 1] - h[i]) * 1e3)
    phases = {k: round(statistics.median(v), 3) for k, v in ph.items() if v}
    res = {"config": args.config, "params": nparams, "step_ms_median": statistics.median(steps[args.warmup:]),
           "step_ms_min": min(steps[args.warmup:]), "phases_ms": phases, "pg_calls_per_step": n_calls,
           "pg_call_host_us": call_us, "pg_call_cpu_us": call_cpu_us, "loss_last": losses[-1]}
    if daemon is not None:
        res["daemon_launches"] = daemon.launches
        res["daemon_sms"] = daemon.daemon_sms()
    print(json.dumps(res), flush=True)
    if args.profile and cuda:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                tokens = batch()
                loss = fwd(tokens)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18), flush=True)
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(res) + "\n")
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    main()
