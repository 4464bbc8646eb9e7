"""Where the time of one dfccl collective goes: submit on every rank, wait for
completion on every rank, repeat (what a step that synchronises after each
collective sees), with dfccl's own counters beside the wall clock.

Per size, medians over ``--iters`` of the counters the daemon records per
collective (Work.stats, rank 0):
  queued   - pulled by the daemon -> first run
  running  - inside runs (waits for the peers included)
  wall     - first run -> done on the device
  host     - submit -> retired on the host (Work.synchronize)
  maxwait  - the longest wait for a peer that ended with the peer arriving
and the preemptions per collective; then where the blocks of rank 0's daemon
that ran the collectives spent their time, per collective
(Daemon.daemon_profile; every rank of that daemon's device counts).
Per collective, the depth sweep: N collectives of one tag submitted back to
back, then waited for; the cost per collective must not grow with N.

Every size is checked first on fresh random inputs with poisoned outputs,
and again after the depth sweep.  The comparison with NCCL (one thread or
process per GPU) is ``dfccl bench -z 1``; this script measures dfccl only.

    python benchmarks/bench_latency.py [--sizes 8,4K,256K] [--iters 200] [--backend sim]

Flags and the record (one JSON line appended to <out>/latency.jsonl) are the
suite's (support/dfccl_support/suite.py).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

# The benchmarks' shared helpers (dfccl_support) live in support/, beside the package.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support"))

import dfccl
from dfccl import runtime
from dfccl.bench import KINDS, Case, count_wrong, format_size, parse_size
from dfccl_support import suite
from dfccl_support.profile import profile_delta

STATS_US = ("queued", "running", "wall", "host", "max_wait")
SYNC_TIMEOUT_S = 120.0


class Buffers:
    """Out-of-place send and receive buffers of one case on every rank:
    numpy arrays on the simulator, dfccl DeviceArrays on GPUs."""

    def __init__(self, backend: str, devices: list[int], case: Case):
        self.backend = backend
        self.case = case
        self.sends = [self._empty(d, case.in_count) for d in devices]
        self.recvs = [self._empty(d, case.out_count) for d in devices]

    def _empty(self, device: int, count: int):
        if self.backend == "sim":
            return np.empty(count, dtype=self.case.dtype)
        from dfccl.bench import arrays

        return arrays.DeviceArray(device, count, self.case.dtype)

    @staticmethod
    def _upload(arr, host: np.ndarray) -> None:
        if isinstance(arr, np.ndarray):
            arr[...] = host
        else:
            arr.upload(np.ascontiguousarray(host))

    @staticmethod
    def _download(arr) -> np.ndarray:
        return arr.copy() if isinstance(arr, np.ndarray) else arr.download()

    def fill(self, rng: np.random.Generator) -> list[np.ndarray | None]:
        """Fresh random inputs, poisoned outputs; returns what each rank must receive."""
        case = self.case
        inputs = case.inputs(np.random.SeedSequence(int(rng.integers(1 << 62))))
        wants = [case.expected(inputs, r) for r in range(case.n)]
        for r in range(case.n):
            send, recv = case.initial(inputs, r, False, wants[r])
            self._upload(self.sends[r], send)
            self._upload(self.recvs[r], recv)
        return wants

    def wrong(self, wants: list[np.ndarray | None]) -> int:
        case = self.case
        return sum(count_wrong(self._download(self.recvs[r]), wants[r], case.dtype, case.op, case.n)
                   for r in range(case.n))


def bind_plans(comms: list, case: Case, bufs: Buffers, tag) -> list:
    return [getattr(c, f"prepare_{case.kind}")(case.count, case.dtype, tag=tag).bind(bufs.sends[r], bufs.recvs[r])
            for r, c in enumerate(comms)]


def run_once(plans: list) -> list:
    """One collective: submitted on every rank, then waited for on every rank."""
    works = [plan() for plan in plans]
    for w in works:
        w.synchronize(timeout=SYNC_TIMEOUT_S)
    return works


def latency(comms: list, plans: list, iters: int, warmup: int) -> dict[str, Any]:
    for _ in range(warmup):
        run_once(plans)
    times, stats = [], []
    before = comms[0]._daemon.daemon_profile()
    for _ in range(iters):
        t0 = time.perf_counter()
        works = run_once(plans)
        times.append(time.perf_counter() - t0)
        stats.append(works[0].stats)
    # Rank 0's daemon, the blocks that ran collectives, per collective.
    busy = profile_delta(before, comms[0]._daemon.daemon_profile(), per=iters)
    sms = comms[0]._daemon.daemon_sms()
    busy["sms"] = [sms[b] for b in busy["blocks"]]
    medians = {f"{k}_us": statistics.median(s[f"{k}_ns"] for s in stats) / 1e3 for k in STATS_US}
    return {"us": statistics.median(times) * 1e6, "p90_us": float(np.percentile(times, 90)) * 1e6, **medians,
            "preemptions": sum(s["preemptions"] for s in stats) / len(stats), "busy_blocks": busy}


def depth_sweep(comms: list, case: Case, bufs: Buffers, depths: list[int]) -> list[dict]:
    rows = []
    for depth in depths:
        plans = bind_plans(comms, case, bufs, ("latency-depth", case.kind, case.count, depth))
        best = None
        for _ in range(3):
            t0 = time.perf_counter()
            works = [plan() for _ in range(depth) for plan in plans]
            for w in works:
                w.synchronize(timeout=SYNC_TIMEOUT_S)
            per = (time.perf_counter() - t0) / depth
            best = per if best is None else min(best, per)
        rows.append({"depth": depth, "us_per_collective": best * 1e6,
                     "last_wall_us": works[-1].stats["wall_ns"] / 1e3})
    return rows


def parse_list(text: str, convert, what: str) -> list:
    try:
        values = [convert(x) for x in text.split(",") if x]
    except ValueError as exc:
        raise SystemExit(f"error: bad {what} {text!r}: {exc}") from None
    if not values:
        raise SystemExit(f"error: no {what} given")
    return values


def main(argv: list[str] | None = None) -> int:
    p = suite.parser(__doc__.split("\n\n")[0], iters=200, warmup=10)
    p.add_argument("--kinds", default="all_reduce", help=f"comma-separated, of {', '.join(KINDS)}")
    p.add_argument("--sizes", default="8,1K,64K,1M", help="comma-separated sizes (bytes, as dfccl bench's -b)")
    p.add_argument("--depths", default="1,8,64,512,2048", help="queue depths of the sweep")
    p.add_argument("--path", default="auto", choices=("auto", "direct", "ring"))
    p.add_argument("--protocol", default="auto", choices=("auto", "ll", "simple"),
                   help="CommOptions.protocol: 'll' takes the LL protocol up to --ll-max-bytes")
    p.add_argument("--ll-max-bytes", type=int, default=None, help="CommOptions.ll_max_bytes (default: from the budget)")
    p.add_argument("--max-tags", type=int, default=None, help="CommOptions.max_tags (fewer leave room for a larger LL limit)")
    args = p.parse_args(argv)

    kinds = parse_list(args.kinds, str, "kinds")
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise SystemExit(f"error: unknown collective {unknown[0]!r} (one of {', '.join(KINDS)})")
    sizes = parse_list(args.sizes, parse_size, "sizes")
    depths = parse_list(args.depths, int, "depths")
    if args.iters < 1 or args.warmup < 0 or min(depths) < 1:
        raise SystemExit("error: iters and depths must be >= 1, warmup >= 0")
    try:
        backend = runtime.resolve_backend(args.backend)
    except dfccl.errors.BackendError as exc:
        raise SystemExit(f"error: {exc}") from None
    if args.devices:
        devices = args.devices
    else:
        devices = list(range(runtime.cuda_device_count())) if backend == "cuda" else [0, 1]
    if len(devices) < 2:
        raise SystemExit("error: needs at least two ranks (--devices 0,0 puts two on one GPU)")
    n = len(devices)
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    rng = np.random.default_rng(seed)
    comms = dfccl.Communicator.for_devices(devices, backend=backend, options=dfccl.CommOptions(
        path=args.path, protocol=args.protocol, ll_max_bytes=args.ll_max_bytes, max_tags=args.max_tags))
    setup = {"ranks": n, "gpus": len(set(devices)), "dfccl_path": comms[0].path, "channels": comms[0].channels,
             "seed": seed}
    print(json.dumps(setup))
    rows: list[dict] = []
    wrong_total = 0
    try:
        for kind in kinds:
            print(f"\n# {kind} latency (float32, sum; us; median of {args.iters} collectives, each waited for; "
                  f"Work.stats of rank 0)")
            print(f"{'size':>8} {'time':>8} {'p90':>8} | {'queued':>7} {'running':>8} {'wall':>7} {'host':>7} "
                  f"{'maxwait':>7} {'preempt':>7} {'#wrong':>6}")
            for size in sizes:
                case = Case.for_size(kind, size, n, "float32", "sum", 0)
                bufs = Buffers(backend, devices, case)
                plans = bind_plans(comms, case, bufs, ("latency", kind, case.count))
                wants = bufs.fill(rng)
                run_once(plans)
                wrong = bufs.wrong(wants)
                d = latency(comms, plans, args.iters, args.warmup)
                wrong_total += wrong
                rows.append({"kind": kind, "size": case.nbytes, "count": case.count, "wrong": wrong, "dfccl": d})
                print(f"{format_size(case.nbytes):>8} {d['us']:8.1f} {d['p90_us']:8.1f} | {d['queued_us']:7.1f} "
                      f"{d['running_us']:8.1f} {d['wall_us']:7.1f} {d['host_us']:7.1f} {d['max_wait_us']:7.1f} "
                      f"{d['preemptions']:7.2f} {wrong:6d}", flush=True)
                b = d["busy_blocks"]
                where = f" on SMs {b['sms']}" if any(s is not None for s in b["sms"]) else ""
                print(f"{'':>8} rank 0 daemon, blocks {b['blocks']}{where}, per collective: {b['passes']:.1f} passes, "
                      f"{b['runs']:.2f} runs; "
                      f"us: pull {b['pull_us']:.1f} pick {b['pick_us']:.1f} restore {b['restore_us']:.1f} "
                      f"run {b['run_us']:.1f} save {b['save_us']:.1f} idle {b['idle_us']:.1f}", flush=True)
                if b["ll_runs"]:  # a daemon built with DFCCL_STEP_PROFILE=1
                    print(f"{'':>8} LL steps per collective (us): credit {b['ll_credit_us']:.2f} push "
                          f"{b['ll_push_us']:.2f} publish {b['ll_publish_us']:.2f} recv {b['ll_recv_us']:.2f} "
                          f"finish {b['ll_finish_us']:.2f} move {b['ll_move_us']:.2f} "
                          f"complete {b['complete_us']:.2f} ({b['ll_runs']:.2f} LL runs)", flush=True)
            case = Case.for_size(kind, sizes[0], n, "float32", "sum", 0)
            bufs = Buffers(backend, devices, case)
            wants = bufs.fill(rng)
            sweep = depth_sweep(comms, case, bufs, depths)
            # Every collective of the sweep writes the same result: the last one must have.
            wrong = bufs.wrong(wants)
            wrong_total += wrong
            print(f"\n# {kind} {format_size(case.nbytes)}: N back to back on one tag, then waited for "
                  f"(us per collective, best of 3); #wrong {wrong}")
            for r in sweep:
                print(f"{r['depth']:>6} {r['us_per_collective']:8.1f}   last wall {r['last_wall_us']:.1f}")
            rows.append({"kind": kind, "size": case.nbytes, "count": case.count, "wrong": wrong,
                         "depth_sweep": sweep})
    finally:
        for c in comms:
            c.close()
    path = suite.write(args.out, suite.record("latency", args, backend, devices,
                                              {"setup": setup, "wrong_total": wrong_total, "rows": rows}))
    print(f"\n# Out of bounds values : {wrong_total} {'OK' if wrong_total == 0 else 'FAILED'}")
    print(f"wrote {path}")
    return 0 if wrong_total == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
