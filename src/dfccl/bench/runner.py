"""Running ``dfccl bench``: the hardware floor, then every case in thread or
process mode, dfccl then NCCL, with progress, and the JSON document."""

from __future__ import annotations

import datetime
import json
import os
import platform
import queue as queue_mod
import socket
import sys
import time
import traceback
from dataclasses import asdict
from typing import Any

import numpy as np

from dfccl.bench.baselines import (CupyNccl, free_port, nccl_thread_status, set_nccl_env, torch_nccl_status,
                                   torch_rank_case)
from dfccl.bench.config import REDUCING, ROOTED, BenchConfig, Case, case_seed, case_sizes, count_wrong, format_size
from dfccl.bench.floor import (FLOOR_SIMULATOR, FLOOR_SKIPPED, floor_doc, floor_for_timing, format_floor_line,
                               measure_floor)
from dfccl.bench.harness import TIMEOUT_S, Memory, Submitter, measure, merge_ranks
from dfccl.bench.report import (NCCL_UNAVAILABLE_NO_GPU, finish_row, format_row, format_table_header,
                                nccl_unavailable_line, plot_title, timing_line, write_plot)
from dfccl.errors import BackendError

__all__ = ["WorkerError", "gpu_names", "run_bench", "versions"]


# -- dfccl: every rank in this process ---------------------------------------------------------------
def _dfccl_thread_case(case: Case, comms: list, mem: Memory, devices: list[int], cfg: BenchConfig,
                       base_seed: int) -> dict:
    out: dict[str, dict] = {}
    for placement in ("oop", "ip"):
        in_place = placement == "ip"
        bufs = []
        for r, dev in enumerate(devices):
            if in_place:
                one = mem.empty(dev, case.out_count if case.kind == "all_gather" else case.in_count, case.dtype)
                bufs.append((one, *case.in_place_views(one, r, mem)))
            else:
                s, rv = mem.empty(dev, case.in_count, case.dtype), mem.empty(dev, case.out_count, case.dtype)
                bufs.append((None, s, rv))
        tag = ("bench", case.kind, case.count, placement)
        plans = []
        for r, c in enumerate(comms):
            prep = getattr(c, f"prepare_{case.kind}")
            kw: dict[str, Any] = {"tag": tag}
            if case.kind in REDUCING:
                kw["op"] = case.op
            if case.kind in ROOTED:
                kw["root"] = case.root
            plans.append(prep(case.count, case.dtype, **kw).bind(bufs[r][1], bufs[r][2]))
        sub = Submitter(plans)
        wrong = None
        if cfg.check:
            inputs = case.inputs(case_seed(base_seed, case.kind, case, placement))
            wants = [case.expected(inputs, r) for r in range(case.n)]
            for r, (one, s, rv) in enumerate(bufs):
                send_host, recv_host = case.initial(inputs, r, in_place, wants[r])
                mem.upload(one if in_place else s, send_host)
                if recv_host is not None:
                    mem.upload(rv, recv_host)
            for dev in set(devices):
                mem.synchronize(dev)
            sub.submit()
            sub.finish()
            wrong = sum(count_wrong(mem.download(bufs[r][2], case.dtype), wants[r], case.dtype, case.op, case.n)
                        for r in range(case.n))
        out[placement] = {**measure(sub.submit, sub.finish, cfg), "wrong": wrong}
    return out


def _worker(rank: int, cfg_dict: dict, uid, use_nccl: bool, torch_port: int, base_seed: int, barrier,
            results) -> None:
    """One rank of ``--mode process``: its dfccl communicator and, with
    ``use_nccl``, its torch.distributed NCCL process group."""
    try:
        set_nccl_env()
        _worker_body(rank, BenchConfig(**cfg_dict), uid, use_nccl, torch_port, base_seed, barrier, results)
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))


def _worker_body(rank: int, cfg: BenchConfig, uid, use_nccl: bool, torch_port: int, base_seed: int, barrier,
                 results) -> None:
    import dfccl

    n, dev = len(cfg.devices), cfg.devices[rank]
    wait = lambda: barrier.wait(TIMEOUT_S)  # noqa: E731
    mem = Memory(cfg.backend)
    comm = dfccl.Communicator(uid, rank, n, device=dev, backend=cfg.backend,
                              options=dfccl.CommOptions(path=cfg.path))
    nccl_version = None
    if use_nccl:
        import torch
        import torch.distributed as dist

        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{torch_port}", rank=rank, world_size=n)
        nccl_version = ".".join(str(v) for v in torch.cuda.nccl.version())
    results.put(("ready", rank, {"path": comm.path, "channels": comm.channels, "nccl_version": nccl_version,
                                 "memory": mem.lib}))
    for kind in cfg.kinds:
        for case in case_sizes(cfg, kind):
            row: dict[str, Any] = {}
            for placement in ("oop", "ip"):
                row[placement] = _dfccl_rank_case(case, comm, rank, dev, mem, cfg, base_seed, placement, wait)
            if use_nccl:
                dfccl.device_synchronize(cfg.backend, dev)  # NCCL runs on a GPU the daemon has left
                row["nccl"] = torch_rank_case(case, rank, dev, mem, cfg, base_seed, wait)
            results.put(("case", rank, (kind, case.count, row)))
    wait()
    comm.close()
    if use_nccl:
        import torch.distributed as dist

        dist.destroy_process_group()
    results.put(("done", rank, None))


def _dfccl_rank_case(case: Case, comm, rank: int, dev: int, mem: Memory, cfg: BenchConfig, base_seed: int,
                     placement: str, wait) -> dict:
    in_place = placement == "ip"
    if in_place:
        one = mem.empty(dev, case.out_count if case.kind == "all_gather" else case.in_count, case.dtype)
        s, rv = case.in_place_views(one, rank, mem)
    else:
        one, s, rv = None, mem.empty(dev, case.in_count, case.dtype), mem.empty(dev, case.out_count, case.dtype)
    kw: dict[str, Any] = {"tag": ("bench", case.kind, case.count, placement)}
    if case.kind in REDUCING:
        kw["op"] = case.op
    if case.kind in ROOTED:
        kw["root"] = case.root
    sub = Submitter([getattr(comm, f"prepare_{case.kind}")(case.count, case.dtype, **kw).bind(s, rv)])
    wrong = None
    if cfg.check:
        inputs = case.inputs(case_seed(base_seed, case.kind, case, placement))
        want = case.expected(inputs, rank)
        send_host, recv_host = case.initial(inputs, rank, in_place, want)
        mem.upload(one if in_place else s, send_host)
        if recv_host is not None:
            mem.upload(rv, recv_host)
        mem.synchronize(dev)
        sub.submit()
        sub.finish()
        wrong = count_wrong(mem.download(rv, case.dtype), want, case.dtype, case.op, case.n)
    wait()
    return {**measure(sub.submit, sub.finish, cfg, wait), "wrong": wrong}


class _Progress:
    """tqdm over the sweep when it is installed and stderr is a terminal;
    otherwise the table rows are the progress."""

    def __init__(self, total: int, enabled: bool):
        self.bar = None
        if enabled and sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="size", leave=False, file=sys.stderr)
            except ImportError:
                pass

    def write(self, line: str, out) -> None:
        if self.bar is not None and out is sys.stdout:
            self.bar.write(line, file=out)
        else:
            print(line, file=out, flush=True)

    def step(self, what: str) -> None:
        if self.bar is not None:
            self.bar.set_description(what)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def versions() -> dict:
    from importlib import metadata

    import dfccl

    out = {"dfccl": dfccl.__version__, "python": platform.python_version(), "numpy": np.__version__}
    for dist_name in ("cuda-bindings", "torch", "cupy-cuda13x", "cupy-cuda12x"):
        try:
            out[dist_name] = metadata.version(dist_name)
        except metadata.PackageNotFoundError:
            pass
    return out


def gpu_names(backend: str, devices: list[int]) -> list[str]:
    if backend != "cuda":
        return ["simulated GPU" for _ in devices]
    try:
        from cuda.bindings import driver

        driver.cuInit(0)
        names = []
        for d in devices:
            _, dev = driver.cuDeviceGet(d)
            _, raw = driver.cuDeviceGetName(64, dev)
            names.append(raw.split(b"\0", 1)[0].decode())
        return names
    except Exception:
        return [f"cuda:{d}" for d in devices]


# -- the run ------------------------------------------------------------------------------------------
def run_bench(cfg: BenchConfig, out=sys.stdout) -> dict:
    """Runs the sweep, prints the table, writes JSON (and PNG) under
    ``cfg.out``.  Returns the JSON document plus the paths written."""
    cfg.validate()
    set_nccl_env()
    n = len(cfg.devices)
    base_seed = cfg.seed if cfg.seed is not None else int.from_bytes(os.urandom(4), "little")
    started = datetime.datetime.now()
    total = sum(len(case_sizes(cfg, k)) for k in cfg.kinds)
    print(f"# dfccl bench: {', '.join(cfg.kinds)}; {n} ranks on {cfg.backend} devices {cfg.devices}; "
          f"mode {cfg.mode}; {cfg.dtype} {cfg.op}; iters {cfg.iters}, warmup {cfg.warmup}, "
          f"check {int(cfg.check)}, blocking {int(cfg.blocking)}", file=out, flush=True)
    floor = _measure_floor(cfg)
    print(f"# {format_floor_line(floor)}", file=out, flush=True)
    floor_us = floor_for_timing(floor, cfg.blocking)
    if cfg.mode == "thread":
        rows, info = _run_thread_mode(cfg, base_seed, total, out, floor_us)
    else:
        rows, info = _run_process_mode(cfg, base_seed, total, out, floor_us)
    checked = [r for r in rows if r["out_of_place"]["wrong"] is not None]
    wrong = sum(r[k]["wrong"] or 0 for r in checked for k in ("out_of_place", "in_place"))
    wrong += sum((r["nccl"] or {}).get("wrong") or 0 for r in rows)
    busbw = [r["in_place"]["busbw"] for r in rows] + [r["out_of_place"]["busbw"] for r in rows]
    print(f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}", file=out)
    print(f"# Avg bus bandwidth    : {sum(busbw) / max(1, len(busbw)):.4f} GB/s (dfccl)", file=out)
    doc = {
        "date": started.isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "backend": cfg.backend,
        "mode": cfg.mode,
        "gpus": gpu_names(cfg.backend, cfg.devices),
        "devices": cfg.devices,
        "versions": {**versions(), **({"nccl": info["nccl_version"]} if info.get("nccl_version") else {})},
        "dfccl": {"path": info.get("path"), "channels": info.get("channels"), "memory": info.get("memory")},
        "nccl": {"status": info.get("nccl") or "measured", "form": "in place"},
        "timing": {"blocking": cfg.blocking,
                   "time_us": "median of one collective waited for" if cfg.blocking
                   else "back to back: loop time / iters",
                   **({"p90_us": "90th percentile of one collective waited for"} if cfg.blocking else {})},
        "config": {**{k: v for k, v in asdict(cfg).items() if k not in ("out", "progress")}, "seed": base_seed},
        "floor": floor,
        "wrong_total": wrong,
        "rows": rows,
    }
    os.makedirs(cfg.out, exist_ok=True)
    timing = "-blocking" if cfg.blocking else ""
    stem = os.path.join(cfg.out, f"dfccl-bench-{started:%Y%m%d-%H%M%S}-{cfg.backend}-{cfg.mode}-{n}ranks{timing}")
    with open(stem + ".json", "w") as f:
        json.dump(doc, f, indent=1)
    written = [stem + ".json"]
    if cfg.plot and rows:
        title = plot_title(rows, ranks=n, gpu=doc["gpus"][0], mode=cfg.mode, dtype=cfg.dtype, blocking=cfg.blocking)
        if write_plot(stem + ".png", rows, title, floor_us):
            written.append(stem + ".png")
        else:
            print("# plot skipped: matplotlib is not installed (pip install 'dfccl[bench]')", file=out)
    for path in written:
        print(f"# wrote {path}", file=out)
    doc["written"] = written
    return doc


def _measure_floor(cfg: BenchConfig) -> dict:
    """The floor's JSON (dfccl.bench.floor) on the run's first device, before
    any daemon runs there; a failed measurement is reported, not fatal (the
    collectives' numbers stand without it)."""
    if cfg.backend != "cuda":
        return {"status": FLOOR_SIMULATOR}
    if not cfg.floor:
        return {"status": FLOOR_SKIPPED}
    try:
        return floor_doc(measure_floor(cfg.devices[0]))
    except BackendError as exc:
        return {"status": f"failed ({str(exc).splitlines()[0]})"}


def _run_thread_mode(cfg: BenchConfig, base_seed: int, total: int, out,
                     floor_us: float | None) -> tuple[list[dict], dict]:
    import dfccl

    mem = Memory(cfg.backend)
    comms = dfccl.Communicator.for_devices(cfg.devices, backend=cfg.backend,
                                           options=dfccl.CommOptions(path=cfg.path))
    status = nccl_thread_status(cfg)
    nccl = None
    version = None
    if status is None:
        nccl = CupyNccl(cfg.devices)
        v = nccl.version
        version = f"{v // 10000}.{v // 100 % 100}.{v % 100}"
    info = {"path": comms[0].path, "channels": comms[0].channels, "nccl": status, "nccl_version": version,
            "memory": mem.lib}
    line = (f"NCCL {version}: one thread per GPU (CuPy, ncclCommInitRank), in place" if nccl is not None
            else nccl_unavailable_line(status or ""))
    print(f"# dfccl: path {comms[0].path}, {comms[0].channels} channels, arrays: {mem.lib}", file=out)
    rows: list[dict] = []
    progress = _Progress(total, cfg.progress)
    try:
        for kind in cfg.kinds:
            progress.write(format_table_header(kind, line, timing_line(cfg.blocking, cfg.iters)), out)
            for case in case_sizes(cfg, kind):
                measured = _dfccl_thread_case(case, comms, mem, cfg.devices, cfg, base_seed)
                if nccl is not None:
                    # The daemons leave the GPUs when idle; NCCL runs on GPUs they have left.
                    for dev in sorted(set(cfg.devices)):
                        dfccl.device_synchronize(cfg.backend, dev)
                    measured["nccl"] = nccl.run_case(case, mem, cfg, base_seed)
                row = finish_row(kind, case, measured, floor_us)
                rows.append(row)
                progress.write(format_row(row), out)
                progress.step(f"{kind} {format_size(case.nbytes)}")
    finally:
        progress.close()
        for c in comms:
            c.close()
        if nccl is not None:
            nccl.close()
    return rows, info


def _run_process_mode(cfg: BenchConfig, base_seed: int, total: int, out,
                      floor_us: float | None) -> tuple[list[dict], dict]:
    import multiprocessing

    import dfccl

    n = len(cfg.devices)
    mp_context = multiprocessing.get_context("spawn")
    uid = dfccl.UniqueId.create()
    barrier = mp_context.Barrier(n)
    results = mp_context.Queue()
    # Decided once, here, so that every rank agrees on joining the process group.
    status = "disabled (--no-nccl)" if not cfg.nccl else (
        torch_nccl_status() if cfg.backend == "cuda" else NCCL_UNAVAILABLE_NO_GPU)
    port = free_port()
    cfg_dict = asdict(cfg)
    procs = [mp_context.Process(target=_worker, args=(r, cfg_dict, uid, status is None, port, base_seed, barrier, results),
                                name=f"dfccl-bench-rank{r}", daemon=True) for r in range(n)]
    for p in procs:
        p.start()
    inbox = _Inbox(results, procs)
    rows: list[dict] = []
    progress = _Progress(total, cfg.progress)
    try:
        info = dict(inbox.take("ready"))
        for _ in range(n - 1):
            inbox.take("ready")
        info["nccl"] = status
        line = (f"NCCL {info['nccl_version']}: one process per GPU (torch.distributed), in place"
                if status is None else nccl_unavailable_line(status))
        print(f"# dfccl: path {info['path']}, {info['channels']} channels, arrays: {info['memory']}; "
              f"{n} worker processes", file=out)
        shared = sorted({d for d in cfg.devices if cfg.devices.count(d) > 1})
        if cfg.backend == "cuda" and shared:
            # Kernels of different processes do not run side by side on one
            # GPU (without MPS the GPU time-slices between their contexts), so
            # every collective waits for the other daemons' time slices.
            print(f"# note: several processes share GPU {', '.join(map(str, shared))}: the GPU time-slices between "
                  "processes, so each collective takes milliseconds; these times say nothing about one process "
                  "per GPU", file=out)
        for kind in cfg.kinds:
            progress.write(format_table_header(kind, line, timing_line(cfg.blocking, cfg.iters)), out)
            for case in case_sizes(cfg, kind):
                parts = [inbox.take("case", (kind, case.count))[2] for _ in range(n)]
                measured = {key: merge_ranks([p[key] for p in parts]) for key in parts[0]}
                row = finish_row(kind, case, measured, floor_us)
                rows.append(row)
                progress.write(format_row(row), out)
                progress.step(f"{kind} {format_size(case.nbytes)}")
        for _ in range(n):
            inbox.take("done")
        for p in procs:
            p.join(timeout=60)
    finally:
        progress.close()
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
        uid.close()
    return rows, info


class WorkerError(RuntimeError):
    """A worker process of ``--mode process`` failed."""


class _Inbox:
    """Messages from the workers.  Ranks put independently, so messages of
    different ranks may arrive out of order: unexpected ones wait in a backlog."""

    def __init__(self, results, procs: list):
        self.results = results
        self.procs = procs
        self.backlog: list[tuple[str, int, Any]] = []

    def take(self, what: str, key: tuple | None = None):
        def matches(msg) -> bool:
            return msg[0] == what and (key is None or tuple(msg[2][:2]) == key)

        for i, msg in enumerate(self.backlog):
            if matches(msg):
                return self.backlog.pop(i)[2]
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            try:
                msg = self.results.get(timeout=1.0)
            except queue_mod.Empty:
                dead = [p for p in self.procs if not p.is_alive() and p.exitcode not in (0, None)]
                if dead:
                    raise WorkerError(f"worker {dead[0].name} exited with code {dead[0].exitcode}") from None
                if time.monotonic() > deadline:
                    raise WorkerError(f"no {what!r} message from the workers in {TIMEOUT_S:.0f} s") from None
                continue
            if msg[0] == "error":
                raise WorkerError(f"rank {msg[1]} failed:\n{msg[2]}")
            if matches(msg):
                return msg[2]
            self.backlog.append(msg)
