"""Throughput of the network path against UCX's own: two ranks in separate
processes on "different hosts" (DFCCL_HOST_ID) of this machine, UCX over
TCP on loopback, against `ucx_perftest -t tag_bw` between two processes of
the same machine, same transport, same message sizes.

dfccl's number is a broadcast from rank 0 (each byte crosses the network
once, one way, as in tag_bw): bytes / time per collective, back to back
(`--iters` instances of one tag queued, then waited for: the median of
three such batches), as tag_bw streams its messages.
Its time per call, and the all-reduce's bus bandwidth (2 (n-1)/n x bytes
/ time) and time per call (its result checked once on fresh inputs), are
recorded beside it.  Up to ll_max_bytes both take LL, whose lines the proxy
carries (`--option protocol=simple` keeps them on the ring).  Bandwidths in
MiB/s (ucx_perftest's MB/s are MiB/s), times in us.

ucx_perftest runs twice per size: with UCX's defaults (the reference a
user's own tools see) and with the settings dfccl's proxy gives UCX
(`dfccl.net.link.ucx_settings`: larger TCP segments), which show what
UCX itself reaches with them.

    python benchmarks/bench_net.py [--sizes 65536,1048576,4194304] [--iters 20]
    python benchmarks/bench_net.py --iters 3 --warmup 1 --sizes 65536 --perftest-iters 20   # checks the script

    python benchmarks/bench_net.py --backend cuda      # both ranks on GPU 0 (two processes: run under MPS)

Needs the [net] extra (UCX).  The ranks run on the simulator, or with
``--backend cuda`` on GPU 0, each in its own process (share the GPU through
MPS); it places them itself.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import re
import statistics
import subprocess
import sys
import time

import numpy as np

# The benchmarks' shared helpers (dfccl_support) live in support/, beside the package.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support"))

from dfccl_support import suite

#: UCX over TCP on loopback, for both sides of the comparison.
UCX_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}
MIB = 1 << 20
#: Timed batches per size and collective (their median is the figure).
BATCHES = 3


def _rank(uid: str, rank: int, backend: str, sizes: list[int], iters: int, warmup: int, options: dict,
          seed: int, results) -> None:
    try:
        os.environ.update(UCX_ENV)
        os.environ["DFCCL_HOST_ID"] = f"bench-host-{rank}"
        import dfccl
        from dfccl.bench import arrays

        comm = dfccl.Communicator(dfccl.UniqueId.from_string(uid), rank, 2, backend=backend,
                                  device=_devices(backend)[rank], options=dfccl.CommOptions(**options), timeout=120)
        assert comm.transports[1 - rank] == "ucx", comm.transports
        rows = []
        rng = np.random.default_rng(seed)
        for size in sizes:
            count = size // 4
            # Fresh random data; rank 0's is what the broadcast must deliver.
            data = rng.standard_normal((2, count), dtype=np.float32)
            x = arrays.from_numpy(backend, comm.device, data[rank])
            row = {"size": size}
            # The all-reduce's result, checked once on fresh inputs (two
            # ranks: one addition, the same bits in either order).
            y = arrays.from_numpy(backend, comm.device, data[rank])
            comm.all_reduce(y, tag=("check", size)).synchronize(timeout=120)
            if not np.array_equal(arrays.to_numpy(y), data[0] + data[1]):
                raise AssertionError(f"all_reduce of {size} B: rank {rank} got a wrong sum")
            for kind in ("broadcast", "all_reduce"):
                run = (lambda: comm.broadcast(x, root=0, tag=("bw", kind, size))) if kind == "broadcast" \
                    else (lambda: comm.all_reduce(x, tag=("bw", kind, size)))
                for _ in range(warmup):
                    run().synchronize(timeout=120)
                row[f"{kind}_s"] = batch_seconds(run, iters)
                if kind == "broadcast" and not np.array_equal(arrays.to_numpy(x), data[0]):
                    raise AssertionError(f"broadcast of {size} B: rank {rank} did not receive rank 0's data")
            row["broadcast_mib_s"] = size / row["broadcast_s"] / MIB
            row["broadcast_us"] = row["broadcast_s"] * 1e6
            row["all_reduce_busbw_mib_s"] = size / row["all_reduce_s"] / MIB   # 2 (n-1)/n = 1 for two ranks
            row["all_reduce_us"] = row["all_reduce_s"] * 1e6
            rows.append(row)
        comm.close()
        results.put((rank, "ok", {"rows": rows}))
    except BaseException as exc:
        import traceback

        results.put((rank, "error", f"{exc}\n{traceback.format_exc()}"))


def batch_seconds(submit, iters: int, batches: int = BATCHES) -> float:
    """Seconds per collective back to back, as ucx_perftest streams its
    messages: ``iters`` of ``submit()`` queued, then waited for; the median
    of ``batches`` such batches."""
    times = []
    for _ in range(batches):
        t0 = time.perf_counter()
        works = [submit() for _ in range(iters)]
        for w in works:
            w.synchronize(timeout=120)
        times.append((time.perf_counter() - t0) / iters)
    return statistics.median(times)


def _devices(backend: str) -> list[int]:
    return [4300, 4301] if backend == "sim" else [0, 0]


def run_ranks(target, args_of, timeout: float = 1800.0, nranks: int = 2) -> dict:
    """Runs ``target(*args_of(rank), results)`` for ranks 0 .. nranks - 1,
    each in a spawned process that puts ``(rank, "ok", info)`` or ``(rank,
    "error", text)`` on ``results``.

    Args:
        timeout: seconds the ranks get to report; after them, or after
            an error, the ranks still running are killed.
        nranks: how many.

    Returns:
        Each rank's ``info`` by rank.

    Raises:
        RuntimeError: a rank's error, or the ranks that did not report in
            time.
    """
    mp_context = mp.get_context("spawn")
    results = mp_context.Queue()
    procs = [mp_context.Process(target=target, args=(*args_of(r), results)) for r in range(nranks)]
    for p in procs:
        p.start()
    got = {}
    deadline = time.monotonic() + timeout
    try:
        for _ in procs:
            try:
                rank, what, info = results.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                missing = sorted(set(range(nranks)) - set(got))
                raise RuntimeError(f"rank(s) {missing} did not report within {timeout:g} s (killed)") from None
            if what != "ok":
                raise RuntimeError(f"rank {rank}: {info}")
            got[rank] = info
    finally:
        # A rank that stalls must not hold up this process's exit (spawned
        # children are joined at exit).
        for p in procs:
            p.join(timeout=30 if len(got) == len(procs) else 5)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    return got


def run_dfccl(backend: str, sizes: list[int], iters: int, warmup: int, options: dict, seed: int) -> list[dict]:
    import dfccl

    uid = str(dfccl.UniqueId.create())
    got = run_ranks(_rank, lambda r: (uid, r, backend, sizes, iters, warmup, options, seed))
    return got[0]["rows"]


def run_perftest(size: int, iters: int, proxy_settings: bool = False) -> float | None:
    """ucx_perftest tag_bw between two processes of this machine: MiB/s
    (None when it cannot run); with ``proxy_settings``, under the UCX
    settings dfccl's proxy uses."""
    from dfccl.net._build import ucx_root
    from dfccl.net.link import ucx_settings

    root = ucx_root()
    tool = root / "bin" / "ucx_perftest"
    env = dict(os.environ, **UCX_ENV)
    if proxy_settings:
        env.update({f"UCX_{name}": value for name, value, _ in ucx_settings()})
    libs = [str(root / "lib")] + [str(p) for p in root.parent.glob("libucx_*.libs")]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(libs + [env.get("LD_LIBRARY_PATH", "")])
    port = str(13337 + os.getpid() % 1000)
    cmd = [str(tool), "-t", "tag_bw", "-s", str(size), "-n", str(iters), "-p", port]
    server = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(1.0)
        client = subprocess.run(cmd + ["127.0.0.1"], env=env, capture_output=True, text=True, timeout=600)
    finally:
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
    final = [line for line in client.stdout.splitlines() if line.startswith("Final:")]
    if not final:
        print(f"ucx_perftest failed for {size} B:\n{client.stdout}{client.stderr}", file=sys.stderr)
        return None
    fields = re.split(r"\s+", final[-1].strip())
    return float(fields[6])    # overall bandwidth, MB/s (2^20 bytes)


def _option(text: str) -> tuple[str, int | str]:
    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise SystemExit(f"--option wants NAME=VALUE (a CommOptions field), not {text!r}")
    try:
        return name.strip(), int(value, 0)
    except ValueError:
        return name.strip(), value.strip()


def _summarize(size: int, rows: list[dict]) -> dict:
    """Median, min and max of each figure over the repeats of one size,
    and the broadcast's median over ucx_perftest's."""
    out = {"size": size}
    for key in ("broadcast_mib_s", "broadcast_us", "all_reduce_busbw_mib_s", "all_reduce_us", "ucx_perftest_mib_s",
                "ucx_perftest_same_mib_s"):
        values = [r[key] for r in rows if r.get(key)]
        out[key] = [statistics.median(values), min(values), max(values)] if values else None
    for ratio, key in (("broadcast_vs_perftest", "ucx_perftest_mib_s"),
                       ("broadcast_vs_perftest_same", "ucx_perftest_same_mib_s")):
        ref = out[key]
        out[ratio] = out["broadcast_mib_s"][0] / ref[0] if ref else None
    return out


def _spread(fig) -> str:
    return f"{fig[0]:.0f} ({fig[1]:.0f}-{fig[2]:.0f})" if fig else "-"


def main(argv=None) -> int:
    p = suite.parser(__doc__.split("\n\n")[0], iters=20, warmup=2, placement=False)
    p.add_argument("--sizes", default="65536,1048576,4194304,16777216")
    p.add_argument("--backend", choices=("sim", "cuda"), default="sim", help="where the ranks run (cuda: GPU 0)")
    p.add_argument("--perftest-iters", type=int, default=200, help="ucx_perftest iterations per size")
    p.add_argument("--repeats", type=int, default=3, help="runs of each side, alternating (default 3)")
    p.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                   help="a CommOptions field for both ranks, e.g. channels=1, max_slice_bytes=1048576 or "
                        "protocol=simple (repeatable)")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    options = dict(_option(text) for text in args.option)
    # The reference is as noisy as dfccl (TCP on loopback shares the cores):
    # the two alternate, --repeats times, and the ratio is of the medians.
    runs = []
    for rep in range(args.repeats):
        seed = (args.seed if args.seed is not None else int(time.time())) + rep
        rows = run_dfccl(args.backend, sizes, args.iters, args.warmup, options, seed)
        for row in rows:
            row["ucx_perftest_mib_s"] = run_perftest(row["size"], args.perftest_iters)
            row["ucx_perftest_same_mib_s"] = run_perftest(row["size"], args.perftest_iters, proxy_settings=True)
            print(json.dumps(dict(row, repeat=rep)), flush=True)
        runs.append(rows)
    summary = [_summarize(size, [rows[i] for rows in runs]) for i, size in enumerate(sizes)]
    print(f"\nmedian (min-max) of {args.repeats} run(s), MiB/s; ucx_perftest with UCX's defaults, then with "
          "the proxy's UCX settings")
    print(f"{'size':>10} {'broadcast':>20} {'broadcast us':>20} {'all-reduce busbw':>20} {'all-reduce us':>20} "
          f"{'ucx_perftest':>20} {'bcast/perftest':>15} {'perftest, same':>20} {'bcast/same':>11}")
    ratio = lambda v: f"{v:.2f}" if v else "-"  # noqa: E731
    for r in summary:
        print(f"{r['size']:>10} {_spread(r['broadcast_mib_s']):>20} {_spread(r['broadcast_us']):>20} "
              f"{_spread(r['all_reduce_busbw_mib_s']):>20} "
              f"{_spread(r['all_reduce_us']):>20} {_spread(r['ucx_perftest_mib_s']):>20} "
              f"{ratio(r['broadcast_vs_perftest']):>15} {_spread(r['ucx_perftest_same_mib_s']):>20} "
              f"{ratio(r['broadcast_vs_perftest_same']):>11}")
    rec = suite.record("net", args, args.backend, _devices(args.backend), {"runs": runs, "summary": summary,
                                                                                 "transport": "UCX tcp on lo"})
    print(f"record: {suite.write(args.out, rec)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
