"""One process per GPU, dfccl against NCCL in the same processes on the same
tensors: NCCL through torch.distributed (one process per GPU, as frameworks
run it), dfccl through a Communicator built from a UniqueId.

Per size (float32 all_reduce, sum): back-to-back time (``iters`` submissions,
one synchronisation at the end, divided by ``iters``) and the latency of one
collective waited for (submit, wait, repeat; median).  Every size is checked
on fresh random inputs with a poisoned output first.  Rank 0 prints the table
and writes JSON.

    python benchmarks/bench_processes.py [--max 512M] [--nprocs 2]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import time

import multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_collectives import fmt_size, parse_size  # noqa: E402


def _time_b2b(submit, finish, iters):
    for _ in range(5):
        submit()
    finish()
    t0 = time.perf_counter()
    for _ in range(iters):
        submit()
    finish()
    return (time.perf_counter() - t0) / iters


def _worker(rank, nprocs, uid, port, sizes, iters, out_path, results, options=None):
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    import torch
    import torch.distributed as dist

    import dfccl

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=nprocs,
                            device_id=torch.device("cuda", rank))
    comm = dfccl.Communicator(dfccl.UniqueId.from_string(uid), rank, nprocs, backend="cuda", device=rank,
                              options=dfccl.CommOptions(**(options or {})))
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(1234 + rank)
    for size in sizes:
        count = max(1, size // 4)
        send = torch.empty(count, dtype=torch.float32, device="cuda")
        recv = torch.empty(count, dtype=torch.float32, device="cuda")
        plan = comm.prepare_all_reduce(count, "float32", tag=("bench", size)).bind(send, recv)
        # Check: fresh random inputs, poisoned output, compared with NCCL's sum.
        send.normal_(generator=gen)
        recv.fill_(float("nan"))
        ref = send.clone()
        torch.cuda.synchronize()
        plan().synchronize(timeout=120)
        dist.all_reduce(ref)
        torch.cuda.synchronize()
        wrong = int((~torch.isclose(recv, ref, rtol=1e-5, atol=1e-5)).sum().item())
        n_iters = max(20, min(iters, int(2e9 // max(size, 1) // 50)))
        last = []

        def d_submit():
            last[:] = [plan()]

        def d_finish():
            last[0].synchronize(timeout=120)

        def n_submit():
            dist.all_reduce(send)

        def n_finish():
            torch.cuda.synchronize()

        dist.barrier()
        torch.cuda.synchronize()
        t_d = _time_b2b(d_submit, d_finish, n_iters)
        dist.barrier()
        torch.cuda.synchronize()
        t_n = _time_b2b(n_submit, n_finish, n_iters)
        lat_d, lat_n = [], []
        for _ in range(min(200, n_iters)):
            t0 = time.perf_counter()
            plan().synchronize(timeout=120)
            lat_d.append(time.perf_counter() - t0)
        dist.barrier()
        torch.cuda.synchronize()
        for _ in range(min(200, n_iters)):
            t0 = time.perf_counter()
            dist.all_reduce(send)
            torch.cuda.synchronize()
            lat_n.append(time.perf_counter() - t0)
        rows.append({"size": size, "count": count, "wrong": wrong, "dfccl_us": t_d * 1e6, "nccl_us": t_n * 1e6,
                     "dfccl_latency_us": statistics.median(lat_d) * 1e6,
                     "nccl_latency_us": statistics.median(lat_n) * 1e6, "path": comm.path})
    results.put((rank, rows))
    comm.close()
    dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--min", default="8")
    p.add_argument("--max", default="256M")
    p.add_argument("--step", type=int, default=4)
    p.add_argument("--iters", type=int, default=1000)
    p.add_argument("--nprocs", type=int, default=2)
    p.add_argument("--protocol", default="auto", choices=("auto", "ll", "simple"), help="CommOptions.protocol")
    p.add_argument("--ll-max-bytes", type=int, default=None, help="CommOptions.ll_max_bytes")
    p.add_argument("--max-tags", type=int, default=None, help="CommOptions.max_tags")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = p.parse_args(argv)
    import dfccl

    sizes, s = [], parse_size(args.min)
    while s <= parse_size(args.max):
        sizes.append(s)
        s *= args.step
    uid = str(dfccl.UniqueId.create())
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    options = {"protocol": args.protocol, "ll_max_bytes": args.ll_max_bytes, "max_tags": args.max_tags}
    procs = [ctx.Process(target=_worker, args=(r, args.nprocs, uid, port, sizes, args.iters, args.out, results,
                                               options))
             for r in range(args.nprocs)]
    for pr in procs:
        pr.start()
    per_rank = dict(results.get(timeout=1200) for _ in procs)
    for pr in procs:
        pr.join(timeout=30)
    rows = []
    for i, size in enumerate(sizes):
        rs = [per_rank[r][i] for r in range(args.nprocs)]
        row = {k: max(x[k] for x in rs) for k in ("dfccl_us", "nccl_us", "dfccl_latency_us", "nccl_latency_us")}
        row.update(size=size, wrong=sum(x["wrong"] for x in rs), path=rs[0]["path"])
        rows.append(row)
    print(f"\n# all_reduce float32 sum, one process per GPU ({args.nprocs}); us; ratio = NCCL / dfccl (>1: dfccl faster)")
    print(f"{'size':>8} {'dfccl':>9} {'nccl':>9} {'ratio':>6} | {'1-op dfccl':>10} {'1-op nccl':>10} {'ratio':>6} "
          f"{'busbw d':>8} {'busbw n':>8} {'#wrong':>6} path")
    n = args.nprocs
    for r in rows:
        bus = lambda us: r["size"] / (us * 1e-6) / 1e9 * 2 * (n - 1) / n  # noqa: E731
        print(f"{fmt_size(r['size']):>8} {r['dfccl_us']:9.1f} {r['nccl_us']:9.1f} {r['nccl_us'] / r['dfccl_us']:6.2f} | "
              f"{r['dfccl_latency_us']:10.1f} {r['nccl_latency_us']:10.1f} "
              f"{r['nccl_latency_us'] / r['dfccl_latency_us']:6.2f} {bus(r['dfccl_us']):8.1f} {bus(r['nccl_us']):8.1f} "
              f"{r['wrong']:6d} {r['path']}")
    os.makedirs(args.out, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y-%m-%dT%H%M%S")
    with open(os.path.join(args.out, f"processes-{stamp}.json"), "w") as f:
        json.dump({"date": stamp, "host": socket.gethostname(), "nprocs": n, "rows": rows}, f, indent=1)
    return 0 if all(r["wrong"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
