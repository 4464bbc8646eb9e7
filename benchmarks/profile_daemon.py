"""A bounded workload for profiling the daemon kernel with Nsight Compute.

Every rank lives in this process (``--devices 0,0``: two ranks sharing one
GPU and its daemon; ``0,1``: two GPUs).  The daemon quits after
``--idle-quit-ms`` without work, so each launch that a profiler serialises
ends on its own; the script then checks the results, prints the daemon's
per-block profile (where a block's time went, summed over launches) and exits.

    python benchmarks/profile_daemon.py --devices 0,0 --size 8 --iters 200
    ncu --clock-control none --kernel-name dfccl_daemon --launch-count 2 \\
        --section LaunchStats --section Occupancy --section SpeedOfLight \\
        -o daemon python benchmarks/profile_daemon.py --iters 20

docs/profiling.md explains the steps and how to read the output.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

# The benchmarks' shared helpers (dfccl_support) live in support/, beside the package.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support"))

import dfccl
from dfccl import scenarios as sc
from dfccl.bench import arrays
from dfccl_support import suite


def main(argv=None) -> int:
    p = suite.parser(__doc__.splitlines()[0], iters=200, devices="0,0", backend="cuda")
    p.add_argument("--size", type=int, default=8, help="bytes per rank of the float32 all_reduce (default 8)")
    p.add_argument("--idle-quit-ms", type=float, default=5.0,
                   help="the daemon leaves after this long without work (default 5 ms)")
    args = p.parse_args(argv)
    devices = args.devices
    ctx_opts = dfccl.DaemonOptions(idle_quit_ns=int(args.idle_quit_ms * 1e6))
    comms = dfccl.Communicator.for_devices(devices, backend=args.backend, daemon_options=ctx_opts)
    count = max(1, args.size // 4)
    rng = np.random.default_rng()
    inputs = [rng.standard_normal(count).astype(np.float32) for _ in comms]
    sends = [arrays.from_numpy(args.backend, c.device, x) for c, x in zip(comms, inputs)]
    recvs = [arrays.empty(args.backend, c.device, count, "float32", fill=np.nan) for c in comms]
    plans = [c.prepare_all_reduce(count, "float32", tag="profile").bind(s, r)
             for c, s, r in zip(comms, sends, recvs)]
    t0 = time.perf_counter()
    last = None
    for _ in range(args.iters):
        last = [b() for b in plans]
    for w in last:
        w.synchronize(timeout=300)
    elapsed = time.perf_counter() - t0
    want = sc.reduce_reference(inputs, "sum")
    for r in recvs:
        sc.assert_close(arrays.to_numpy(r), want, "float32", "sum", len(comms), f"all_reduce {args.size} B")
    print(f"{args.iters} all_reduces of {args.size} B on devices {devices}: {elapsed * 1e6 / args.iters:.1f} us "
          f"each back to back, results checked")
    prof = comms[0]._daemon.daemon_profile()
    keys = ("passes", "runs", "pull_ns", "pick_ns", "restore_ns", "run_ns", "save_ns", "idle_ns")
    print("block " + " ".join(f"{k:>12}" for k in keys))
    for b, row in enumerate(prof):
        if row["passes"]:
            print(f"{b:>5} " + " ".join(f"{row[k]:>12}" for k in keys))
    # The step profile is counted only by a daemon built with DFCCL_STEP_PROFILE=1.
    steps = ("ll_runs", "ll_credit_ns", "ll_push_ns", "ll_publish_ns", "ll_recv_ns", "ll_finish_ns",
             "ll_move_ns", "complete_ns")
    if any(row["ll_runs"] for row in prof):
        print("block " + " ".join(f"{k:>13}" for k in steps) + "   (ns per LL run)")
        for b, row in enumerate(prof):
            if row["ll_runs"]:
                print(f"{b:>5} {row['ll_runs']:>13} "
                      + " ".join(f"{row[k] / row['ll_runs']:>13.0f}" for k in steps[1:]))
    for c in comms:
        c.close()
    results = {"us_back_to_back": elapsed * 1e6 / args.iters, "profile": prof}
    print("wrote", suite.write(args.out, suite.record("profile_daemon", args, args.backend, devices, results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
