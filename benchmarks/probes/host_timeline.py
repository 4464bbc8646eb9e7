"""Where a collective waited for spends its time, seen from the host.

Two ranks on one device in one process (one daemon).  Per iteration: submit
both ranks' all_reduce (a bound plan), spin until the daemon's host link has
taken both submissions (``Daemon.submissions``), spin on each completion
word without retiring, then retire both; the device's own times come from
``Work.stats``.  Prints medians (p10, p90) in microseconds.

    python benchmarks/host_timeline.py --bytes 8 [--backend cuda] [--iters 1000] [--gaps-us 0,100,1000]
        [--empty-quit-us N]

``--gaps-us`` spins a host gap between iterations (one table per gap, with
the daemon launches it counted): a gap longer than the empty quit
(DaemonOptions.empty_quit_ns, 50 us on a GPU) lets the daemon leave, so
the table shows where a relaunch's cost falls.  ``--empty-quit-us`` sets
the empty quit (and the idle quit, if shorter) for the comparison.

``DFCCL_LINK_AHEAD`` (or DaemonOptions.link_ahead) picks how many ring
entries the host link reads ahead.  The spinning holds the GIL, so nothing
else in the process runs Python meanwhile; this measures the library, not a
workload."""

from __future__ import annotations

import argparse
import time

import numpy as np

import dfccl
from dfccl.bench import arrays
from probe_snippets import quit_options, spin

STEPS = ("submit rank 0", "submit rank 1", "submitted -> taken", "taken -> rank 0 done", "rank 1 done after",
         "retire both", "total", "rank 0 queued", "rank 0 wall", "rank 1 queued", "rank 1 wall")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="cuda", choices=("cuda", "sim"))
    p.add_argument("--device", type=int, default=None, help="default: 0 on cuda, 7000 on sim")
    p.add_argument("--bytes", type=int, default=8)
    p.add_argument("--iters", type=int, default=1000)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--gaps-us", default="0", help="host gaps between iterations, comma-separated")
    p.add_argument("--empty-quit-us", type=float, default=None)
    args = p.parse_args()
    device = args.device if args.device is not None else (0 if args.backend == "cuda" else 7000)
    comms = dfccl.Communicator.for_devices([device, device], backend=args.backend,
                                           daemon_options=quit_options(args.empty_quit_us))
    daemon = comms[0]._daemon
    count = max(1, args.bytes // 4)
    rng = np.random.default_rng()
    inputs = [rng.integers(1, 100, count).astype(np.float32) for _ in comms]
    xs = [arrays.from_numpy(args.backend, device, x) for x in inputs]
    ys = [arrays.empty(args.backend, device, count, "float32", fill=np.nan) for _ in comms]
    plans = [c.prepare_all_reduce(count, "float32", tag="timeline").bind(x, y) for c, x, y in zip(comms, xs, ys)]
    now = time.perf_counter_ns
    tables = []
    for gap_us in [float(g) for g in args.gaps_us.split(",")]:
        launches = daemon.launches
        rows = []
        for it in range(args.warmup + args.iters):
            t0 = now()
            w0 = plans[0]()
            t1 = now()
            w1 = plans[1]()
            t2 = now()
            target = daemon.submissions[0]
            while daemon.submissions[1] < target:
                pass
            t3 = now()
            while not w0._peek_done():
                pass
            t4 = now()
            while not w1._peek_done():
                pass
            t5 = now()
            w0.synchronize(timeout=30)
            w1.synchronize(timeout=30)
            t6 = now()
            s0, s1 = w0.stats, w1.stats
            if it >= args.warmup:
                rows.append((t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5, t6 - t0,
                             s0["queued_ns"], s0["wall_ns"], s1["queued_ns"], s1["wall_ns"]))
            spin(gap_us * 1e-6)
        tables.append((gap_us, daemon.launches - launches, rows))
    want = inputs[0] + inputs[1]
    for y in ys:
        got = arrays.to_numpy(y)
        assert np.array_equal(got, want), "wrong all_reduce result"
    for c in comms:
        c.close()
    quit_us = daemon.policy.empty_quit_ns / 1000
    for gap_us, launches, rows in tables:
        a = np.array(rows) / 1000
        print(f"all_reduce {args.bytes} B, {args.backend}:{device}, two ranks, host gap {gap_us:g} us, "
              f"empty quit {quit_us:g} us; {launches} launches in {args.warmup + args.iters} iterations; "
              f"median (p10, p90) us over {len(rows)}")
        for i, name in enumerate(STEPS):
            print(f"  {name:>22}: {np.median(a[:, i]):7.2f}  ({np.percentile(a[:, i], 10):6.2f}, "
                  f"{np.percentile(a[:, i], 90):6.2f})")


if __name__ == "__main__":
    main()
