"""Throughput of the network path against UCX's own: two ranks in separate
processes on "different hosts" (DFCCL_HOST_ID) of this machine, UCX over
TCP on loopback, against `ucx_perftest -t tag_bw` between two processes of
the same machine, same transport, same message sizes.

dfccl's number is a broadcast from rank 0 (each byte crosses the network
once, one way, as in tag_bw): bytes / time per collective, back to back.
The all-reduce's bus bandwidth (2 (n-1)/n x bytes / time) is recorded
beside it.  Both in MiB/s (ucx_perftest's MB/s are MiB/s).

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


def _rank(uid: str, rank: int, backend: str, sizes: list[int], iters: int, warmup: int, options: dict,
          results) -> None:
    try:
        os.environ.update(UCX_ENV)
        os.environ["DFCCL_HOST_ID"] = f"bench-host-{rank}"
        import dfccl
        from dfccl.bench import arrays

        comm = dfccl.Communicator(dfccl.UniqueId.from_string(uid), rank, 2, backend=backend,
                                  device=_devices(backend)[rank], options=dfccl.CommOptions(**options), timeout=120)
        assert comm.transports[1 - rank] == "ucx", comm.transports
        rows = []
        for size in sizes:
            count = size // 4
            x = arrays.from_numpy(backend, comm.device, np.full(count, rank + 1, np.float32))
            row = {"size": size}
            for kind in ("broadcast", "all_reduce"):
                run = (lambda: comm.broadcast(x, root=0, tag=("bw", kind, size))) if kind == "broadcast" \
                    else (lambda: comm.all_reduce(x, tag=("bw", kind, size)))
                for _ in range(warmup):
                    run().synchronize(timeout=120)
                times = []
                for _ in range(iters):
                    t0 = time.perf_counter()
                    run().synchronize(timeout=120)
                    times.append(time.perf_counter() - t0)
                row[f"{kind}_s"] = statistics.median(times)
            row["broadcast_mib_s"] = size / row["broadcast_s"] / MIB
            row["all_reduce_busbw_mib_s"] = size / row["all_reduce_s"] / MIB   # 2 (n-1)/n = 1 for two ranks
            rows.append(row)
        comm.close()
        results.put((rank, "ok", {"rows": rows}))
    except BaseException as exc:
        import traceback

        results.put((rank, "error", f"{exc}\n{traceback.format_exc()}"))


def _devices(backend: str) -> list[int]:
    return [4300, 4301] if backend == "sim" else [0, 0]


def run_dfccl(backend: str, sizes: list[int], iters: int, warmup: int, options: dict) -> list[dict]:
    import dfccl

    uid = dfccl.UniqueId.create()
    mp_context = mp.get_context("spawn")
    results = mp_context.Queue()
    procs = [mp_context.Process(target=_rank, args=(str(uid), r, backend, sizes, iters, warmup, options, results))
             for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in procs:
            rank, what, info = results.get(timeout=1800)
            if what != "ok":
                raise RuntimeError(f"rank {rank}: {info}")
            got[rank] = info
    finally:
        for p in procs:
            p.join(timeout=30)
    return got[0]["rows"]


def run_perftest(size: int, iters: int) -> float | None:
    """ucx_perftest tag_bw between two processes of this machine: MiB/s
    (None when it cannot run)."""
    from dfccl.net._build import ucx_root

    root = ucx_root()
    tool = root / "bin" / "ucx_perftest"
    env = dict(os.environ, **UCX_ENV)
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


def main(argv=None) -> int:
    p = suite.parser(__doc__.split("\n\n")[0], iters=20, warmup=2, placement=False)
    p.add_argument("--sizes", default="65536,1048576,4194304,16777216")
    p.add_argument("--backend", choices=("sim", "cuda"), default="sim", help="where the ranks run (cuda: GPU 0)")
    p.add_argument("--perftest-iters", type=int, default=200, help="ucx_perftest iterations per size")
    p.add_argument("--max-slice-bytes", type=int, default=None, help="CommOptions.max_slice_bytes (default: its own)")
    p.add_argument("--ring-slots", type=int, default=None, help="CommOptions.ring_slots (default: its own)")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    options = {k: v for k, v in (("max_slice_bytes", args.max_slice_bytes), ("ring_slots", args.ring_slots))
               if v is not None}
    rows = run_dfccl(args.backend, sizes, args.iters, args.warmup, options)
    for row in rows:
        row["ucx_perftest_mib_s"] = run_perftest(row["size"], args.perftest_iters)
        ref = row["ucx_perftest_mib_s"]
        row["broadcast_vs_perftest"] = row["broadcast_mib_s"] / ref if ref else None
        print(json.dumps(row))
    print(f"\n{'size':>10} {'bcast MiB/s':>12} {'allred busbw':>13} {'perftest MiB/s':>15} {'bcast/perftest':>15}")
    for r in rows:
        ratio = f"{r['broadcast_vs_perftest']:.2f}" if r["broadcast_vs_perftest"] else "-"
        ref = f"{r['ucx_perftest_mib_s']:.0f}" if r["ucx_perftest_mib_s"] else "-"
        print(f"{r['size']:>10} {r['broadcast_mib_s']:12.0f} {r['all_reduce_busbw_mib_s']:13.0f} {ref:>15} "
              f"{ratio:>15}")
    rec = suite.record("net", args, args.backend, _devices(args.backend), {"rows": rows, "transport": "UCX tcp on lo"})
    print(f"record: {suite.write(args.out, rec)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
