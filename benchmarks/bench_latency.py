"""Latency of one collective, dfccl against NCCL in the same process on the
same buffers: submit on every rank, wait for completion, repeat.  This is what
a training step that synchronises after each collective sees; the throughput
of back-to-back collectives is bench_collectives.py's.

For dfccl it also reports where the time went, as medians of the counters the
daemon records per collective (Work.stats):
  queued   - pulled by the daemon -> first run
  running  - inside runs (waits for the peer included)
  wall     - first run -> done on the device
  host     - submit -> retired on the host (Work.synchronize)
and the depth sweep: N collectives of one tag submitted back to back, then
waited for, per collective (the cost per queued collective must not grow with N).

    python benchmarks/bench_latency.py [--sizes 8,4K,256K] [--iters 200]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import numpy as np

import dfccl
from dfccl import runtime
from dfccl.nccl_baseline import Nccl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_collectives import Setup, fmt_size, parse_size, verify  # noqa: E402


def dfccl_latency(setup: Setup, comms, rng, iters: int, tag) -> dict:
    plans = [getattr(c, f"prepare_{setup.kind}")(setup.count, setup.dtype, tag=tag).bind(setup.sends[r], setup.recvs[r])
             for r, c in enumerate(comms)]

    def once():
        works = [b() for b in plans]
        for w in works:
            w.synchronize(timeout=60)
        return works

    verify(setup, once, False, rng, "dfccl")
    for _ in range(10):
        once()
    times, stats = [], []
    p0 = comms[0]._ctx.daemon_profile()[0]
    for _ in range(iters):
        t0 = time.perf_counter()
        works = once()
        times.append(time.perf_counter() - t0)
        stats.append(works[0].stats)
    p1 = comms[0]._ctx.daemon_profile()[0]
    # Rank 0's daemon, block 0 (every collective uses it): per collective.
    block0 = {k.replace("_ns", "_us") if k.endswith("_ns") else k: (p1[k] - p0[k]) / iters / (1e3 if k.endswith("_ns") else 1)
              for k in p0}
    med = {k: statistics.median(s[k] for s in stats) / 1e3 for k in ("queued_ns", "running_ns", "wall_ns", "host_ns",
                                                                      "max_wait_ns")}
    return {"us": statistics.median(times) * 1e6, "p90_us": float(np.percentile(times, 90)) * 1e6,
            **{k.replace("_ns", "_us"): v for k, v in med.items()},
            "preemptions": sum(s["preemptions"] for s in stats) / len(stats), "block0": block0}


def nccl_latency(setup: Setup, nccl: Nccl, rng, iters: int) -> dict:
    sends = [a.ptr for a in setup.sends]
    recvs = [a.ptr for a in setup.recvs]

    def once():
        nccl.collective(setup.kind, sends, recvs, setup.count, setup.dtype)
        nccl.synchronize()

    verify(setup, once, False, rng, "nccl")
    for _ in range(10):
        once()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        once()
        times.append(time.perf_counter() - t0)
    return {"us": statistics.median(times) * 1e6, "p90_us": float(np.percentile(times, 90)) * 1e6}


def depth_sweep(setup: Setup, comms, depths: list[int]) -> list[dict]:
    rows = []
    for depth in depths:
        plans = [getattr(c, f"prepare_{setup.kind}")(setup.count, setup.dtype, tag=("depth", depth))
                 .bind(setup.sends[r], setup.recvs[r]) for r, c in enumerate(comms)]
        best = None
        for _ in range(3):
            t0 = time.perf_counter()
            works = [b() for _ in range(depth) for b in plans]
            for w in works:
                w.synchronize(timeout=120)
            dt = (time.perf_counter() - t0) / depth
            best = dt if best is None else min(best, dt)
        rows.append({"depth": depth, "us_per_collective": best * 1e6,
                     "last_wall_us": works[-1].stats["wall_ns"] / 1e3})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kinds", default="all_reduce")
    p.add_argument("--sizes", default="8,1K,64K,1M")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--depths", default="1,8,64,512,2048")
    p.add_argument("--devices", default=None)
    p.add_argument("--path", default="auto", choices=("auto", "direct", "ring"))
    p.add_argument("--protocol", default="auto", choices=("auto", "ll", "simple"),
                   help="CommOptions.protocol: 'll' takes the LL protocol up to --ll-max-bytes")
    p.add_argument("--ll-max-bytes", type=int, default=None, help="CommOptions.ll_max_bytes (default: from the budget)")
    p.add_argument("--max-tags", type=int, default=None, help="CommOptions.max_tags (fewer leave room for a larger LL limit)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = p.parse_args(argv)
    devices = [int(d) for d in args.devices.split(",")] if args.devices else list(range(runtime.cuda_device_count()))
    if len(devices) < 2:
        print("needs at least two ranks (--devices 0,0 puts two on one GPU)", file=sys.stderr)
        return 2
    rng = np.random.default_rng()
    options = dfccl.CommOptions(path=args.path, protocol=args.protocol, ll_max_bytes=args.ll_max_bytes,
                                max_tags=args.max_tags)
    comms = dfccl.Communicator.for_devices(devices, backend="cuda", options=options)
    # NCCL takes one rank per GPU; with ranks sharing a GPU only dfccl runs.
    nccl = Nccl(devices) if len(set(devices)) == len(devices) else None
    machine = {"ranks": len(devices), "gpus": len(set(devices)), "nccl_version": nccl.version if nccl else None,
               "dfccl_path": comms[0].path, "dfccl_protocol": args.protocol, "ll_max_bytes": comms[0].ll_max_bytes,
               "date": datetime.datetime.now().isoformat(timespec="seconds")}
    print(json.dumps(machine))
    rows = []
    for kind in args.kinds.split(","):
        print(f"\n# {kind} latency (float32, sum; us, median of {args.iters}; ratio = NCCL / dfccl)")
        print(f"{'size':>8} {'dfccl':>8} {'nccl':>8} {'ratio':>6} {'d p90':>8} {'n p90':>8} | {'queued':>7} "
              f"{'running':>8} {'wall':>7} {'host':>7} {'maxwait':>7} {'preempt':>7}")
        for s in args.sizes.split(","):
            setup = Setup(kind, parse_size(s), devices)
            d = dfccl_latency(setup, comms, rng, args.iters, ("lat", kind, s))
            n = nccl_latency(setup, nccl, rng, args.iters) if nccl else {"us": float("nan"), "p90_us": float("nan")}
            row = {"kind": kind, "size": setup.size, "dfccl": d, "nccl": n, "ratio": n["us"] / d["us"]}
            rows.append(row)
            print(f"{fmt_size(setup.size):>8} {d['us']:8.1f} {n['us']:8.1f} {row['ratio']:6.2f} {d['p90_us']:8.1f} "
                  f"{n['p90_us']:8.1f} | {d['queued_us']:7.1f} {d['running_us']:8.1f} {d['wall_us']:7.1f} "
                  f"{d['host_us']:7.1f} {d['max_wait_us']:7.1f} {d['preemptions']:7.2f}", flush=True)
            b = d["block0"]
            print(f"{'':>8} rank 0 daemon block 0 per collective: {b['passes']:.1f} passes, {b['runs']:.2f} runs; us: "
                  f"pull {b['pull_us']:.1f} pick {b['pick_us']:.1f} restore {b['restore_us']:.1f} run {b['run_us']:.1f} "
                  f"save {b['save_us']:.1f} idle {b['idle_us']:.1f}", flush=True)
        setup = Setup(kind, parse_size(args.sizes.split(",")[0]), devices)
        sweep = depth_sweep(setup, comms, [int(x) for x in args.depths.split(",")])
        print(f"\n# {kind} {fmt_size(setup.size)}: N back to back, one tag (us per collective)")
        for r in sweep:
            print(f"{r['depth']:>6} {r['us_per_collective']:8.1f}   last wall {r['last_wall_us']:.1f}")
        rows.append({"kind": kind, "size": setup.size, "depth_sweep": sweep})
    for c in comms:
        c.close()
    if nccl:
        nccl.close()
    os.makedirs(args.out, exist_ok=True)
    name = f"{datetime.date.today().isoformat()}-{len(set(devices))}gpu-{len(devices)}rank-latency.json"
    with open(os.path.join(args.out, name), "w") as f:
        json.dump({"machine": machine, "rows": rows}, f, indent=1)
    print(f"\nwrote {os.path.join(args.out, name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
