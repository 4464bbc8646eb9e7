"""One rank per process: communicators built from a UniqueId, each rank in its
own spawned process.  On the simulator (CI) the arenas are shared-memory files;
on GPUs (marker ``gpu``) CUDA IPC.  Covers the staged direct path (peers read
copies in each other's arenas) and the ring, every collective in and out of
place, rank-divergent orders, and a deep queue on one tag."""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback

import numpy as np
import pytest

import dfccl

TIMEOUT = 60


def _worker(uid: str, rank: int, nranks: int, backend: str, device: int, path: str, scenario: str, seed: int,
            results) -> None:
    try:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        from dfccl import scenarios as sc

        # The LL scenarios: a larger LL limit than the default, in fewer buckets.
        ll = {"ll_max_bytes": 1024, "max_tags": 64} if scenario.startswith("ll") else {}
        comm = dfccl.Communicator(dfccl.UniqueId.from_string(uid), rank, nranks, backend=backend, device=device,
                                  options=dfccl.CommOptions(path=path, **ll), timeout=TIMEOUT)
        out = {"path": comm.path, "ll_max_bytes": comm.ll_max_bytes}
        if scenario == "collectives":
            # Sizes on both sides of the staged limit; odd counts; every kind.
            limit = comm._options.staged_max_bytes
            counts = (1, 7, 4099, limit // 4 + 13)
            done = 0
            for k, kind in enumerate(sc.KINDS):
                for j, count in enumerate(counts):
                    for in_place in (False, True):
                        op = sc.OPS[(k + j) % len(sc.OPS)] if kind not in ("all_gather", "broadcast") else "sum"
                        dtype = ("float32", "int32", "float64", "int64")[(k + j) % 4]
                        spec = sc.Spec(("c", kind, count, int(in_place)), kind, count, dtype, op, root=(k + j) % nranks)
                        inst = sc.RankInstance(spec, comm, seed + 1000 * k + 10 * j + in_place, in_place=in_place)
                        inst.submit().synchronize(timeout=TIMEOUT)
                        inst.verify()
                        done += 1
            out["checked"] = done
        elif scenario == "divergent":
            # Two tags in opposite orders on even and odd ranks: hangs NCCL.
            specs = [sc.Spec("A", "all_reduce", 1000, "float32"), sc.Spec("B", "all_gather", 333, "int32")]
            insts = [sc.RankInstance(s, comm, seed + i) for i, s in enumerate(specs)]
            order = insts if rank % 2 == 0 else insts[::-1]
            works = [i.submit() for i in order]
            for w in works:
                w.synchronize(timeout=TIMEOUT)
            for i in insts:
                i.verify()
            out["checked"] = len(insts)
        elif scenario == "ll":
            # Every LL kind, dtype and op around the limit, in and out of
            # place; then divergent orders across tags and a deep queue.
            done = 0
            for k, kind in enumerate(("all_reduce", "all_gather", "reduce_scatter")):
                for dtype in sc.DTYPES:
                    esize = np.dtype(dtype).itemsize
                    for j, op in enumerate(sc.OPS if kind != "all_gather" else ("sum",)):
                        for count in (1, 1024 // esize, 1024 // esize + 1):
                            for in_place in (False, True):
                                spec = sc.Spec(("ll", kind, dtype, op, count, int(in_place)), kind, count, dtype, op)
                                inst = sc.RankInstance(spec, comm, seed + done, in_place=in_place)
                                inst.submit().synchronize(timeout=TIMEOUT)
                                inst.verify()
                                done += 1
            specs = [sc.Spec(("lld", i), ("all_reduce", "all_gather", "reduce_scatter")[i % 3], 5 + i, "float32")
                     for i in range(9)]
            insts = [sc.RankInstance(s, comm, seed + 50 + i) for i, s in enumerate(specs)]
            order = insts if rank % 2 == 0 else insts[::-1]
            works = [i.submit() for i in order]
            queue = [sc.RankInstance(sc.Spec("llq", "all_reduce", 3, "float32"), comm, seed + 900 + i)
                     for i in range(200)]
            works += [i.submit() for i in queue]
            for w in works:
                w.synchronize(timeout=TIMEOUT)
            for i in insts + queue:
                i.verify()
            out["checked"] = done + len(insts) + len(queue)
        elif scenario == "queue":
            # Many instances of one tag queued before any completes: they
            # share the tag's record and staging.
            n = 200
            spec = sc.Spec("q", "all_reduce", 3000, "float32")
            insts = [sc.RankInstance(spec, comm, seed + i) for i in range(n)]
            works = [i.submit() for i in insts]
            for w in works:
                w.synchronize(timeout=TIMEOUT)
            for i in insts:
                i.verify()
            out["checked"] = n
        comm.close()
        results.put((rank, "ok", out))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(nranks: int, backend: str, path: str, scenario: str, devices=None, timeout: float = 240) -> list[dict]:
    ctx = mp.get_context("spawn")
    uid = dfccl.UniqueId.create()
    results = ctx.Queue()
    devices = devices or list(range(nranks))
    procs = [ctx.Process(target=_worker, args=(str(uid), r, nranks, backend, devices[r % len(devices)], path,
                                               scenario, 1234, results), daemon=True) for r in range(nranks)]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in range(nranks):
            rank, status, payload = results.get(timeout=timeout)
            got[rank] = (status, payload)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    errors = [f"rank {r}:\n{p}" for r, (s, p) in sorted(got.items()) if s != "ok"]
    assert not errors, "\n".join(errors)
    return [got[r][1] for r in range(nranks)]


@pytest.mark.parametrize("path", ["auto", "ring"])
def test_collectives_one_rank_per_process_sim(path):
    outs = run_ranks(2, "sim", path, "collectives")
    assert {o["path"] for o in outs} == {"staged" if path == "auto" else "ring"}
    assert all(o["checked"] == 5 * 4 * 2 for o in outs)


def test_three_processes_staged_sim():
    outs = run_ranks(3, "sim", "auto", "collectives")
    assert all(o["path"] == "staged" for o in outs)


@pytest.mark.parametrize("path", ["auto", "ring"])
def test_divergent_order_across_processes_sim(path):
    run_ranks(4, "sim", path, "divergent")


def test_queue_on_one_tag_across_processes_sim():
    run_ranks(2, "sim", "auto", "queue")


@pytest.mark.parametrize("nranks", [2, 3])
def test_ll_across_processes_sim(nranks):
    outs = run_ranks(nranks, "sim", "auto", "ll")
    assert all(o["path"] == "staged" and o["ll_max_bytes"] == 1024 for o in outs)


def _gpus() -> list[int]:
    """Up to two visible GPUs (processes share one where there is one)."""
    from dfccl import runtime

    return list(range(min(2, max(1, runtime.cuda_device_count()))))


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["auto", "ring"])
def test_collectives_one_process_per_gpu(path):
    outs = run_ranks(2, "cuda", path, "collectives", devices=_gpus())
    assert {o["path"] for o in outs} == {"staged" if path == "auto" else "ring"}


@pytest.mark.gpu
def test_divergent_order_one_process_per_gpu():
    run_ranks(2, "cuda", "auto", "divergent", devices=_gpus())


@pytest.mark.gpu
def test_ll_one_process_per_gpu():
    outs = run_ranks(2, "cuda", "auto", "ll", devices=_gpus())
    assert all(o["ll_max_bytes"] == 1024 for o in outs)


@pytest.mark.gpu
def test_four_processes_on_two_gpus():
    run_ranks(4, "cuda", "auto", "divergent", devices=_gpus())
    run_ranks(4, "cuda", "auto", "queue", devices=_gpus())
