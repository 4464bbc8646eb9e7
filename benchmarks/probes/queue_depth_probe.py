"""How a deep queue drains: ``--n`` all-reduces of ``--count`` float32 on
distinct tags, two ranks of one process, all submitted before any wait;
prints when the first ones and then each tenth completed, and checks every
result (small integers: exact).  Past the shared staging's planned FIFOs
the tags loop through reserved minimum FIFOs (docs/architecture.md,
"Staging budget").

    python benchmarks/probes/queue_depth_probe.py --n 300 --count 2097152           # 8 MiB, cuda:0 twice
    python benchmarks/probes/queue_depth_probe.py --backend sim --n 64 --count 16384 --staging-bytes 1048576"""

from __future__ import annotations

import argparse
import time

import numpy as np

import dfccl
from dfccl.bench import arrays


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=("cuda", "sim"), default="cuda")
    p.add_argument("--devices", default=None, help="the two ranks' devices (default 0,0 on cuda, 7500,7500 on sim)")
    p.add_argument("--n", type=int, default=300, help="collectives per rank, each on its own tag")
    p.add_argument("--count", type=int, default=2 << 20, help="float32 elements each")
    p.add_argument("--path", default="ring", choices=("ring", "direct", "auto"))
    p.add_argument("--staging-bytes", type=int, default=None, help="each rank's staging (default: CommOptions')")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds each collective may take to complete")
    a = p.parse_args(argv)
    devices = [int(d) for d in (a.devices or ("0,0" if a.backend == "cuda" else "7500,7500")).split(",")]
    staging = {} if a.staging_bytes is None else {"staging_bytes": a.staging_bytes}
    comms = dfccl.Communicator.for_devices(devices, backend=a.backend,
                                           options=dfccl.CommOptions(path=a.path, max_tags=16384, **staging),
                                           daemon_options=dfccl.DaemonOptions(max_outstanding=65536))
    try:
        bufs = [[arrays.from_numpy(a.backend, d, np.full(a.count, r + 1 + i % 7, np.float32)) for i in range(a.n)]
                for r, d in enumerate(devices)]
        t0 = time.perf_counter()
        works = [[c.all_reduce(bufs[r][i], tag=("deep", a.count, i)) for i in range(a.n)] for r, c in enumerate(comms)]
        print(f"submitted {len(devices) * a.n} in {time.perf_counter() - t0:.2f} s", flush=True)
        for i in range(a.n):
            for ws in works:
                ws[i].synchronize(timeout=a.timeout)
            if i < 16 or (i + 1) % max(1, a.n // 10) == 0:
                print(f"  {i + 1:5d} done at {time.perf_counter() - t0:8.2f} s", flush=True)
        total = time.perf_counter() - t0
        wrong = sum(int(not (arrays.to_numpy(b) == 3 + 2 * (i % 7)).all()) for bs in bufs for i, b in enumerate(bs))
        print(f"n={a.n} count={a.count} path={a.path}: {total:.2f} s, {wrong} wrong", flush=True)
        return 1 if wrong else 0
    finally:
        for c in comms:
            c.close()


if __name__ == "__main__":
    raise SystemExit(main())
