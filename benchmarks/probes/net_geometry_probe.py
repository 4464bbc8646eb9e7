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

``--image`` alternates daemon images (``DFCCL_DAEMON_IMAGE``; ``installed``
names the installed one, ``docs/profiling.md`` section 2): each round runs
each image in a pair of processes of its own.  ``--trace DIR`` keeps the
proxies' hop trace of every run (``DFCCL_NET_TRACE``, one size at a time)
and prints the hop split per image: the median over the runs of each
figure's median (``python -m dfccl.net.hops``).  Together they are the
A/B of a daemon change across hosts:

    python benchmarks/probes/net_geometry_probe.py --backend cuda --sizes 4096 --iters 20 \
        --image installed --image /tmp/daemon-before.fatbin --trace /tmp/hops

On a GPU each row also carries both ranks' daemon profile over the batch,
per instance (``dfccl_support.profile``): scheduler passes, runs (more than
one per channel means the collective was preempted while it waited for the
other host) and the microseconds in each part of the scheduler's loop.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench_net  # noqa: E402  (benchmarks/: UCX_ENV, run_ranks, batch_seconds, run_perftest)

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


@contextlib.contextmanager
def _environment(**values):
    """These variables set (None: unset) while the ranks are spawned."""
    def put(settings: dict) -> None:
        for k, v in settings.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    before = {k: os.environ.get(k) for k in values}
    try:
        put(values)
        yield
    finally:
        put(before)


# The hop kinds the table shows (dfccl.net.hops: a credit is a word alone).
_HOP_KINDS = ("slice", "word", "record")


def _median_of(st: dict) -> float | None:
    return st["median_us"] if st["n"] else None


def _held_percent(sm: dict) -> float | None:
    """Of the slices sent, the share that went out right after a long call
    of the sending proxy into UCX (dfccl.net.hops), %."""
    calls = [r for r in sm["calls"] if r["share"] is not None]
    slices = sum(r["slices"] for r in calls)
    return 100.0 * sum(r["held"] for r in calls) / slices if slices else None


def _hop_table(trace_dirs: list[str], names: list[str]) -> None:
    """Per image, the median over its runs (communicators) of each hop
    figure's median (us), and of the share of slices a long call into UCX
    held back (%)."""
    from dfccl.net import hops
    from dfccl.net.hop_trace import load_traces

    rows = [(f"{kind} hop", lambda sm, k=kind: _median_of(sm["hops"].get(k, {"n": 0}))) for kind in _HOP_KINDS]
    rows += [(label, lambda sm, k=key: _median_of(sm[k]))
             for key, label in hops.TURNAROUNDS + hops.RECORD_SPLIT + hops.PROXY_CALLS]
    rows += [("slices held by a long call, %", _held_percent)]
    columns = []
    for directory in trace_dirs:
        summaries = [hops.summarize(traces) for traces in load_traces(directory).values()]
        column = {}
        for label, figure in rows:
            vals = [v for v in (figure(sm) for sm in summaries) if v is not None]
            column[label] = (statistics.median(vals), len(vals)) if vals else None
        columns.append(column)
    print("\nhop split per image: median over the runs of each median, us (runs)")
    print(f"{'':<34}" + "".join(f"{n[-24:]:>26}" for n in names))
    for label, _ in rows:
        cells = [f"{c[label][0]:>20.1f} ({c[label][1]:>2})" if c[label] else f"{'-':>26}" for c in columns]
        print(f"{label:<34}" + "".join(cells))


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
    p.add_argument("--image", action="append", default=[], metavar="PATH",
                   help="a daemon image (DFCCL_DAEMON_IMAGE), or 'installed' (repeatable: alternated)")
    p.add_argument("--trace", metavar="DIR", help="keep the hop trace under DIR and print the split per image")
    a = p.parse_args(argv)
    config_texts = a.config or ["default"]
    configs = [_config(t) for t in config_texts]
    sizes = [int(s) for s in a.sizes.split(",")]
    depths = [int(s) for s in a.iters.split(",")]
    if a.trace and len(sizes) > 1:
        p.error("--trace takes one size at a time (the hop split matches slices and credits within one tag)")
    images = a.image or ["installed"]
    for image in images:
        if image != "installed" and not os.path.isfile(image):
            p.error(f"--image {image}: no such file")
    # A variant is an image and a geometry; its label names the image only
    # where there are several.
    variants = [(ii, ci) for ii in range(len(images)) for ci in range(len(configs))]
    texts = [(f"{os.path.basename(images[ii])} " if len(images) > 1 else "") + config_texts[ci]
             for ii, ci in variants]
    trace_dirs = [os.path.join(a.trace, f"image{ii}") for ii in range(len(images))] if a.trace else []
    import dfccl

    # One image: every round in the same two processes.  Several: each
    # round runs each image in a pair of its own (an image is loaded once
    # per process).
    pairs = [(None, 0)] if len(images) == 1 else [(rnd, ii) for rnd in range(a.rounds) for ii in range(len(images))]
    rows = []
    for rnd, ii in pairs:
        rounds = a.rounds if rnd is None else 1
        uids = [str(dfccl.UniqueId.create()) for _ in range(rounds * len(configs))]
        env = {"DFCCL_DAEMON_IMAGE": None if images[ii] == "installed" else os.path.abspath(images[ii])}
        if a.trace:
            env["DFCCL_NET_TRACE"] = trace_dirs[ii]
        with _environment(**env):
            got = bench_net.run_ranks(_rank, lambda r: (uids, r, a.backend, configs, sizes, depths, a.warmup,
                                                            rounds))
        for row, other in zip(got[0], got[1]):  # the ranks ran the same rows in the same order
            if "daemon" in other:
                row["daemon_rank1"] = other["daemon"]
            if rnd is not None:
                row["round"] = rnd
            row["config"] = variants.index((ii, row["config"]))
            rows.append(row)
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
    if trace_dirs:
        _hop_table(trace_dirs, [os.path.basename(i) for i in images])
    return 0


if __name__ == "__main__":
    sys.exit(main())
