"""``python -m dfccl demo``: the deadlocks dfccl prevents, run for real.

On all visible GPUs (one rank per GPU; two ranks on one GPU if there is only
one), or on 4 simulated GPUs when none is visible.  Each scenario prints what
every rank submitted in which order, whether everything completed with
correct results, how many times collectives were preempted, and the time."""

from __future__ import annotations

import sys

import numpy as np

import dfccl
from dfccl import runtime
from dfccl import scenarios as sc

__all__ = ["main"]


def _orders_line(report: sc.Report, rank: int, limit: int = 8) -> str:
    tags = [str(t) for t in report.orders[rank]]
    more = f" ... (+{len(tags) - limit})" if len(tags) > limit else ""
    return " -> ".join(tags[:limit]) + more


def _print_report(title: str, what: str, report: sc.Report, nranks: int, out) -> None:
    print(f"\n== {title}", file=out)
    print(f"   {what}", file=out)
    for r in range(nranks):
        print(f"   rank {r}: {_orders_line(report, r)}", file=out)
    pre = report.preemptions
    top = sorted(pre.items(), key=lambda kv: -kv[1])[:4]
    print(f"   completed: {report.collectives} collectives, every element checked against numpy", file=out)
    print(f"   preemptions: {report.total_preemptions} in total; most preempted: "
          + ", ".join(f"{t}={n}" for t, n in top), file=out)
    print(f"   time: {report.seconds * 1e3:.1f} ms", file=out)


def run_demo(backend: str | None = None, devices: list[int] | None = None, path: str = "auto",
             seed: int | None = None, out=sys.stdout) -> bool:
    backend = runtime.resolve_backend(backend)
    if devices is None:
        count = runtime.device_count(backend)
        devices = list(range(count)) if count > 1 else [0, 0]
    n = len(devices)
    rng = np.random.default_rng(seed)
    comms = dfccl.Communicator.for_devices(devices, backend=backend, options=dfccl.CommOptions(path=path))
    where = "simulated GPUs" if backend == "sim" else "GPUs"
    print(f"dfccl demo: {n} ranks on {where} {devices} (backend {backend}, path {comms[0].path}, "
          f"{comms[0].channels} channels)", file=out)
    try:
        # 1. Inconsistent order.
        specs = [sc.Spec("A", "all_reduce", 1 << 20, "float32"), sc.Spec("B", "all_reduce", 1 << 12, "int32", "max")]
        orders = [[0, 1] if r % 2 == 0 else [1, 0] for r in range(n)]
        rep = sc.run(comms, specs, orders, rng=rng, timeout=120)
        _print_report("inconsistent order", "even ranks issue A then B, odd ranks B then A "
                      "(NCCL: every GPU waits forever)", rep, n, out)

        # 2. Synchronisation between collectives.
        specs = sc.random_specs(rng, 4, nranks=n, max_bytes=1 << 20, prefix="s")
        orders = [list(range(4)) if r == 0 else list(range(3, -1, -1)) for r in range(n)]
        rep = sc.run(comms, specs, orders, rng=rng, threads=True, wait_each={0}, timeout=120)
        _print_report("wait between collectives", "rank 0 waits for each collective before the next; the others "
                      "issue them in reverse (NCCL: hangs)", rep, n, out)

        # 3. Device-wide synchronise while a collective waits for a peer.
        specs = [sc.Spec(f"d{i}", "all_reduce", 1 << 16, "float32") for i in range(3)]
        synced = []

        def sync_before_peers(rank, k):
            if rank == 1:
                dfccl.device_synchronize(backend, devices[0])
                synced.append(k)

        rep = sc.run(comms, specs, [list(range(3))] * n, rng=rng, between=sync_before_peers, timeout=120)
        _print_report("device synchronise", f"one thread: rank 0 submits, then a device-wide synchronise on "
                      f"{where[:-1]} {devices[0]}, then the peers submit (NCCL: the synchronise never returns)",
                      rep, n, out)

        # 4. Chaos: every rank its own permutation of 32 mixed collectives.
        specs = sc.random_specs(rng, 32, nranks=n, max_bytes=4 << 20 if backend == "cuda" else 1 << 20)
        orders = [list(rng.permutation(len(specs))) for _ in range(n)]
        rep = sc.run(comms, specs, orders, rng=rng, timeout=300)
        _print_report("random orders", "32 collectives of every kind, 4 B .. 4 MiB, each rank in its own random order",
                      rep, n, out)
    finally:
        for c in comms:
            c.close()
    print("\nall scenarios completed with correct results", file=out)
    return True
