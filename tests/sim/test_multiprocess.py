"""One rank per process: communicators built from a UniqueId, each rank in its
own spawned process.  On the simulator (CI) the arenas are shared-memory files;
on GPUs (marker ``gpu``) CUDA IPC.  Covers the staged direct path (peers read
copies in each other's arenas) and the ring, every collective in and out of
place, rank-divergent orders, and a deep queue on one tag."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback

import numpy as np
import pytest

import dfccl

TIMEOUT = 60


def _worker(uid: str, rank: int, nranks: int, backend: str, device: int, path: str, scenario: str, seed: int,
            results) -> None:
    try:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        from dfccl_support import scenarios as sc

        # The LL scenarios: a larger LL limit than the default, in fewer buckets.
        ll = {"ll_max_bytes": 1024, "max_tags": 64} if scenario.startswith("ll") else {}
        # The depth scenario: staging for a handful of its collectives at
        # their planned sizes (staged up to 16 KiB, ring FIFOs of up to a
        # quarter of 3/4 of the staging).
        if scenario == "depth":
            ll = {"staging_bytes": 512 << 10, "max_tags": 64, "staged_max_bytes": 16 << 10, "ring_tags": 4}
        # 10,000 tags pending at once: records and slots for them.  On the
        # simulator, a staging that holds a few dozen of the larger ones at
        # their planned sizes: the rest loop through smaller and reserved FIFOs.
        deep = scenario.startswith("deep_queues")
        if scenario == "deep_queues_sim":
            ll = {"staging_bytes": 8 << 20}
        comm = dfccl.Communicator(dfccl.UniqueId.from_string(uid), rank, nranks, backend=backend, device=device,
                                  options=dfccl.CommOptions(path=path, **ll, **({"max_tags": 16384} if deep else {})),
                                  daemon_options=dfccl.DaemonOptions(max_outstanding=32768) if deep else None,
                                  timeout=TIMEOUT)
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
        elif scenario == "close_early":
            # Each round a fresh child communicator, one small all-reduce
            # (LL) and one larger (staged), skewed start times, and a close
            # the moment this rank's part is done: a rank that took part and
            # then left must not fail the slower ones.
            from dfccl.bench import arrays
            rng = np.random.default_rng(seed + rank)
            for i in range(20):
                child = comm.split(0, key=-rank)    # ranks reversed in the child
                time.sleep(float(rng.uniform(0, 0.005)))
                for count in (10, 5000):
                    x = arrays.from_numpy(backend, device, np.full(count, rank + i, np.int32))
                    child.all_reduce(x, op="max").synchronize(timeout=TIMEOUT)
                    assert (arrays.to_numpy(x) == nranks - 1 + i).all(), (i, count)
                child.close()
            out["checked"] = 40
        elif scenario == "p2p":
            out["checked"] = _point_to_point(comm, seed)
        elif scenario == "depth":
            out["checked"], out["reserved_fifos"] = _queue_depth(comm, seed)
        elif scenario == "deep_queues":
            out["checked"] = deep_queues(comm, ((1000, 2 << 20), (10_000, 1024)))
        elif scenario == "deep_queues_sim":
            out["checked"] = deep_queues(comm, ((1000, 16 << 10), (10_000, 16)))
        comm.close()
        results.put((rank, "ok", out))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def _message(src: int, dst: int, salt: int, count: int) -> np.ndarray:
    return np.random.default_rng([src, dst, salt]).standard_normal(count).astype(np.float32)


def _point_to_point(comm, seed: int) -> int:
    """Sends around the ring (recvs posted after the sends; sizes across the
    FIFO's slices and channels), a collective in opposite orders around them,
    a queue on one pair tag, and all-to-alls even and uneven (with zeros)."""
    from dfccl.bench import arrays
    from dfccl_support import scenarios as sc

    r, n = comm.rank, comm.world_size
    nxt, prv = (r + 1) % n, (r - 1) % n
    dev = (comm.backend, comm.device)
    checked = 0
    for k, count in enumerate((0, 1, 4099, 300_001)):
        send = arrays.from_numpy(*dev, _message(r, nxt, seed + k, count))
        recv = arrays.empty(*dev, count, "float32", fill=sc.SENTINEL)
        ar_in = np.full(1000, float(r + 1), np.float32)
        ar = arrays.from_numpy(*dev, ar_in)
        steps = [lambda: comm.send(send, nxt, tag=("ring", k)), lambda: comm.recv(recv, prv, tag=("ring", k)),
                 lambda: comm.all_reduce(ar, tag=("ar", k))]
        works = [step() for step in (steps if r % 2 == 0 else steps[::-1])]
        for w in works:
            w.synchronize(timeout=TIMEOUT)
        assert np.array_equal(arrays.to_numpy(recv), _message(prv, r, seed + k, count)), f"ring message {k}"
        assert np.all(arrays.to_numpy(ar) == n * (n + 1) / 2)
        checked += 1
    sends = [arrays.from_numpy(*dev, _message(r, nxt, seed + 100 + q, 777)) for q in range(50)]
    recvs = [arrays.empty(*dev, 777, "float32", fill=sc.SENTINEL) for _ in range(50)]
    works = [comm.send(s, nxt) for s in sends] + [comm.recv(b, prv) for b in recvs]
    for w in works:
        w.synchronize(timeout=TIMEOUT)
    for q, b in enumerate(recvs):
        assert np.array_equal(arrays.to_numpy(b), _message(prv, r, seed + 100 + q, 777)), f"queued message {q}"
    checked += 1
    for form, counts in (("even", [[3000] * n] * n),
                         ("uneven", [[((a * 7 + b * 3) % 5) * 1001 for b in range(n)] for a in range(n)])):
        send_np = np.concatenate([_message(r, p, seed + 200, counts[r][p]) for p in range(n)])
        send = arrays.from_numpy(*dev, send_np)
        recv = arrays.empty(*dev, sum(counts[p][r] for p in range(n)), "float32", fill=sc.SENTINEL)
        comm.all_to_all_single(send, recv, send_splits=counts[r], recv_splits=[counts[p][r] for p in range(n)]) \
            .synchronize(timeout=TIMEOUT)
        want = np.concatenate([_message(p, r, seed + 200, counts[p][r]) for p in range(n)])
        assert np.array_equal(arrays.to_numpy(recv), want), f"all-to-all {form}"
        checked += 1
    return checked


def _queue_depth(comm, seed: int, ntags: int = 60, queued: int = 60) -> int:
    """Collectives queued before any wait, far beyond what the staging holds
    at their planned sizes: ``ntags`` distinct tags (odd ranks in the
    opposite order) of staged direct and ring sizes, then ``queued`` on one
    tag.  Staged ones without room fall back to the ring, ring ones loop
    through reserved FIFOs; none raises, every result is exact."""
    from dfccl.bench import arrays

    r, n = comm.rank, comm.world_size
    dev = (comm.backend, comm.device)
    limit = comm._options.staged_max_bytes
    counts = (501, limit // 8 + 5, limit // 4 + 1001)    # staged, staged, ring (int32)
    kinds = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce")

    def submit(i: int, tag):
        kind, count = kinds[i % len(kinds)], counts[i % len(counts)] // (n if i % len(kinds) in (1, 2) else 1)
        x = np.arange(count, dtype=np.int32) + 7 * r + i
        s = arrays.from_numpy(*dev, x)
        if kind == "all_reduce":
            return comm.all_reduce(s, tag=tag), s, sum(np.arange(count, dtype=np.int64) + 7 * p + i for p in range(n))
        if kind == "all_gather":
            o = arrays.empty(*dev, count * n, "int32", fill=0)
            return comm.all_gather(s, o, tag=tag), o, np.concatenate(
                [np.arange(count, dtype=np.int64) + 7 * p + i for p in range(n)])
        if kind == "reduce_scatter":
            s = arrays.from_numpy(*dev, np.arange(count * n, dtype=np.int32) + 7 * r + i)
            o = arrays.empty(*dev, count, "int32", fill=0)
            total = sum(np.arange(count * n, dtype=np.int64) + 7 * p + i for p in range(n))
            return comm.reduce_scatter(s, o, tag=tag), o, total[r * count:(r + 1) * count]
        root = i % n
        if kind == "broadcast":
            return comm.broadcast(s, root=root, tag=tag), s, np.arange(count, dtype=np.int64) + 7 * root + i
        want = sum(np.arange(count, dtype=np.int64) + 7 * p + i for p in range(n)) if r == root else x
        return comm.reduce(s, root=root, tag=tag), s, want

    pool = comm._endpoint.staging
    reserved = 0     # the most reserved FIFOs held at once
    pending = {}
    # Every rank starts queueing together: a rank that came late would find
    # its peer's half queued, and each of its collectives could complete
    # (and give its staging back) before it queued the next.
    comm.barrier(tag="depth-start").synchronize(timeout=TIMEOUT)
    for i in range(ntags) if r % 2 == 0 else reversed(range(ntags)):
        pending[i] = submit(i, ("depth", i))
        reserved = max(reserved, pool.blocks - pool.free_blocks)
    one = [submit(len(kinds) * i, "one") for i in range(queued)]
    for i, (work, out, want) in list(pending.items()) + list(enumerate(one)):
        work.synchronize(timeout=TIMEOUT)
        assert np.array_equal(arrays.to_numpy(out).astype(np.int64), want), f"collective {i}"
    return ntags + queued, reserved


def deep_queues(comm, sizes) -> int:
    """For each (n, count) of ``sizes``: n all-reduces of ``count`` float32
    on distinct tags and n on one tag, all submitted before any wait, exact
    results (small integers)."""
    from dfccl.bench import arrays

    r, size = comm.rank, comm.world_size
    dev = (comm.backend, comm.device)
    checked = 0
    for n, count in sizes:
        bufs = [arrays.from_numpy(*dev, np.full(count, r + 1 + i % 7, np.float32)) for i in range(2 * n)]
        works = [comm.all_reduce(b, tag=("deep", count, i) if i < n else ("deep", count))
                 for i, b in enumerate(bufs)]
        for w in works:
            w.synchronize(timeout=TIMEOUT)
        for i, b in enumerate(bufs):
            want = size * (size + 1) // 2 + size * (i % 7)
            assert (arrays.to_numpy(b) == want).all(), (count, i)
        checked += 2 * n
        del bufs, works
    return checked


def run_ranks(nranks: int, backend: str, path: str, scenario: str, devices=None, timeout: float = 240) -> list[dict]:
    mp_context = mp.get_context("spawn")
    uid = dfccl.UniqueId.create()
    results = mp_context.Queue()
    devices = devices or list(range(nranks))
    procs = [mp_context.Process(target=_worker, args=(str(uid), r, nranks, backend, devices[r % len(devices)], path,
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


@pytest.mark.parametrize("path", ["auto", "ring"])
@pytest.mark.parametrize("nranks", [2, 3])
def test_point_to_point_across_processes_sim(path, nranks):
    outs = run_ranks(nranks, "sim", path, "p2p")
    assert all(o["checked"] == 7 for o in outs)


@pytest.mark.parametrize("nranks", [2, 3])
def test_queue_depth_beyond_the_staging_across_processes_sim(nranks):
    outs = run_ranks(nranks, "sim", "auto", "depth")
    assert all(o["path"] == "staged" and o["checked"] == 120 for o in outs)
    # The rank that queues first holds its collectives until its peer,
    # queueing in the opposite order, reaches them; a peer that starts late
    # finds its partners queued and may hold few at once.
    assert max(o["reserved_fifos"] for o in outs) > 5, "the staging held most of them at their planned sizes"


def test_deep_queues_two_processes_sim():
    """The GPU acceptance of queue depth at the simulator's sizes: 1,000
    all-reduces of 64 KiB queued on distinct tags and 1,000 on one tag, then
    10,000 of 64 bytes each way, before any wait, in an 8 MiB staging (most
    of the larger ones loop through smaller or reserved FIFOs)."""
    outs = run_ranks(2, "sim", "auto", "deep_queues_sim", timeout=900)
    assert all(o["checked"] == 22_000 for o in outs)


@pytest.mark.parametrize("nranks", [2, 3])
def test_ll_across_processes_sim(nranks):
    outs = run_ranks(nranks, "sim", "auto", "ll")
    assert all(o["path"] == "staged" and o["ll_max_bytes"] == 1024 for o in outs)


@pytest.mark.parametrize("nranks", [3, 4])
def test_rank_that_closes_once_done_fails_nobody_sim(nranks):
    outs = run_ranks(nranks, "sim", "auto", "close_early")
    assert all(o["checked"] == 40 for o in outs)


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
def test_deep_queues_two_processes_on_one_gpu():
    """Two processes on one GPU (the GPU suite runs them under MPS where it
    can): 1,000 all-reduces of 8 MiB queued on distinct tags and 1,000 on one
    tag, then 10,000 of 4 KiB each way, before any wait (docs/architecture.md,
    "Staging budget": once the 16th raised ResourceError)."""
    outs = run_ranks(2, "cuda", "auto", "deep_queues", devices=[0], timeout=600)
    assert all(o["path"] == "staged" and o["checked"] == 22_000 for o in outs)


@pytest.mark.gpu
def test_ll_one_process_per_gpu():
    outs = run_ranks(2, "cuda", "auto", "ll", devices=_gpus())
    assert all(o["ll_max_bytes"] == 1024 for o in outs)


@pytest.mark.gpu
def test_four_processes_on_two_gpus():
    run_ranks(4, "cuda", "auto", "divergent", devices=_gpus())
    run_ranks(4, "cuda", "auto", "queue", devices=_gpus())


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["auto", "ring"])
def test_point_to_point_one_process_per_gpu(path):
    """Two processes (on one GPU when there is one): send / recv through the
    receiver's FIFO, all-to-all through the arena copies."""
    outs = run_ranks(2, "cuda", path, "p2p", devices=_gpus())
    assert all(o["checked"] == 7 for o in outs)
