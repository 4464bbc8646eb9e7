"""What a relaunch of the daemon costs the next collective: one 8-byte
all_reduce waited for (two ranks on one device, one process), with a host
gap spun between iterations.  A gap longer than the empty quit
(DaemonOptions.empty_quit_ns, 50 us on a GPU) lets the daemon leave, so the
next collective relaunches it; the launches column counts them.

    python benchmarks/relaunch_gap_probe.py [--gaps-us 0,20,100,1000] [--iters 300] [--backend cuda|sim]
        [--empty-quit-us N] [--tag gap|none|tuple]

``--empty-quit-us`` sets the empty quit (and the idle quit, if shorter): a
long one keeps the daemon resident through every gap, the comparison that
separates the relaunch from what any host gap costs.  ``--tag``: the
collectives' tag, "gap" (default), none (untagged) or the tuple ("gap",)
(a tag type whose calls build their descriptor every time).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import dfccl
from dfccl import runtime
from dfccl.bench import arrays
from probe_snippets import quit_options, spin


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gaps-us", default="0,20,100,1000")
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--backend", choices=("cuda", "sim"), default=None, help="default: cuda if a GPU is visible")
    p.add_argument("--empty-quit-us", type=float, default=None)
    p.add_argument("--tag", choices=("gap", "none", "tuple"), default="gap")
    args = p.parse_args()
    backend = args.backend or ("cuda" if runtime.cuda_device_count() > 0 else "sim")
    comms = dfccl.Communicator.for_devices([0, 0], backend=backend, daemon_options=quit_options(args.empty_quit_us))
    daemon = comms[0]._daemon
    rng = np.random.default_rng()
    bufs = [arrays.from_numpy(backend, 0, rng.standard_normal(2).astype(np.float32)) for _ in comms]
    tag = {"gap": "gap", "none": None, "tuple": ("gap",)}[args.tag]
    print(f"{backend}: one 8 B all_reduce (tag {tag!r}) waited for, two ranks on device 0, {args.iters} iterations per gap, "
          f"empty quit {daemon.policy.empty_quit_ns / 1000:g} us")
    try:
        for gap_us in [float(g) for g in args.gaps_us.split(",")]:
            times, submits = [], []
            launches = daemon.launches
            for i in range(args.iters + args.warmup):
                start = time.perf_counter()
                works = [c.all_reduce(b, tag=tag) for c, b in zip(comms, bufs)]
                submitted = time.perf_counter()
                for w in works:
                    w.synchronize(timeout=30)
                if i >= args.warmup:
                    times.append(time.perf_counter() - start)
                    submits.append(submitted - start)
                spin(gap_us * 1e-6)
            times.sort()
            print(f"gap {gap_us:7.0f} us: median {statistics.median(times) * 1e6:7.1f} us  "
                  f"p90 {times[int(0.9 * (len(times) - 1))] * 1e6:7.1f} us  "
                  f"(both submits {statistics.median(submits) * 1e6:5.1f} us)  launches {daemon.launches - launches}",
                  flush=True)
    finally:
        for c in comms:
            c.close()
        runtime.shutdown()


if __name__ == "__main__":
    main()
