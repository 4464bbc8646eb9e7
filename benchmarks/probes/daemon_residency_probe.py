"""What a resident daemon costs the rest of the GPU: the same torch workloads
timed with no dfccl daemon, then with an idle daemon of N blocks kept
resident (DaemonOptions.idle_quit_ns and empty_quit_ns long), in one
process.  Every kernel is launched once before the daemon starts: a first
launch would wait for the resident daemon to leave.

A daemon block holds its SM's whole register file (512 threads x 128
registers), so no other kernel's block shares that SM while the daemon runs:
an SM-bound kernel that fills the GPU is expected to slow by about
sm_count / (sm_count - blocks).

    python benchmarks/daemon_residency_probe.py [--blocks 32,8,2] [--out DIR]
"""

from __future__ import annotations

import argparse
import faulthandler
import datetime
import json
import os
import socket
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

import dfccl
from dfccl import runtime
from dfccl.options import DaemonOptions
from dfccl.bench import arrays

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "examples"))
from ddp_train import TinyTransformer  # noqa: E402


def timed(fn, iters: int, reps: int = 5) -> float:
    """Median over ``reps`` of the GPU time of ``iters`` calls, in ms per call."""
    out = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / iters)
    return statistics.median(out)


def workloads(device: torch.device) -> dict:
    torch.manual_seed(0)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    big = torch.empty(1 << 28, device=device)   # 1 GiB
    dst = torch.empty_like(big)
    model = TinyTransformer().to(device)
    tokens = torch.randint(0, 512, (8, 65), device=device)

    def step():
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()

    return {"matmul_bf16_8192": (lambda: torch.mm(a, b), 10), "copy_1GiB": (lambda: dst.copy_(big), 10),
            "tiny_transformer_step": (step, 20)}


def measure(loads: dict) -> dict:
    for fn, iters in loads.values():   # warm up (kernels loaded, autotuning done)
        timed(fn, iters, reps=1)
    return {name: timed(fn, iters) for name, (fn, iters) in loads.items()}


def with_daemon(blocks: int, loads: dict) -> tuple[dict, list]:
    opts = DaemonOptions(blocks=blocks, idle_quit_ns=600 * 10**9, empty_quit_ns=600 * 10**9)
    comms = dfccl.Communicator.for_devices([0, 0], backend="cuda", daemon_options=opts)
    try:
        sends = [arrays.from_numpy("cuda", 0, np.ones(256, np.float32)) for _ in comms]
        recvs = [arrays.empty("cuda", 0, 256, np.float32, fill=0) for _ in comms]
        works = [c.all_reduce(s, r) for c, s, r in zip(comms, sends, recvs)]
        for w in works:
            w.synchronize(timeout=30)
        daemon = comms[0]._daemon
        assert daemon.daemon_state[1] == "running", daemon.daemon_state
        print(f"daemon of {blocks} blocks running; measuring (every kernel was launched before it started)", flush=True)
        result = measure(loads)
        print(f"daemon of {blocks} blocks:", result, flush=True)
        assert daemon.daemon_state[1] == "running", "the daemon left during the measurement"
        return result, daemon.daemon_sms()
    finally:
        # The daemon first (its quit request): freeing a communicator's memory
        # (cuMemFree) would wait for a resident daemon to leave.
        runtime.shutdown()
        for c in comms:
            c.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", default="32,8,2")
    p.add_argument("--out", default=str(HERE.parent / "results"))
    args = p.parse_args()
    faulthandler.dump_traceback_later(300, exit=True)   # a hang prints where it stopped
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    loads = workloads(device)
    rows = [{"daemon_blocks": 0, "ms": measure(loads)}]
    print("no daemon:", rows[0]["ms"], flush=True)
    for blocks in [int(b) for b in args.blocks.split(",")]:
        ms, sms = with_daemon(blocks, loads)
        rows.append({"daemon_blocks": blocks, "sms": sms, "ms": ms})
    rows.append({"daemon_blocks": 0, "ms": measure(loads), "note": "again, after the daemons"})
    base = rows[0]["ms"]
    print(f"{torch.cuda.get_device_name(device)}, {sm_count} SMs; ms per call (ratio to no daemon)")
    print(f"{'daemon blocks':>14} " + " ".join(f"{k:>26}" for k in base))
    for r in rows:
        print(f"{r['daemon_blocks']:>14} " + " ".join(f"{r['ms'][k]:>17.3f} ({r['ms'][k] / base[k]:5.3f})" for k in base))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"residency-{datetime.datetime.now():%Y%m%d-%H%M%S}.json")
    with open(path, "w") as f:
        json.dump({"host": socket.gethostname(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
                   "gpu": torch.cuda.get_device_name(device), "sm_count": sm_count, "rows": rows}, f, indent=1)
    print(f"wrote {path}")
    faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    main()
