"""Where a hierarchical all-reduce's time goes: ranks in separate processes
on two "hosts" (DFCCL_HOST_ID), several on each, UCX over TCP on loopback.
Per size, back to back (``--iters`` queued, then waited for; the median of
``--batches``), in the same processes: each part alone on communicators
split the way the hierarchy splits (the reduce-scatter within the host,
the all-reduce of a piece across hosts, the all-gather within the host),
the whole hierarchical all-reduce, and the ring's; then one hierarchical
all-reduce waited for on its own, with its Work's stats (preemptions,
queued, running and wall time of the last part, and each part's under
``parts``).  Prints one JSON line per
size and a table of medians.

    python benchmarks/probes/hierarchy_probe.py --backend cuda --sizes 4194304,16777216
    python benchmarks/probes/hierarchy_probe.py --iters 2 --batches 1 --sizes 262144   # checks the script
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench_net  # noqa: E402  (benchmarks/: UCX_ENV, run_ranks, batch_seconds)

STEPS = ("reduce_scatter_local", "all_reduce_cross", "all_gather_local", "hierarchical", "ring")


def _rank(uids: dict, rank: int, nranks: int, backend: str, sizes: list[int], iters: int, batches: int,
          results) -> None:
    try:
        os.environ.update(bench_net.UCX_ENV)
        per_host = nranks // 2
        os.environ["DFCCL_HOST_ID"] = f"probe-host-{rank // per_host}"
        import dfccl
        from dfccl.bench import arrays

        device = 4500 + rank if backend == "sim" else 0

        def comm_of(side, min_bytes):
            return dfccl.Communicator(dfccl.UniqueId.from_string(uids[side]), rank, nranks, backend=backend,
                                      device=device, timeout=120,
                                      options=dfccl.CommOptions(hierarchy_min_bytes=min_bytes))
        hier, ring = comm_of("hierarchy", 1), comm_of("ring", 0)
        local = ring.split(rank // per_host)      # as the hierarchy splits: by host, ranked by rank
        cross = ring.split(rank % per_host)       # ... and by place on the host
        rows = []
        rng = np.random.default_rng(7)
        for size in sizes:
            count = size // 4 // per_host * per_host
            piece = count // per_host
            x = arrays.from_numpy(backend, device, rng.standard_normal(count, dtype=np.float32))
            mine = arrays.empty(backend, device, piece, np.float32, fill=0)
            steps = {
                "reduce_scatter_local": lambda: local.reduce_scatter(x, mine, tag=("rs", size)),
                "all_reduce_cross": lambda: cross.all_reduce(mine, tag=("ar", size)),
                "all_gather_local": lambda: local.all_gather(mine, x, tag=("ag", size)),
                "hierarchical": lambda: hier.all_reduce(x, tag=("h", size)),
                "ring": lambda: ring.all_reduce(x, tag=("r", size)),
            }
            row = {"size": count * 4}
            for name in STEPS:
                steps[name]().synchronize(timeout=120)   # warm-up
                row[f"{name}_us"] = bench_net.batch_seconds(steps[name], iters, batches) * 1e6
            one = hier.all_reduce(x, tag=("one", size))
            one.synchronize(timeout=120)
            row["one_waited"] = one.stats
            rows.append(row)
        for c in (cross, local, ring, hier):
            c.close()
        results.put((rank, "ok", {"rows": rows}))
    except BaseException as exc:
        import traceback

        results.put((rank, "error", f"{exc}\n{traceback.format_exc()}"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="4194304,16777216")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--backend", choices=("sim", "cuda"), default="sim")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--batches", type=int, default=3)
    a = p.parse_args(argv)
    import dfccl

    uids = {side: str(dfccl.UniqueId.create()) for side in ("hierarchy", "ring")}
    sizes = [int(s) for s in a.sizes.split(",")]
    got = bench_net.run_ranks(_rank, lambda r: (uids, r, a.ranks, a.backend, sizes, a.iters, a.batches),
                              nranks=a.ranks)
    for r in range(a.ranks):
        for row in got[r]["rows"]:
            print(json.dumps(dict(row, rank=r)), flush=True)
    print(f"\nrank 0, us per collective back to back (median of {a.batches} batches of {a.iters})")
    print(f"{'size':>10} " + " ".join(f"{s:>22}" for s in STEPS))
    for row in got[0]["rows"]:
        print(f"{row['size']:>10} " + " ".join(f"{row[f'{s}_us']:>22.0f}" for s in STEPS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
