"""Cost of one preemption on the daemon: save a run's context, pick the next
task, restore its context and re-check its wait.

Rank 0 has P collectives whose peer has not arrived; its daemon cycles through
them, giving each one window W before preempting it.  Over T seconds that is
P_total preemptions, so one visit costs T / P_total, of which W is waiting:
overhead = T / P_total - W.  Measured for several W (each in a fresh process:
windows are per process and device) on the first GPU; rank 1 (second GPU, or
the same one) then submits everything and all results are checked.

    python benchmarks/bench_preemption.py [--windows 2000,5000,20000] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys

CHILD = r"""
import json, sys, time
import numpy as np
import dfccl
from dfccl import runtime, scenarios as sc
W, P, T, backend = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
n = runtime.device_count(backend)
devices = [0, 1 % n] if backend == "cuda" else [0, 1]
opts = dfccl.ContextOptions(base_window_ns=W, max_window_ns=W, adaptive=False, idle_quit_ns=int(60e9))
comms = dfccl.Communicator.for_devices(devices, backend=backend, context_options=opts,
                                       options=dfccl.CommOptions(path="direct"))
rng = np.random.default_rng()
specs = [sc.Spec(f"p{i}", "all_reduce", 256, "float32") for i in range(P)]
insts = [sc.prepare(s, comms, rng) for s in specs]
for inst in insts:
    sc.submit(inst, comms[0])
time.sleep(T)
for inst in insts:
    sc.submit(inst, comms[1])
for inst in insts:
    for w in inst.works:
        w.synchronize(timeout=60)
    sc.verify(inst)
pre = sum(inst.works[0].stats["preemptions"] for inst in insts)
print("RESULT " + json.dumps({"window_ns": W, "pending": P, "seconds": T, "preemptions": pre,
                              "visit_us": T / pre * 1e6, "overhead_us": T / pre * 1e6 - W / 1e3}))
for c in comms:
    c.close()
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--windows", default="2000,5000,20000", help="base windows in ns")
    p.add_argument("--pending", type=int, default=64)
    p.add_argument("--seconds", type=float, default=1.0)
    p.add_argument("--backend", default="cuda")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = p.parse_args(argv)
    rows = []
    print(f"{'window us':>10} {'preemptions':>12} {'visit us':>9} {'overhead us':>12}")
    for w in [int(x) for x in args.windows.split(",")]:
        out = subprocess.run([sys.executable, "-c", CHILD, str(w), str(args.pending), str(args.seconds),
                              args.backend], capture_output=True, text=True, timeout=300)
        line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
        if not line:
            print(out.stdout, out.stderr, file=sys.stderr)
            return 1
        row = json.loads(line[0][7:])
        rows.append(row)
        print(f"{w / 1e3:10.1f} {row['preemptions']:12d} {row['visit_us']:9.2f} {row['overhead_us']:12.2f}")
    os.makedirs(args.out, exist_ok=True)
    name = f"{datetime.date.today().isoformat()}-preemption-{args.backend}.json"
    with open(os.path.join(args.out, name), "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
