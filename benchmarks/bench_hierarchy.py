"""Hierarchical all-reduce against the ring, in the same run: ranks in
separate processes on two "hosts" (DFCCL_HOST_ID) of this machine, several
on each, UCX over TCP on loopback between the hosts.  Every rank holds two
communicators of the same ranks: one whose all-reduces run hierarchically
(hierarchy_min_bytes=1: reduce-scatter within the host, all-reduce across
hosts, all-gather within the host) and one on the ring
(hierarchy_min_bytes=0); the two alternate batch by batch.

Per size: time per all-reduce back to back (`--iters` queued, then waited
for; the median of three batches per repeat), its bus bandwidth (2 (n-1)/n
x bytes / time) and the ring's time over the hierarchy's (above 1: the
hierarchy is faster).  Each side's result is checked once per size on fresh
random inputs, against a float64 sum, and every timed batch's (its calls
run in place on one buffer, which ends at n^calls x its start only if they
ran in order).  Times in us, bandwidths in MiB/s.

On one machine both "hosts" share the cores and the loopback device: the
figure says what the hierarchy saves in network bytes and proxy work, not
what it buys on a cluster (docs/multi-node.md).

    python benchmarks/bench_hierarchy.py [--ranks 4] [--sizes 1048576,4194304,16777216]
    python benchmarks/bench_hierarchy.py --backend cuda      # every rank on GPU 0: run under MPS

Needs the [net] extra (UCX).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support"))

import bench_net  # noqa: E402  (benchmarks/: UCX_ENV, run_ranks, batch_seconds)
from dfccl_support import suite  # noqa: E402

MIB = 1 << 20
SIDES = ("ring", "hierarchy")


def _rank(uids: dict, rank: int, nranks: int, backend: str, sizes: list[int], iters: int, warmup: int,
          repeats: int, options: dict, seed: int, results) -> None:
    try:
        os.environ.update(bench_net.UCX_ENV)
        per_host = nranks // 2
        os.environ["DFCCL_HOST_ID"] = f"bench-host-{rank // per_host}"
        import dfccl
        from dfccl.bench import arrays

        device = 4400 + rank if backend == "sim" else 0
        comms = {side: dfccl.Communicator(dfccl.UniqueId.from_string(uids[side]), rank, nranks, backend=backend,
                                          device=device, timeout=120,
                                          options=dfccl.CommOptions(hierarchy_min_bytes=int(side == "hierarchy"),
                                                                    **options))
                 for side in SIDES}
        assert comms["ring"].hierarchy is None and comms["hierarchy"].hierarchy.per_host == per_host
        rng = np.random.default_rng(seed)
        rows = []
        for size in sizes:
            count = size // 4 // per_host * per_host
            row = {"size": count * 4}
            for side, comm in comms.items():
                # Fresh random inputs, the same on every rank's generator.
                data = rng.standard_normal((nranks, count), dtype=np.float32)
                y = arrays.from_numpy(backend, device, data[rank])
                comm.all_reduce(y, tag=("check", size)).synchronize(timeout=120)
                want = data.astype(np.float64).sum(0)
                if not np.allclose(arrays.to_numpy(y), want, rtol=1e-5, atol=1e-5):
                    raise AssertionError(f"{side} all_reduce of {size} B: rank {rank} got a wrong sum")
            times = {side: [] for side in SIDES}
            calls = warmup + iters * bench_net.BATCHES
            for rep in range(repeats):
                for side in (SIDES if rep % 2 == 0 else SIDES[::-1]):
                    # The same fresh input on every rank, in place: each call
                    # multiplies it by n, so the batch's end shows that its
                    # calls ran in order (started small, to end in range).
                    x0 = rng.standard_normal(count).astype(np.float32) * np.float32(nranks ** -(calls // 2))
                    x = arrays.from_numpy(backend, device, x0)
                    comm = comms[side]
                    run = lambda comm=comm, x=x: comm.all_reduce(x, tag=("bw", size))  # noqa: E731
                    for _ in range(warmup):
                        run().synchronize(timeout=120)
                    times[side].append(bench_net.batch_seconds(run, iters))
                    want = x0.astype(np.float64) * float(nranks) ** calls
                    if not np.allclose(arrays.to_numpy(x), want, rtol=1e-3, atol=0):
                        raise AssertionError(f"{side}: {calls} all_reduces of {size} B in place on one buffer: rank "
                                             f"{rank} got other than {nranks}^{calls} x its input")
            runs_before = comms["hierarchy"].hierarchy.all_reduces
            for side in SIDES:
                t = sorted(times[side])
                row[f"{side}_us"] = [statistics.median(t) * 1e6, t[0] * 1e6, t[-1] * 1e6]
                row[f"{side}_busbw_mib_s"] = 2 * (nranks - 1) / nranks * count * 4 / statistics.median(t) / MIB
            row["ring_over_hierarchy"] = row["ring_us"][0] / row["hierarchy_us"][0]
            row["hierarchical_runs"] = runs_before
            rows.append(row)
        for comm in comms.values():
            comm.close()
        results.put((rank, "ok", {"rows": rows}))
    except BaseException as exc:
        import traceback

        results.put((rank, "error", f"{exc}\n{traceback.format_exc()}"))


def main(argv=None) -> int:
    p = suite.parser(__doc__.split("\n\n")[0], iters=10, warmup=2, placement=False)
    p.add_argument("--sizes", default="1048576,4194304,16777216,67108864")
    p.add_argument("--ranks", type=int, default=4, help="ranks, half on each host (default 4)")
    p.add_argument("--backend", choices=("sim", "cuda"), default="sim", help="where the ranks run (cuda: GPU 0)")
    p.add_argument("--repeats", type=int, default=3, help="batches of each side per size, alternating (default 3)")
    p.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                   help="a CommOptions field for both communicators (repeatable)")
    args = p.parse_args(argv)
    if args.ranks < 4 or args.ranks % 2:
        raise SystemExit("--ranks must be even and at least 4 (two hosts, two ranks or more on each)")
    sizes = [int(s) for s in args.sizes.split(",")]
    options = dict(bench_net._option(text) for text in args.option)
    import dfccl

    uids = {side: str(dfccl.UniqueId.create()) for side in SIDES}
    seed = args.seed if args.seed is not None else int(time.time())
    got = bench_net.run_ranks(_rank, lambda r: (uids, r, args.ranks, args.backend, sizes, args.iters, args.warmup,
                                                args.repeats, options, seed), nranks=args.ranks)
    rows = got[0]["rows"]
    for row in rows:
        print(json.dumps(row), flush=True)
    print(f"\n{args.ranks} ranks on 2 hosts; median (min-max) of {args.repeats} batches of {args.iters}, us")
    print(f"{'size':>10} {'ring':>24} {'hierarchy':>24} {'ring busbw':>11} {'hier busbw':>11} {'ring/hier':>10}")
    spread = lambda f: f"{f[0]:.0f} ({f[1]:.0f}-{f[2]:.0f})"  # noqa: E731
    for r in rows:
        print(f"{r['size']:>10} {spread(r['ring_us']):>24} {spread(r['hierarchy_us']):>24} "
              f"{r['ring_busbw_mib_s']:>11.0f} {r['hierarchy_busbw_mib_s']:>11.0f} {r['ring_over_hierarchy']:>10.2f}")
    devices = list(range(4400, 4400 + args.ranks)) if args.backend == "sim" else [0] * args.ranks
    rec = suite.record("hierarchy", args, args.backend, devices, {"rows": rows, "transport": "UCX tcp on lo"})
    print(f"record: {suite.write(args.out, rec)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
