"""Cost of one preemption on the daemon: save a run's context, pick the next
task, restore its context and re-check its wait.

Rank 0 has P collectives whose peer has not arrived; its daemon cycles through
them, giving each one window W before preempting it.  Over T seconds that is
P_total preemptions, so one visit costs T / P_total, of which W is waiting:
overhead = T / P_total - W.  The daemon's running_ns counters split a visit
into time inside the run (its wait included) and time between runs
(scheduler pass, save, pick, restore).  Measured for several W (each in a fresh process:
windows are per process and device) on the first GPU; rank 1 (second GPU, or
the same one) then submits everything and all results are checked.

    python benchmarks/bench_preemption.py [--windows 2000,5000,20000] [--out DIR]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

# The benchmarks' shared helpers (dfccl_support) live in support/, beside the package.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support"))

from dfccl_support import suite  # noqa: E402

CHILD = r"""
import faulthandler, json, sys, time
faulthandler.dump_traceback_later(float(sys.argv[3]) + 40, exit=True)  # a stuck child shows where
import numpy as np
import dfccl
from dfccl import scenarios as sc
W, P, T, backend = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
devices = [int(d) for d in sys.argv[5].split(",")]
# One daemon block, so that it cycles through all P tasks (with more, the
# tags are spread over the blocks and visit them side by side).
opts = dfccl.DaemonOptions(blocks=1, base_window_ns=W, max_window_ns=W, adaptive=False, idle_quit_ns=int(60e9))
comms = dfccl.Communicator.for_devices(devices, backend=backend, daemon_options=opts,
                                       options=dfccl.CommOptions(path="direct"))
rng = np.random.default_rng()
specs = [sc.Spec(f"p{i}", "all_reduce", 256, "float32") for i in range(P)]
insts = [sc.prepare(s, comms, rng) for s in specs]
def block0():
    return comms[0]._daemon.daemon_profile()[0]  # the only block
p0 = block0()
for inst in insts:
    sc.submit(inst, comms[0])
time.sleep(T)
p1 = block0()
cycling = {k: p1[k] - p0[k] for k in p0}  # rank 0 alone, every run preempted
per_run = {k.replace("_ns", "_us"): cycling[k] / max(1, cycling["runs"]) / 1e3 for k in cycling if k.endswith("_ns")}
t1 = time.perf_counter()
for inst in insts:
    sc.submit(inst, comms[1])
works = [w for inst in insts for w in inst.works]
while not all(w.done() for w in works) and time.perf_counter() - t1 < 20:
    time.sleep(1e-3)
settle = time.perf_counter() - t1
if not all(w.done() for w in works):
    stalled = []
    for w in works:
        if not w.done():
            try:
                w.synchronize(timeout=0)
            except dfccl.CollectiveTimeoutError as exc:
                stalled.append(str(exc))
    print("STALL " + json.dumps({"window_ns": W, "pending": len(stalled), "first": stalled[:4],
                                 "daemons": [c._daemon.daemon_state for c in comms],
                                 "profile": block0()}), flush=True)
    import os
    os._exit(1)
for inst in insts:
    sc.verify(inst)
stats = [inst.works[0].stats for inst in insts]
pre = sum(s["preemptions"] for s in stats)
inside = sum(s["running_ns"] for s in stats) / 1e9
print("RESULT " + json.dumps({"window_ns": W, "pending": P, "seconds": T, "preemptions": pre,
                              "visit_us": T / pre * 1e6, "overhead_us": T / pre * 1e6 - W / 1e3,
                              "inside_runs_us": inside / pre * 1e6, "between_runs_us": (T - inside) / pre * 1e6,
                              "settle_ms": settle * 1e3, "runs": cycling["runs"], "per_run_us": per_run}))
for c in comms:
    c.close()
"""


def main(argv=None) -> int:
    p = suite.parser(__doc__.split("\n\n")[0], backend="cuda")
    p.add_argument("--windows", default="2000,5000,20000", help="base windows in ns")
    p.add_argument("--pending", type=int, default=64)
    p.add_argument("--seconds", type=float, default=1.0)
    args = p.parse_args(argv)
    from dfccl import runtime

    # Rank 1 on the second GPU, or on the same one.
    devices = args.devices or ([0, 1 % runtime.device_count("cuda")] if args.backend == "cuda" else [0, 1])
    rows = []
    print(f"{'window us':>10} {'preemptions':>12} {'visit us':>9} {'overhead us':>12} {'inside us':>10} "
          f"{'between us':>11} {'settle ms':>10}")
    for w in [int(x) for x in args.windows.split(",")]:
        out = subprocess.run([sys.executable, "-c", CHILD, str(w), str(args.pending), str(args.seconds),
                              args.backend, ",".join(map(str, devices))], capture_output=True, text=True,
                             timeout=args.seconds + 120)
        line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
        if not line:
            print(f"window {w} ns did not complete:", out.stdout[-3000:], out.stderr[-3000:], file=sys.stderr)
            return 1
        row = json.loads(line[0][7:])
        rows.append(row)
        print(f"{w / 1e3:10.1f} {row['preemptions']:12d} {row['visit_us']:9.2f} {row['overhead_us']:12.2f} "
              f"{row['inside_runs_us']:10.2f} {row['between_runs_us']:11.2f} {row['settle_ms']:10.1f}", flush=True)
        pr = row["per_run_us"]
        print(f"{'':>10} block 0 per run (us): pull {pr['pull_us']:.2f}  pick {pr['pick_us']:.2f}  restore "
              f"{pr['restore_us']:.2f}  run {pr['run_us']:.2f}  save {pr['save_us']:.2f}  idle {pr['idle_us']:.2f}",
              flush=True)
    print("wrote", suite.write(args.out, suite.record("preemption", args, args.backend, devices, rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
