"""Hierarchical collectives against the ring, in the same run: ranks in
separate processes on two "hosts" (DFCCL_HOST_ID) of this machine, several
on each, UCX over TCP on loopback between the hosts.  Every rank holds two
communicators of the same ranks: one whose collectives (`--kind`: an
all-reduce, a reduce-scatter or an all-gather) run hierarchically
(hierarchy_min_bytes=1; docs/multi-node.md, "Hierarchical collectives")
and one on the ring (hierarchy_min_bytes=0); the two alternate batch by
batch.  A size is the all-reduce's buffer, the reduce-scatter's input,
the all-gather's output.

Per size: time per collective back to back (`--iters` queued, then waited
for; the median of three batches per repeat), its bus bandwidth (2 (n-1)/n
x bytes / time for an all-reduce, (n-1)/n x bytes / time for the others)
and the ring's time over the hierarchy's (above 1: the hierarchy is
faster).  Each side's result is checked once per size on fresh random
inputs, against a float64 sum, and every timed batch's: an all-reduce
batch runs in place on one buffer, which ends at n^calls x its start only
if its calls ran in order; a reduce-scatter's or all-gather's batch ends at
the one call's result.  Times in us, bandwidths in MiB/s.

On one machine both "hosts" share the cores and the loopback device: the
figure says what the hierarchy saves in network bytes and proxy work, not
what it buys on a cluster (docs/multi-node.md).

    python benchmarks/bench_hierarchy.py [--ranks 4] [--sizes 1048576,4194304,16777216]
    python benchmarks/bench_hierarchy.py --backend cuda      # every rank on GPU 0: run under MPS
    python benchmarks/bench_hierarchy.py --kind reduce_scatter --sizes 16777216

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


def _batch(comm, kind: str, rank: int, nranks: int, count: int, x0: np.ndarray, backend: str, device: int):
    """(run, check) of a timed batch: ``run()`` submits one call, ``check(calls)``
    raises unless the buffers hold what ``calls`` calls leave."""
    from dfccl.bench import arrays

    if kind == "all_reduce":
        # In place: each call multiplies it by n (x0 starts small).
        x = arrays.from_numpy(backend, device, x0)
        def check(calls):
            want = x0.astype(np.float64) * float(nranks) ** calls
            if not np.allclose(arrays.to_numpy(x), want, rtol=1e-3, atol=0):
                raise AssertionError(f"{calls} all_reduces of {count * 4} B in place on one buffer: rank {rank} "
                                     f"got other than {nranks}^{calls} x its input")
        return (lambda: comm.all_reduce(x, tag=("bw", count))), check
    block = count // nranks
    if kind == "reduce_scatter":
        # Every rank's input is x0: block r of the result is n x x0's.
        x = arrays.from_numpy(backend, device, x0)
        y = arrays.empty(backend, device, block, np.float32, fill=np.nan)
        want = x0[rank * block:(rank + 1) * block].astype(np.float64) * nranks
        out = y
        run = lambda: comm.reduce_scatter(x, y, tag=("bw", count))  # noqa: E731
    else:
        # Rank q's block is (q + 1) x x0's first block.
        x = arrays.from_numpy(backend, device, x0[:block] * np.float32(rank + 1))
        out = arrays.empty(backend, device, block * nranks, np.float32, fill=np.nan)
        want = np.concatenate([x0[:block] * np.float32(q + 1) for q in range(nranks)]).astype(np.float64)
        run = lambda: comm.all_gather(x, out, tag=("bw", count))  # noqa: E731
    def check(calls):
        if not np.allclose(arrays.to_numpy(out), want, rtol=1e-5, atol=1e-5):
            raise AssertionError(f"{kind} of {count * 4} B: rank {rank} got a wrong result after {calls} calls")
    return run, check


def _rank(uids: dict, rank: int, nranks: int, backend: str, kind: str, sizes: list[int], iters: int, warmup: int,
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
        unit = per_host if kind == "all_reduce" else nranks   # an all-reduce's L pieces, the others' n blocks
        for size in sizes:
            count = size // 4 // unit * unit
            row = {"size": count * 4, "kind": kind}
            for side, comm in comms.items():
                if kind != "all_reduce":
                    continue   # checked with the batches
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
                    # The same fresh input on every rank (an all-reduce's
                    # starts small, to end in range after n^calls).
                    scale = nranks ** -(calls // 2) if kind == "all_reduce" else 1.0
                    x0 = rng.standard_normal(count).astype(np.float32) * np.float32(scale)
                    run, check = _batch(comms[side], kind, rank, nranks, count, x0, backend, device)
                    for _ in range(warmup):
                        run().synchronize(timeout=120)
                    times[side].append(bench_net.batch_seconds(run, iters))
                    try:
                        check(calls)
                    except AssertionError as exc:
                        raise AssertionError(f"{side}: {exc}") from None
            info = comms["hierarchy"].hierarchy
            runs_before = {"all_reduce": info.all_reduces, "reduce_scatter": info.reduce_scatters,
                           "all_gather": info.all_gathers}[kind]
            factor = 2 if kind == "all_reduce" else 1
            for side in SIDES:
                t = sorted(times[side])
                row[f"{side}_us"] = [statistics.median(t) * 1e6, t[0] * 1e6, t[-1] * 1e6]
                row[f"{side}_busbw_mib_s"] = factor * (nranks - 1) / nranks * count * 4 / statistics.median(t) / MIB
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
    p.add_argument("--kind", choices=("all_reduce", "reduce_scatter", "all_gather"), default="all_reduce")
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
    got = bench_net.run_ranks(_rank, lambda r: (uids, r, args.ranks, args.backend, args.kind, sizes, args.iters,
                                                args.warmup,
                                                args.repeats, options, seed), nranks=args.ranks)
    rows = got[0]["rows"]
    for row in rows:
        print(json.dumps(row), flush=True)
    print(f"\n{args.kind}, {args.ranks} ranks on 2 hosts; median (min-max) of {args.repeats} batches of "
          f"{args.iters}, us")
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
