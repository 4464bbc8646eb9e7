"""Which ring geometry streams best across "hosts", and how the queue's
depth weighs: a broadcast from rank 0 back to back (``--iters`` instances
of one tag queued, then waited for; a list of depths gives a row each),
two ranks in separate processes with different ``DFCCL_HOST_ID``s, UCX over
TCP on loopback, for each geometry named by ``--config`` (CommOptions
fields), the geometries alternated in ``--rounds`` rounds within the same
two processes (a fresh communicator each time), then ``ucx_perftest -t
tag_bw`` at each size ``--perftest-runs`` times.  Prints one JSON line per
measurement and a table of medians (min-max).

    python benchmarks/probes/net_geometry_probe.py --backend cuda --sizes 1048576 \\
        --config default --config max_slice_bytes=262144 --config bytes_per_channel=524288,max_slice_bytes=262144
    python benchmarks/probes/net_geometry_probe.py --backend cuda --sizes 1048576 --iters 1,4,10,40
    python benchmarks/probes/net_geometry_probe.py --iters 4 --rounds 1 --perftest-runs 1   # checks the script

On a GPU each row also carries both ranks' daemon profile over the batch,
per instance (``dfccl_support.profile``): scheduler passes, runs (more than
one per channel means the collective was preempted while it waited for the
other host) and the microseconds in each part of the scheduler's loop.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench_net  # noqa: E402  (benchmarks/: UCX_ENV, run_two_ranks, batch_seconds, run_perftest)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support"))
from dfccl_support.profile import profile_delta  # noqa: E402

# The daemon profile's fields a row keeps (per instance).
_PROFILE_KEYS = ("passes", "runs", "pull_us", "pick_us", "restore_us", "run_us", "save_us", "idle_us")


def _config(text: str) -> dict:
    if text == "default":
        return {}
    return dict(bench_net._option(part) for part in text.split(","))


def _rank(uids: list[str], rank: int, backend: str, configs: list[dict], sizes: list[int], depths: list[int],
          warmup: int, rounds: int, results) -> None:
    try:
        os.environ.update(bench_net.UCX_ENV)
        os.environ["DFCCL_HOST_ID"] = f"probe-host-{rank}"
        import dfccl
        from dfccl.bench import arrays

        rng = np.random.default_rng(1234)
        rows = []
        k = 0
        for rnd in range(rounds):
            for ci, options in enumerate(configs):
                comm = dfccl.Communicator(dfccl.UniqueId.from_string(uids[k]), rank, 2, backend=backend,
                                          device=bench_net._devices(backend)[rank],
                                          options=dfccl.CommOptions(**options), timeout=120)
                k += 1
                for size in sizes:
                    data = rng.standard_normal((2, size // 4), dtype=np.float32)
                    x = arrays.from_numpy(backend, comm.device, data[rank])
                    tag = ("geometry", size)
                    for _ in range(warmup):
                        comm.broadcast(x, root=0, tag=tag).synchronize(timeout=120)
                    for iters in depths:
                        before = comm._daemon.daemon_profile() if backend == "cuda" else None
                        seconds = bench_net.batch_seconds(lambda: comm.broadcast(x, root=0, tag=tag), iters)
                        row = {"round": rnd, "config": ci, "size": size, "iters": iters,
                               "broadcast_mib_s": size / seconds / bench_net.MIB}
                        if before is not None:
                            busy = profile_delta(before, comm._daemon.daemon_profile(),
                                                 per=iters * bench_net.BATCHES)
                            row["daemon"] = {k: round(busy[k], 2) for k in _PROFILE_KEYS}
                            row["daemon"]["blocks"] = len(busy["blocks"])
                        rows.append(row)
                    if not np.array_equal(arrays.to_numpy(x), data[0]):
                        raise AssertionError(f"config {options}, {size} B: rank {rank} did not get rank 0's data")
                comm.close()
        results.put((rank, "ok", rows))
    except BaseException as exc:
        import traceback

        results.put((rank, "error", f"{exc}\n{traceback.format_exc()}"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=("sim", "cuda"), default="sim")
    p.add_argument("--sizes", default="1048576")
    p.add_argument("--config", action="append", default=[], metavar="NAME=INT[,NAME=INT]",
                   help="a geometry (CommOptions fields), or 'default' (repeatable)")
    p.add_argument("--iters", default="40",
                   help="instances per timed batch; several (comma-separated) give a row each, from one start-up")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--perftest-iters", type=int, default=200)
    p.add_argument("--perftest-runs", type=int, default=3)
    a = p.parse_args(argv)
    texts = a.config or ["default"]
    configs = [_config(t) for t in texts]
    sizes = [int(s) for s in a.sizes.split(",")]
    depths = [int(s) for s in a.iters.split(",")]
    import dfccl

    uids = [str(dfccl.UniqueId.create()) for _ in range(a.rounds * len(configs))]
    got = bench_net.run_two_ranks(_rank, lambda r: (uids, r, a.backend, configs, sizes, depths, a.warmup, a.rounds))
    rows = got[0]
    for row, other in zip(rows, got[1]):  # the ranks ran the same rows in the same order
        if "daemon" in other:
            row["daemon_rank1"] = other["daemon"]
        print(json.dumps(dict(row, config=texts[row["config"]])), flush=True)
    perftest = {size: [] for size in sizes}
    for _ in range(a.perftest_runs):
        for size in sizes:
            mib_s = bench_net.run_perftest(size, a.perftest_iters)
            if mib_s is not None:
                perftest[size].append(mib_s)
                print(json.dumps({"size": size, "ucx_perftest_mib_s": mib_s}), flush=True)
    print(f"\nbroadcast MiB/s, median (min-max) of {a.rounds} round(s); ratio to ucx_perftest's median")
    for size in sizes:
        ref = statistics.median(perftest[size]) if perftest[size] else None
        if ref:
            print(f"{size:>10} ucx_perftest {ref:.0f} ({min(perftest[size]):.0f}-{max(perftest[size]):.0f})")
        for ci, text in enumerate(texts):
            for iters in depths:
                vals = [r["broadcast_mib_s"] for r in rows
                        if r["config"] == ci and r["size"] == size and r["iters"] == iters]
                med = statistics.median(vals)
                ratio = f"{med / ref:.2f}" if ref else "-"
                print(f"{size:>10} {text:<48} {iters:>4} {med:7.0f} ({min(vals):.0f}-{max(vals):.0f})  {ratio}")
    if any("daemon" in r for r in rows):
        print("\ndaemon profile per instance, median of the rounds: rank 0 (sends) / rank 1 (receives)")
        print(f"{'size':>10} {'config':<24} {'iters':>5} " + " ".join(f"{k:>15}" for k in _PROFILE_KEYS))
        for size in sizes:
            for ci, text in enumerate(texts):
                for iters in depths:
                    mine = [r for r in rows if r["config"] == ci and r["size"] == size and r["iters"] == iters]
                    cells = [f"{statistics.median(r['daemon'][k] for r in mine):7.1f}/"
                             f"{statistics.median(r['daemon_rank1'][k] for r in mine):<7.1f}" for k in _PROFILE_KEYS]
                    print(f"{size:>10} {text[:24]:<24} {iters:>5} " + " ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
