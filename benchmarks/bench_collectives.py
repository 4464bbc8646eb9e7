"""dfccl against NCCL, in the same process on the same GPUs and buffers,
following nccl-tests' conventions:

- size: bytes of the buffer (all_gather: the gathered output; reduce_scatter:
  the scattered input), float32, op sum;
- time: back-to-back operations after warm-up, host wall clock around the
  loop and the final synchronisation, divided by the count;
- algbw = size / time (GB/s, 1e9); busbw = algbw x 2(n-1)/n for all_reduce,
  x (n-1)/n for all_gather and reduce_scatter, x 1 for broadcast and reduce;
- out-of-place and in-place columns; every size checked for correctness on
  fresh random inputs with poisoned outputs, for both libraries.

NCCL is driven here by one thread for all GPUs, which is NCCL's slow mode
(17-20 us at 8 B on 2 x H200, against 7.5 us with one thread or process per
GPU): it flatters dfccl.  The fair baseline is `dfccl bench --mode thread`
(one NCCL thread per GPU) or `--mode process` / benchmarks/bench_processes.py
(one process per GPU).

Results go to benchmarks/results/ as JSON and Markdown, with the date and the
machine.  Usage:
    python benchmarks/bench_collectives.py --kinds all_reduce --max 512M
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import sys
import time

import numpy as np

import dfccl  # noqa: E402
from dfccl import arrays, runtime, scenarios as sc  # noqa: E402
from dfccl.nccl_baseline import Nccl  # noqa: E402

BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
              "reduce_scatter": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0, "reduce": lambda n: 1.0}


def parse_size(s: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(s[:-1]) * mult[s[-1].upper()]) if s[-1].upper() in mult else int(s)


def fmt_size(n: int) -> str:
    for unit, m in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= m and n % m == 0:
            return f"{n // m}{unit}"
    return str(n)


class Setup:
    """Buffers of one (kind, size) on every rank, shared by dfccl and NCCL."""

    def __init__(self, kind: str, size: int, devices: list[int], dtype: str = "float32"):
        n = len(devices)
        esize = np.dtype(dtype).itemsize
        self.kind, self.dtype, self.n = kind, dtype, n
        per_rank = kind in ("all_gather", "reduce_scatter")
        self.count = max(1, size // esize // (n if per_rank else 1))  # Spec semantics
        in_count = self.count * (n if kind == "reduce_scatter" else 1)
        out_count = self.count * (n if kind == "all_gather" else 1)
        self.size = (out_count if kind == "all_gather" else in_count) * esize
        self.sends = [arrays.DeviceArray(d, in_count, dtype) for d in devices]
        self.recvs = [arrays.DeviceArray(d, out_count, dtype) for d in devices]
        self.in_count, self.out_count = in_count, out_count

    def in_place_pair(self, r: int):
        """(send, recv) of rank r in NCCL's in-place form."""
        c = self.count
        if self.kind == "all_gather":
            return self.recvs[r][r * c:(r + 1) * c], self.recvs[r]
        if self.kind == "reduce_scatter":
            return self.sends[r], self.sends[r][r * c:(r + 1) * c]
        return self.sends[r], self.sends[r]


def verify(setup: Setup, run_once, in_place: bool, rng, label: str) -> None:
    """Fresh inputs, poisoned outputs, one run, numpy reference."""
    n = setup.n
    inputs = [sc.random_input(rng, setup.dtype, setup.in_count, "sum") for _ in range(n)]
    for r in range(n):
        if in_place and setup.kind == "all_gather":
            full = np.full(setup.out_count, np.nan, dtype=setup.dtype)
            full[r * setup.count:(r + 1) * setup.count] = inputs[r]
            setup.recvs[r].upload(full)
        else:
            setup.sends[r].upload(inputs[r])
            if not in_place:
                setup.recvs[r].upload(np.full(setup.out_count, np.nan, dtype=setup.dtype))
    run_once()
    k, c = setup.kind, setup.count
    for r in range(n):
        send, recv = setup.in_place_pair(r) if in_place else (setup.sends[r], setup.recvs[r])
        got = recv.download()
        if k == "all_reduce":
            want = sc.reduce_reference(inputs, "sum")
        elif k == "all_gather":
            want = np.concatenate(inputs)
        elif k == "reduce_scatter":
            want = sc.reduce_reference(inputs, "sum")[r * c:(r + 1) * c]
        elif k == "broadcast":
            want = inputs[0]
        else:
            if r != 0:
                continue
            want = sc.reduce_reference(inputs, "sum")
        sc.assert_close(got, want, setup.dtype, "sum", n, f"{label} {k} {fmt_size(setup.size)} rank {r}")


def time_loop(submit, finish, target_s: float = 0.05, warmup: int = 3) -> float:
    """Seconds per operation: ``warmup`` runs, then enough back-to-back runs
    to fill ``target_s``."""
    for _ in range(warmup):
        submit()
    finish()
    t0 = time.perf_counter()
    submit()
    finish()
    one = max(time.perf_counter() - t0, 1e-6)
    iters = int(min(2000, max(5, target_s / one)))
    t0 = time.perf_counter()
    for _ in range(iters):
        submit()
    finish()
    return (time.perf_counter() - t0) / iters


def bench_dfccl(setup: Setup, comms, in_place: bool, rng, kind: str):
    plans = []
    for r, c in enumerate(comms):
        tag = ("bench", kind, setup.size, "ip" if in_place else "oop")
        prep = getattr(c, f"prepare_{kind}")(setup.count, setup.dtype, tag=tag)
        send, recv = setup.in_place_pair(r) if in_place else (setup.sends[r], setup.recvs[r])
        plans.append(prep.bind(send, recv))
    last = []

    def submit():
        last[:] = [b() for b in plans]

    def finish():
        for w in last:
            w.synchronize(timeout=300)

    verify(setup, lambda: (submit(), finish()), in_place, rng, "dfccl")
    return time_loop(submit, finish)


def bench_nccl(setup: Setup, nccl: Nccl, in_place: bool, rng):
    pairs = [setup.in_place_pair(r) if in_place else (setup.sends[r], setup.recvs[r]) for r in range(setup.n)]
    sends = [p[0].ptr for p in pairs]
    recvs = [p[1].ptr for p in pairs]

    def submit():
        nccl.collective(setup.kind, sends, recvs, setup.count, setup.dtype)

    verify(setup, lambda: (submit(), nccl.synchronize()), in_place, rng, "nccl")
    return time_loop(submit, nccl.synchronize)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kinds", default="all_reduce,all_gather,reduce_scatter,broadcast,reduce")
    p.add_argument("--min", default="8")
    p.add_argument("--max", default="512M")
    p.add_argument("--step", type=int, default=4, help="size multiplier between rows")
    p.add_argument("--devices", default=None, help="comma-separated GPUs (default: all)")
    p.add_argument("--path", default="auto", choices=("auto", "direct", "ring"))
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--tag", default="", help="suffix of the result file names")
    args = p.parse_args(argv)

    devices = [int(d) for d in args.devices.split(",")] if args.devices else list(range(runtime.cuda_device_count()))
    if len(devices) < 2:
        print("needs at least two GPUs", file=sys.stderr)
        return 2
    n = len(devices)
    rng = np.random.default_rng()
    comms = dfccl.Communicator.for_devices(devices, backend="cuda", options=dfccl.CommOptions(path=args.path))
    nccl = Nccl(devices)
    be = runtime.get_backend("cuda", devices[0])
    machine = {"host": socket.gethostname(), "gpus": n, "sm_count": be.sm_count, "cc": be.compute_capability,
               "nccl_version": nccl.version, "dfccl_path": comms[0].path, "dfccl_channels": comms[0].channels,
               "python": platform.python_version(), "date": datetime.datetime.now().isoformat(timespec="seconds")}
    print(json.dumps(machine))
    rows = []
    for kind in args.kinds.split(","):
        size = parse_size(args.min)
        print(f"\n# {kind}  (float32, sum; times in us; ratio = NCCL time / dfccl time, >1: dfccl faster)")
        print(f"{'size':>8} {'dfccl oop':>10} {'nccl oop':>10} {'ratio':>6} {'dfccl ip':>10} {'nccl ip':>10} "
              f"{'ratio':>6} {'dfccl busbw':>11} {'nccl busbw':>10}")
        while size <= parse_size(args.max):
            setup = Setup(kind, size, devices)
            row = {"kind": kind, "size": setup.size, "count": setup.count}
            for in_place in (False, True):
                key = "ip" if in_place else "oop"
                row[f"dfccl_{key}_us"] = bench_dfccl(setup, comms, in_place, rng, kind) * 1e6
                row[f"nccl_{key}_us"] = bench_nccl(setup, nccl, in_place, rng) * 1e6
            for lib in ("dfccl", "nccl"):
                algbw = setup.size / (row[f"{lib}_oop_us"] * 1e-6) / 1e9
                row[f"{lib}_algbw"] = algbw
                row[f"{lib}_busbw"] = algbw * BUS_FACTOR[kind](n)
            row["ratio_oop"] = row["nccl_oop_us"] / row["dfccl_oop_us"]
            row["ratio_ip"] = row["nccl_ip_us"] / row["dfccl_ip_us"]
            rows.append(row)
            print(f"{fmt_size(setup.size):>8} {row['dfccl_oop_us']:10.2f} {row['nccl_oop_us']:10.2f} "
                  f"{row['ratio_oop']:6.2f} {row['dfccl_ip_us']:10.2f} {row['nccl_ip_us']:10.2f} "
                  f"{row['ratio_ip']:6.2f} {row['dfccl_busbw']:11.1f} {row['nccl_busbw']:10.1f}", flush=True)
            del setup
            size *= args.step
    for c in comms:
        c.close()
    nccl.close()
    os.makedirs(args.out, exist_ok=True)
    stamp = datetime.date.today().isoformat()
    name = f"{stamp}-{n}gpu-collectives{('-' + args.tag) if args.tag else ''}"
    with open(os.path.join(args.out, name + ".json"), "w") as f:
        json.dump({"machine": machine, "rows": rows}, f, indent=1)
    print(f"\nwrote {os.path.join(args.out, name + '.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
