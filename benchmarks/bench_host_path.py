"""Host-path and daemon overheads with every rank in this process: back-to-back
time per collective and the latency of one collective waited for, for a few
sizes, with the daemon's per-block profile.  Runs on one GPU (ranks share its
daemon) as well as on several; no NCCL (it refuses two ranks on one GPU), so
this measures dfccl against itself across revisions.

    python benchmarks/bench_host_path.py [--devices 0,0] [--sizes 8,4K,256K,1M]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import numpy as np

# The benchmarks' shared helpers (dfccl_support) live in support/, beside the package.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support"))

import dfccl
from dfccl import scenarios as sc
from dfccl.bench import arrays
from dfccl_support import suite
from dfccl_support.profile import profile_delta


def main(argv=None) -> int:
    p = suite.parser(__doc__.split("\n\n")[0], iters=2000, devices="0,0", backend="cuda")
    p.add_argument("--sizes", default="8,4096,262144,1048576")
    args = p.parse_args(argv)
    devices = args.devices
    comms = dfccl.Communicator.for_devices(devices, backend=args.backend)
    rng = np.random.default_rng()
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        count = max(1, size // 4)
        inputs = [rng.standard_normal(count).astype(np.float32) for _ in comms]
        sends = [arrays.from_numpy(args.backend, c.device, x) for c, x in zip(comms, inputs)]
        recvs = [arrays.empty(args.backend, c.device, count, "float32", fill=np.nan) for c in comms]
        plans = [c.prepare_all_reduce(count, "float32", tag=("hp", size)).bind(s, r)
                 for c, s, r in zip(comms, sends, recvs)]
        for w in [b() for b in plans]:
            w.synchronize(timeout=60)
        want = sc.reduce_reference(inputs, "sum")
        for r in recvs:
            sc.assert_close(arrays.to_numpy(r), want, "float32", "sum", len(comms), f"all_reduce {size} B")
        # submit cost alone (host), back to back, latency
        t0 = time.perf_counter()
        last = None
        for _ in range(args.iters):
            last = [b() for b in plans]
        t_submit_loop = time.perf_counter() - t0
        for w in last:
            w.synchronize(timeout=60)
        t_b2b = (time.perf_counter() - t0) / args.iters
        prof0 = comms[0]._daemon.daemon_profile()
        lat, walls, hosts = [], [], []
        for _ in range(300):
            t0 = time.perf_counter()
            ws = [b() for b in plans]
            for w in ws:
                w.synchronize(timeout=60)
            lat.append(time.perf_counter() - t0)
            walls.append(ws[0].stats["wall_ns"] / 1e3)
            hosts.append(ws[0].stats["host_ns"] / 1e3)
        busy = profile_delta(prof0, comms[0]._daemon.daemon_profile())
        per_run = {k: busy[k] / max(1, busy["runs"]) for k in ("pull_us", "pick_us", "restore_us", "run_us",
                                                               "save_us")}
        row = {"size": size, "ranks": len(comms), "b2b_us": t_b2b * 1e6,
               "submit_us": t_submit_loop / args.iters / len(comms) * 1e6,
               "latency_us": statistics.median(lat) * 1e6, "device_wall_us": statistics.median(walls),
               "host_us": statistics.median(hosts), "busy_blocks": busy["blocks"], "per_run_us": per_run}
        rows.append(row)
        print(json.dumps(row))
    print(f"\n{'size':>8} {'b2b us':>8} {'submit us':>9} {'1-op us':>8} {'wall us':>8} {'host us':>8}")
    for r in rows:
        print(f"{r['size']:>8} {r['b2b_us']:8.1f} {r['submit_us']:9.2f} {r['latency_us']:8.1f} "
              f"{r['device_wall_us']:8.1f} {r['host_us']:8.1f}")
    print("wrote", suite.write(args.out, suite.record("host_path", args, args.backend, devices, rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
