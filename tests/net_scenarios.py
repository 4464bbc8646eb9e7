"""Ranks on "different hosts" (DFCCL_HOST_ID) in separate processes, every
peer reached through the network proxy over UCX (TCP on loopback): the
scenarios tests/sim/test_net_sim.py runs on the simulator and
tests/gpu/test_net_gpu.py on a GPU (two processes under MPS).  A scenario
is a module-level function ``(comm, ctx) -> dict`` run in every rank."""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import queue
import signal
import time
import traceback
from dataclasses import dataclass

import numpy as np
import pytest

import dfccl
from dfccl.scenarios import SENTINEL

__all__ = ["UCX_ENV", "TIMEOUT", "needs_ucx", "RankContext", "net_comm", "sweep_specs", "sweep", "divergent",
           "takes_ll", "ll_divergent",
           "storage", "payload", "same_bytes", "send_recv_every_pair", "start_all_to_all", "all_to_all_checked",
           "exchange", "split_children", "hierarchical_all_reduces", "hierarchical_blocks", "HIER_MIN_BYTES",
           "run_ranks", "check_remote_loss"]

needs_ucx = pytest.mark.skipif(importlib.util.find_spec("libucx") is None,
                               reason='the network path needs UCX: pip install "dfccl[net]"')

TIMEOUT = 60
#: UCX over TCP on loopback, whatever else this machine offers.
UCX_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}


@dataclass
class RankContext:
    rank: int
    nranks: int
    backend: str
    one_host_uids: tuple  # two more communicators' ids, all ranks on one host id (sweep's references)
    options: dict


def net_comm(uid: str, rank: int, nranks: int, host: str, backend: str = "sim", **options):
    """Rank ``rank`` on host id ``host``: simulated device 4200 + rank, or
    GPU 0 (every rank of a GPU test shares it under MPS)."""
    os.environ["DFCCL_HOST_ID"] = host
    device = 4200 + rank if backend == "sim" else 0
    return dfccl.Communicator(dfccl.UniqueId.from_string(uid), rank, nranks, backend=backend, device=device,
                              options=dfccl.CommOptions(**options), timeout=TIMEOUT)


def sweep_specs(nranks: int = 3, large_bytes: int = 3 << 20):
    """(spec, in_place) of the correctness sweep of ``nranks`` ranks: every
    kind and dtype at sizes across the slice and the channels,
    ``large_bytes`` for some, the roots taking turns."""
    from dfccl_support import scenarios as sc

    out = []
    for k, kind in enumerate(sc.KINDS):
        for d, dtype in enumerate(sc.DTYPES):
            esize = np.dtype(dtype).itemsize
            counts = [1, 4099]
            if d % 3 == k % 3:
                counts.append(large_bytes // esize + 5)     # odd count
            for j, count in enumerate(counts):
                op = "sum" if kind in ("all_gather", "broadcast") else sc.OPS[(k + d + j) % len(sc.OPS)]
                spec = sc.Spec(("net", kind, dtype, count), kind, count, dtype, op, root=(k + d + j) % nranks)
                out.append((spec, kind != "reduce" and (d + j) % 2 == 1))
    return out


def takes_ll(comm, spec) -> bool:
    """Whether ``spec`` takes LL on ``comm`` (planning.plan_geometry's rule:
    the three symmetric kinds, and across hosts broadcast, a per-rank piece
    up to ll_max_bytes)."""
    piece = spec.count * np.dtype(storage(spec.dtype)).itemsize
    kinds = ("all_reduce", "all_gather", "reduce_scatter") + (("broadcast",) if comm.path == "ring" else ())
    return spec.kind in kinds and piece <= comm.ll_max_bytes


def sweep(comm, ctx: RankContext) -> dict:
    """The sweep, each collective compared bit for bit with the same one on
    one host, no network: the ring path, or LL where the spanning
    communicator takes LL (LL reduces in rank order, the ring in ring
    order)."""
    from dfccl.bench import arrays
    from dfccl_support import scenarios as sc

    ring = net_comm(ctx.one_host_uids[0], ctx.rank, ctx.nranks, "one-host", ctx.backend, path="ring", **ctx.options)
    ll = net_comm(ctx.one_host_uids[1], ctx.rank, ctx.nranks, "one-host", ctx.backend, **ctx.options)
    checked, took_ll = 0, 0
    try:
        for i, (spec, in_place) in enumerate(sweep_specs(ctx.nranks)):
            net = sc.RankInstance(spec, comm, 7000 + i, in_place=in_place)
            net.submit().synchronize(timeout=TIMEOUT)
            net.verify()
            local = ll if takes_ll(comm, spec) else ring
            took_ll += local is ll
            ref = sc.RankInstance(spec, local, 7000 + i, in_place=in_place)
            ref.submit().synchronize(timeout=TIMEOUT)
            got, want = arrays.to_numpy(net.recv), arrays.to_numpy(ref.recv)
            assert got.tobytes() == want.tobytes(), f"{spec.tag}: not bit-identical to one host"
            checked += 1
    finally:
        ring.close()
        ll.close()
    return {"checked": checked, "ll": took_ll}


def divergent(comm, ctx: RankContext) -> dict:
    """Tags in opposite orders on even and odd ranks (hangs NCCL), then a
    queue of 50 on one tag behind them."""
    from dfccl_support import scenarios as sc

    kinds = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce")
    specs = [sc.Spec(("d", i), kinds[i % 5], 1000 + 97 * i, "float32", "sum", root=i % ctx.nranks)
             for i in range(10)]
    insts = [sc.RankInstance(s, comm, 100 + i) for i, s in enumerate(specs)]
    order = insts if ctx.rank % 2 == 0 else insts[::-1]
    works = [i.submit() for i in order]
    queue = [sc.RankInstance(sc.Spec("q", "all_reduce", 3000, "int32"), comm, 500 + i) for i in range(50)]
    works += [i.submit() for i in queue]
    for w in works:
        w.synchronize(timeout=TIMEOUT)
    for i in insts + queue:
        i.verify()
    return {"checked": len(insts) + len(queue), "preemptions": sum(w.stats["preemptions"] for w in works)}


def ll_divergent(comm, ctx: RankContext) -> dict:
    """LL across hosts: small all-reduces, all-gathers, reduce-scatters and
    broadcasts (LL's rooted form) interleaved with a ring broadcast, in
    opposite orders on even and odd ranks, then a queue of 50 on one LL tag
    (the parities and their credit across hosts) and one ring collective
    behind it."""
    from dfccl_support import scenarios as sc

    kinds = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
    specs = [sc.Spec(("ll", i), kinds[i % 4], 3000 + i if i == 7 else 1 + i, "float32",
                     ("sum", "max", "min", "prod")[i % 4] if i % 4 in (0, 2) else "sum", root=i % ctx.nranks)
             for i in range(12)]
    insts = [sc.RankInstance(s, comm, 300 + i) for i, s in enumerate(specs)]
    order = insts if ctx.rank % 2 == 0 else insts[::-1]
    works = [i.submit() for i in order]
    queue = [sc.RankInstance(sc.Spec("llq", "all_reduce", 7, "int32"), comm, 600 + i) for i in range(50)]
    queue.append(sc.RankInstance(sc.Spec("after", "all_reduce", 5000, "float64"), comm, 700))
    works += [i.submit() for i in queue]
    for w in works:
        w.synchronize(timeout=TIMEOUT)
    for i in insts + queue:
        i.verify()
    ll = sum(takes_ll(comm, i.spec) for i in insts + queue)
    return {"checked": len(insts) + len(queue), "ll": ll}


def storage(dtype: str) -> np.dtype:
    """How the host holds elements of ``dtype`` (bfloat16 as uint16)."""
    return np.dtype(np.uint16 if dtype == "bfloat16" else dtype)


def payload(src: int, dst: int, count: int, dtype: str, seed: int) -> np.ndarray:
    """What ``src`` sends ``dst``: random bytes (any bit pattern, NaNs
    included: a move must keep every bit)."""
    rng = np.random.default_rng([seed, src, dst])
    return rng.integers(0, 256, count * storage(dtype).itemsize, dtype=np.uint8).view(storage(dtype))


def same_bytes(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.tobytes() == want.tobytes(), f"{what}: not the bytes sent"


def _buffer(arr, dtype: str):
    """What a call takes: the array itself, or for bfloat16 a Buffer over it
    (its host storage is uint16)."""
    if dtype != "bfloat16":
        return arr
    if isinstance(arr, np.ndarray):
        return dfccl.Buffer.from_pointer(arr.ctypes.data, arr.size, dtype, owner=arr)
    return dfccl.Buffer.from_pointer(arr.ptr, arr.count, dtype, device=arr.device, owner=arr)


def send_recv_every_pair(comm, backend: str, count: int, dtype: str, seed: int, tag=None) -> None:
    """Send / recv between every pair (recvs first on even ranks, last on
    odd ones) in the backend's memory; checks every byte."""
    from dfccl.bench import arrays

    r, n = comm.rank, comm.world_size
    peers = [p for p in range(n) if p != r]
    sends = {p: arrays.from_numpy(backend, comm.device, payload(r, p, count, dtype, seed)) for p in peers}
    recvs = {p: arrays.empty(backend, comm.device, count, storage(dtype), fill=SENTINEL) for p in peers}
    posted = [("recv", p) for p in peers] + [("send", p) for p in peers]
    if r % 2:
        posted.reverse()
    works = [comm.recv(_buffer(recvs[p], dtype), p, tag=tag) if k == "recv" else
             comm.send(_buffer(sends[p], dtype), p, tag=tag) for k, p in posted]
    for w in works:
        w.synchronize(timeout=TIMEOUT)
    for p in peers:
        same_bytes(arrays.to_numpy(recvs[p]), payload(p, r, count, dtype, seed), f"{dtype} x{count} from {p}")


def start_all_to_all(comm, backend: str, counts: list[list[int]], dtype: str, seed: int, tag=None):
    """An all-to-all where rank a sends counts[a][b] elements to rank b (the
    even form where all counts agree), in the backend's memory; returns its
    work and its check (which keeps the buffers alive)."""
    from dfccl.bench import arrays

    r, n = comm.rank, comm.world_size
    send_splits, recv_splits = counts[r], [counts[p][r] for p in range(n)]
    host = np.concatenate([payload(r, p, send_splits[p], dtype, seed) for p in range(n)])
    send = arrays.from_numpy(backend, comm.device, host)
    recv = arrays.empty(backend, comm.device, sum(recv_splits), storage(dtype), fill=SENTINEL)
    sbuf, rbuf = _buffer(send, dtype), _buffer(recv, dtype)
    if len(set(send_splits + recv_splits)) == 1:
        work = comm.all_to_all(sbuf, rbuf, tag=tag)
    else:
        work = comm.all_to_all_single(sbuf, rbuf, send_splits=send_splits, recv_splits=recv_splits, tag=tag)
    want = np.concatenate([payload(p, r, recv_splits[p], dtype, seed) for p in range(n)])

    def check(send=send):   # holds the send buffer until the check is dropped
        same_bytes(arrays.to_numpy(recv), want, f"all_to_all {dtype} {counts}")
    return work, check


def all_to_all_checked(comm, backend: str, counts: list[list[int]], dtype: str, seed: int, tag=None) -> None:
    """start_all_to_all, waited for and checked."""
    work, check = start_all_to_all(comm, backend, counts, dtype, seed, tag)
    work.synchronize(timeout=TIMEOUT)
    check()


def exchange(comm, ctx: RankContext) -> dict:
    """Send / recv between every pair and all-to-alls, even and uneven (a
    zero among the splits), of four dtypes up to 1 MiB: every byte as sent."""
    n, checked = comm.world_size, 0
    for d, dtype in enumerate(("float32", "int8", "float64", "float16")):
        for j, count in enumerate((1, 4099, (1 << 20) // np.dtype(dtype).itemsize + 3)):
            send_recv_every_pair(comm, ctx.backend, count, dtype, 100 * d + j)
            checked += 1
        for uneven in (False, True):
            counts = [[(a * 7 + b * 3 + d) % 5 * 1000 + (a == b) * 3 if uneven else 3000 for b in range(n)]
                      for a in range(n)]
            all_to_all_checked(comm, ctx.backend, counts, dtype, 9000 + 10 * d + uneven)
            checked += 1
    return {"checked": checked}


def split_children(comm, ctx: RankContext) -> dict:
    """Ranks 0, 1 on one host and 2, 3 on another: children {0, 2}, {1, 3}
    span hosts, children {0, 1}, {2, 3} do not; each runs an all-reduce,
    send / recv and an all-to-all, then closes."""
    from dfccl_support import scenarios as sc

    r = comm.rank
    children = []
    for color in (r % 2, r // 2):
        child = comm.split(color)
        inst = sc.RankInstance(sc.Spec(("split", color), "all_reduce", 10000, "float32"), child, 40 + color)
        inst.submit().synchronize(timeout=TIMEOUT)
        inst.verify()
        send_recv_every_pair(child, ctx.backend, 20000, "uint32", 60 + color)
        all_to_all_checked(child, ctx.backend, [[3000] * 2] * 2, "float32", 80 + color)
        children.append({"transports": child.transports, "path": child.path})
        child.close()
    return {"children": children}


#: hierarchy_min_bytes of the hierarchical scenarios: small, so that they
#: run quickly on the simulator and still move several slices per part.
HIER_MIN_BYTES = 64 << 10


def _hier_input(rank: int, count: int, dtype: str, seed: int) -> np.ndarray:
    """Small integers (exact in every dtype, and their sums and averages of
    four), different on every rank."""
    i = np.arange(count, dtype=np.int64)
    return (((i * 7 + rank * 13 + seed * 29) % 101) - 50).astype(storage(dtype))


def _hier_expected(nranks: int, count: int, dtype: str, op: str, seed: int) -> np.ndarray:
    xs = np.stack([_hier_input(r, count, dtype, seed).astype(np.float64) for r in range(nranks)])
    out = {"sum": xs.sum(0), "max": xs.max(0), "min": xs.min(0), "avg": xs.mean(0)}[op]
    return out.astype(storage(dtype))


def hierarchical_all_reduces(comm, ctx: RankContext) -> dict:
    """Ranks 0, 1 on one host and 2, 3 on another (per_host 2), with
    hierarchy_min_bytes HIER_MIN_BYTES: all-reduces above it whose count
    divides by two run hierarchically (three parts), the others on the ring,
    every one exact; in place and not; ops and dtypes; two hierarchical
    ones issued in opposite orders on even and odd ranks, a ring broadcast
    between them; then a tagged one whose parts a peer joins late."""
    from dfccl.bench import arrays

    info = comm.hierarchy
    assert info is not None and (info.hosts, info.per_host) == (2, comm.world_size // 2), info
    dev, n, r = comm.device, comm.world_size, comm.rank
    cases = []   # (count, dtype, op, in_place, hierarchical)
    per = info.per_host
    big = 3 * HIER_MIN_BYTES // 4   # elements of 4 bytes: 3 x min_bytes, a multiple of 2 and 3
    for j, (dtype, op) in enumerate([("float32", "sum"), ("int32", "max"), ("float64", "avg"), ("int64", "min")]):
        cases.append((big + per * j, dtype, op, j % 2 == 0, True))
    cases.append((big + 1, "float32", "sum", True, False))      # odd count: the ring
    cases.append((1000, "float32", "sum", False, False))         # below min_bytes: the ring
    checked = 0
    for k, (count, dtype, op, in_place, hier) in enumerate(cases):
        before = comm.hierarchy.all_reduces
        x = arrays.from_numpy(ctx.backend, dev, _hier_input(r, count, dtype, k))
        y = x if in_place else arrays.empty(ctx.backend, dev, count, storage(dtype), fill=SENTINEL)
        work = comm.all_reduce(x, None if in_place else y, op=op)
        assert work.kind == "all_reduce" and work.rank == r, work
        work.synchronize(timeout=TIMEOUT)
        want = _hier_expected(n, count, dtype, op, k)
        if op == "avg" and per & (per - 1):
            # Thirds of the host's sum, then halves: rounded, unlike 1/6 of the sum.
            assert np.allclose(arrays.to_numpy(y), want, rtol=1e-12, atol=0), f"case {k}"
        else:
            same_bytes(arrays.to_numpy(y), want, f"case {k}")
        assert comm.hierarchy.all_reduces == before + hier, (k, hier, comm.hierarchy)
        checked += 1
    # Opposite orders: A then B on even ranks, B then A on odd ones.
    xa = arrays.from_numpy(ctx.backend, dev, _hier_input(r, big, "float32", 50))
    xb = arrays.from_numpy(ctx.backend, dev, _hier_input(r, big + per, "float32", 51))
    root_data = np.arange(5000, dtype=np.float32)
    bc = arrays.from_numpy(ctx.backend, dev, root_data if r == 0 else np.zeros(5000, np.float32))
    first, second = (("a", xa), ("b", xb)) if r % 2 == 0 else (("b", xb), ("a", xa))
    works = [comm.all_reduce(first[1], tag=first[0]), comm.broadcast(bc, root=0, tag="bc"),
             comm.all_reduce(second[1], tag=second[0])]
    for w in works:
        w.synchronize(timeout=TIMEOUT)
    same_bytes(arrays.to_numpy(xa), _hier_expected(n, big, "float32", "sum", 50), "divergent a")
    same_bytes(arrays.to_numpy(xb), _hier_expected(n, big + per, "float32", "sum", 51), "divergent b")
    same_bytes(arrays.to_numpy(bc), root_data, "broadcast between")
    # A peer comes late: the last rank submits after the others are well
    # into their parts (a part waits, preempted, like any collective).
    xl = arrays.from_numpy(ctx.backend, dev, _hier_input(r, big, "float32", 52))
    if r == n - 1:
        time.sleep(0.3)
    late = comm.all_reduce(xl, tag="late")
    st = comm.status()
    if not late.done():
        # Pending during the status: its parts are listed, in this
        # communicator's rank numbers.
        parts = [p for p in st.pending if "part of a hierarchical collective" in p.kind]
        assert parts and all(p.tag == "late" for p in parts), st.pending
        # Each named as itself (the last part stands for the whole elsewhere).
        assert {p.kind.split(" (")[0] for p in parts} <= {"reduce_scatter within the host",
                                                         "all_reduce across hosts",
                                                         "all_gather within the host"}, parts
        assert all(w is None or 0 <= w < n for p in parts for w in [p.waiting_for]), parts
    late.synchronize(timeout=TIMEOUT)
    same_bytes(arrays.to_numpy(xl), _hier_expected(n, big, "float32", "sum", 52), "late")
    # One tag's collectives on one buffer, not waited for in between: a
    # hierarchical all-reduce, one on the ring over its first elements,
    # a hierarchical one over its first half (its parts lay their staging
    # out anew), a reduce to rank 0 (the ring), a hierarchical all-reduce,
    # an all-to-all out of the buffer and a last hierarchical all-reduce.
    # They run in order, as a tag's instances do.
    xs = arrays.from_numpy(ctx.backend, dev, _hier_input(r, big, "float32", 53))
    out = arrays.empty(ctx.backend, dev, big, np.float32, fill=SENTINEL)
    half = big // 2   # a multiple of 2 and 3, above min_bytes
    works = [comm.all_reduce(xs, tag="seq"), comm.all_reduce(xs[:1000], tag="seq"),
             comm.all_reduce(xs[:half], tag="seq"), comm.reduce(xs, root=0, tag="seq"), comm.all_reduce(xs, tag="seq"),
             comm.all_to_all(xs, out, tag="seq"), comm.all_reduce(xs, tag="seq")]
    for w in works:
        w.synchronize(timeout=TIMEOUT)
    want = _hier_expected(n, big, "float32", "sum", 53)
    want[:1000] *= n
    want[:half] *= n
    want *= 2 * n - 1   # rank 0 holds n x, the others x
    m = big // n   # every rank held `want`: its part r, from each rank
    same_bytes(arrays.to_numpy(out), np.tile(want[r * m:(r + 1) * m], n), "all-to-all in order on one tag")
    same_bytes(arrays.to_numpy(xs), want * n, "in order on one tag")
    return {"checked": checked + 4, "hierarchical": comm.hierarchy.all_reduces}


def _check_close(got: np.ndarray, want: np.ndarray, op: str, what: str) -> None:
    if op == "avg":
        # Means of means (within the host, then across): rounded otherwise.
        assert np.allclose(got, want, rtol=1e-12, atol=0), what
    else:
        same_bytes(got, want, what)


def hierarchical_blocks(comm, ctx: RankContext) -> dict:
    """Reduce-scatters and all-gathers across hosts with each host's ranks
    contiguous: those whose n blocks hold at least HIER_MIN_BYTES run
    hierarchically (H + 1 parts), smaller ones on the ring, every one
    exact; in place and not; ops and dtypes; a reduce-scatter and an
    all-gather issued in opposite orders on even and odd ranks; one tag's
    all-reduce, reduce-scatter, all-gather and broadcast on one buffer, not
    waited for in between, in order."""
    from dfccl.bench import arrays

    info = comm.hierarchy
    assert info is not None and info.blocks, info
    dev, n, r = comm.device, comm.world_size, comm.rank
    c = 3 * HIER_MIN_BYTES // (4 * n) + 5   # a block: n blocks of 4 bytes hold over min_bytes
    checked = 0

    def counts():
        h = comm.hierarchy
        return h.reduce_scatters, h.all_gathers

    for j, (dtype, op) in enumerate([("float32", "sum"), ("int32", "max"), ("float64", "avg"), ("int64", "min")]):
        for count, hier in ((c + j, True), (100 + j, False)):
            in_place = (j + count) % 2 == 0
            seed = 10 * j + count % 7
            # Reduce-scatter: rank r gets block r of every rank's n blocks.
            before = counts()
            x = arrays.from_numpy(ctx.backend, dev, _hier_input(r, n * count, dtype, seed))
            y = x[r * count:(r + 1) * count] if in_place else \
                arrays.empty(ctx.backend, dev, count, storage(dtype), fill=SENTINEL)
            w = comm.reduce_scatter(x, y, op=op)
            assert w.kind == "reduce_scatter" and w.rank == r, w
            w.synchronize(timeout=TIMEOUT)
            want = _hier_expected(n, n * count, dtype, op, seed)[r * count:(r + 1) * count]
            _check_close(arrays.to_numpy(y), want, op, f"reduce_scatter {dtype} {op} {count}")
            assert counts() == (before[0] + hier, before[1]), (count, hier, comm.hierarchy)
            parts = w.stats.get("parts")
            if hier:
                # Each part's counters, in the order they ran.
                assert [p["phase"] for p in parts] == [f"reduce-scatter within the host, of host {i}'s blocks"
                                                       for i in range(info.hosts)] + ["reduce-scatter across hosts"]
                assert all(p["channels"] >= 1 and p["wall_ns"] > 0 for p in parts), parts
            else:
                assert parts is None, parts
            # All-gather: every rank gets every rank's block, in rank order.
            mine = _hier_input(r, count, dtype, seed)
            poisoned = np.full(n * count, SENTINEL, storage(dtype))
            if in_place:
                poisoned[r * count:(r + 1) * count] = mine
            out = arrays.from_numpy(ctx.backend, dev, poisoned)
            send = out[r * count:(r + 1) * count] if in_place else arrays.from_numpy(ctx.backend, dev, mine)
            w = comm.all_gather(send, out)
            assert w.kind == "all_gather", w
            w.synchronize(timeout=TIMEOUT)
            want = np.concatenate([_hier_input(q, count, dtype, seed) for q in range(n)])
            same_bytes(arrays.to_numpy(out), want, f"all_gather {dtype} {count}")
            assert counts() == (before[0] + hier, before[1] + hier), (count, hier, comm.hierarchy)
            checked += 2
    # Opposite orders: a reduce-scatter then an all-gather on even ranks,
    # the other way round on odd ones.
    xa = arrays.from_numpy(ctx.backend, dev, _hier_input(r, n * c, "float32", 60))
    ya = arrays.empty(ctx.backend, dev, c, np.float32, fill=SENTINEL)
    xb = arrays.from_numpy(ctx.backend, dev, _hier_input(r, c, "float32", 61))
    yb = arrays.empty(ctx.backend, dev, n * c, np.float32, fill=SENTINEL)
    calls = [lambda: comm.reduce_scatter(xa, ya, tag="a"), lambda: comm.all_gather(xb, yb, tag="b")]
    works = [f() for f in (calls if r % 2 == 0 else calls[::-1])]
    for w in works:
        w.synchronize(timeout=TIMEOUT)
    same_bytes(arrays.to_numpy(ya), _hier_expected(n, n * c, "float32", "sum", 60)[r * c:(r + 1) * c], "divergent a")
    same_bytes(arrays.to_numpy(yb), np.concatenate([_hier_input(q, c, "float32", 61) for q in range(n)]),
               "divergent b")
    # One tag, one buffer, nothing waited for in between: a hierarchical
    # all-reduce, a reduce-scatter of it into block r, an all-gather of
    # block r back into it, a broadcast (the ring) and a last all-reduce.
    count = n * c - (n * c) % comm.hierarchy.per_host
    c2 = count // n
    xs = arrays.from_numpy(ctx.backend, dev, _hier_input(r, count, "float32", 62))
    blk = arrays.empty(ctx.backend, dev, c2, np.float32, fill=SENTINEL)
    whole = xs[:n * c2]
    works = [comm.all_reduce(xs, tag="seqb"), comm.reduce_scatter(whole, blk, tag="seqb"),
             comm.all_gather(blk, whole, tag="seqb"), comm.broadcast(xs, root=1, tag="seqb"),
             comm.all_reduce(xs, tag="seqb")]
    for w in works:
        w.synchronize(timeout=TIMEOUT)
    want = _hier_expected(n, count, "float32", "sum", 62)   # the all-reduce: the sum on every rank
    want[:n * c2] *= n                                      # the reduce-scatter and all-gather: n x that
    want *= n                                               # the broadcast changes nothing; the last all-reduce
    same_bytes(arrays.to_numpy(xs), want, "in order on one tag")
    if ctx.backend == "sim":
        # On a stream (not capturing): hierarchical, armed by the stream.
        from dfccl import runtime

        st = runtime.get_device("sim", dev).create_stream()
        try:
            x = arrays.from_numpy(ctx.backend, dev, _hier_input(r, n * c, "float32", 63))
            y = arrays.empty(ctx.backend, dev, c, np.float32, fill=SENTINEL)
            st.delay(0.05)
            comm.reduce_scatter(x, y, stream=st).synchronize(timeout=TIMEOUT)
            same_bytes(arrays.to_numpy(y), _hier_expected(n, n * c, "float32", "sum", 63)[r * c:(r + 1) * c],
                       "on a stream")
        finally:
            st.close()
        checked += 1
    return {"checked": checked + 3, "reduce_scatters": comm.hierarchy.reduce_scatters,
            "all_gathers": comm.hierarchy.all_gathers}


def _worker(uid: str, ctx: RankContext, scenario, results, per_host: int, env: dict) -> None:
    try:
        os.environ.update(UCX_ENV)
        os.environ.update(env)
        comm = net_comm(uid, ctx.rank, ctx.nranks, f"host-{ctx.rank // per_host}", ctx.backend, **ctx.options)
        out = {"path": comm.path, "transports": comm.transports}
        out.update(scenario(comm, ctx))
        comm.close()
        results.put((ctx.rank, "ok", out))
    except BaseException:
        results.put((ctx.rank, "error", traceback.format_exc()))


def _next_result(results, procs: list, got: dict, limit: float = 600.0, grace: float = 5.0) -> tuple:
    """The next rank's (rank, what, info) from ``results``; a rank whose
    process ended without one (a crash: its exit code says how) fails the
    test at once instead of leaving it waiting out ``limit``."""
    deadline, ended_at = time.monotonic() + limit, None
    while True:
        try:
            return results.get(timeout=0.5)
        except queue.Empty:
            pass
        ended = {r: p.exitcode for r, p in enumerate(procs) if r not in got and p.exitcode is not None}
        now = time.monotonic()
        if ended:
            # A result put just before a normal exit may still be on its way.
            ended_at = ended_at or now
            if now - ended_at > grace:
                raise AssertionError(f"ranks ended without a result (rank: exit code): {ended}")
        if now > deadline:
            raise AssertionError(f"no rank reported within {limit:.0f} s")


def run_ranks(scenario, nranks: int, per_host: int = 1, backend: str = "sim", rank_env: dict | None = None,
              errors: bool = False, **options) -> dict:
    """Runs ``scenario`` on ``nranks`` processes, ``per_host`` ranks per
    host id (consecutive ranks share one), rank r with the environment
    variables ``rank_env[r]`` besides; every rank's result by rank, or
    with ``errors``, what each rank raised (its traceback; None where it
    raised nothing)."""
    uid, one_host = dfccl.UniqueId.create(), (str(dfccl.UniqueId.create()), str(dfccl.UniqueId.create()))
    mp_context = mp.get_context("spawn")
    results = mp_context.Queue()
    procs = [mp_context.Process(target=_worker, args=(str(uid), RankContext(r, nranks, backend, one_host, options),
                                                      scenario, results, per_host, (rank_env or {}).get(r, {})))
             for r in range(nranks)]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in procs:
            rank, what, info = _next_result(results, procs, got)
            if errors:
                got[rank] = info if what == "error" else None
                continue
            assert what == "ok", f"rank {rank}:\n{info}"
            got[rank] = info
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return got


# -- peer loss -------------------------------------------------------------------

def _loss_worker(uid: str, rank: int, nranks: int, victim: int, backend: str, peer_timeout: float, queue, leave,
                 op: str, per_host: int, options: dict) -> None:
    """``leave``: set once every survivor reported (a survivor that left
    earlier would itself be a lost peer to a slower one)."""
    try:
        os.environ.update(UCX_ENV)
        from dfccl.bench import arrays

        comm = net_comm(uid, rank, nranks, f"host-{rank // per_host}", backend, peer_timeout=peer_timeout, **options)
        x = arrays.from_numpy(backend, comm.device, np.ones(1 << 16, np.float32))
        comm.all_reduce(x, tag="warm").synchronize(timeout=TIMEOUT)
        if rank == victim:
            queue.put((rank, "ready", None))
            time.sleep(120)    # the test kills or stops us
            os._exit(0)
        t0 = time.monotonic()
        try:
            if op == "recv":
                work = comm.recv(x, victim, tag="work")
            elif op == "ll_all_reduce":
                # Small enough for LL: the survivors poll their areas.
                assert comm.ll_max_bytes >= 32, comm.ll_max_bytes
                small = arrays.from_numpy(backend, comm.device, np.ones(8, np.float32))
                work = comm.all_reduce(small, tag="work")
            elif op == "all_to_all":
                send = arrays.from_numpy(backend, comm.device, np.ones(nranks << 16, np.float32))
                recv = arrays.empty(backend, comm.device, nranks << 16, np.float32, fill=0)
                work = comm.all_to_all(send, recv, tag="work")
            else:
                work = comm.all_reduce(x, tag="work")
            work.synchronize(timeout=TIMEOUT)
            queue.put((rank, "error", "completed without the lost rank"))
            leave.wait(60)
            return
        except dfccl.PeerAbortedError as exc:
            # A hierarchical all-reduce: a rank whose own parts' peers live
            # learns it from the rank that gave its part up.
            elapsed, message = time.monotonic() - t0, str(exc)
            if per_host == 1 or isinstance(exc, dfccl.PeerLostError):
                assert isinstance(exc, dfccl.PeerLostError) and exc.origin == victim, exc
            error, origin = type(exc).__name__, exc.origin
        queue.put((rank, "ok", {"detected_s": elapsed, "message": message, "error": error, "origin": origin}))
        queue.close()
        queue.join_thread()
        leave.wait(60)
        os._exit(0)   # no close: the victim cannot take part in it
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
        leave.wait(60)


def check_remote_loss(how: str, op: str, backend: str = "sim", nranks: int = 3, peer_timeout: float = 3.0,
                      per_host: int = 1, **options) -> dict:
    """The last rank, ``per_host`` ranks on each host, is killed (its
    connection drops: seen at once) or stopped (its heartbeat stops: seen
    within ``peer_timeout``) while the others wait for it in ``op``;
    asserts each survivor's PeerLostError naming it (with several ranks per
    host, a hierarchical all-reduce: a PeerAbortedError, PeerLostError on
    some) and returns what they reported."""
    victim = nranks - 1
    uid = dfccl.UniqueId.create()
    mp_context = mp.get_context("spawn")
    queue, leave = mp_context.Queue(), mp_context.Event()
    procs = [mp_context.Process(target=_loss_worker, args=(str(uid), r, nranks, victim, backend, peer_timeout, queue,
                                                           leave, op, per_host, options), daemon=True)
             for r in range(nranks)]
    for p in procs:
        p.start()
    results = {}
    try:
        deadline = time.monotonic() + 120
        while len(results) < nranks - 1 and time.monotonic() < deadline:
            rank, what, info = queue.get(timeout=120)
            if rank == victim and what == "ready":
                time.sleep(0.2)
                os.kill(procs[victim].pid, signal.SIGKILL if how == "sigkill" else signal.SIGSTOP)
                continue
            results[rank] = (what, info)
    finally:
        leave.set()
        for p in procs:
            if p.is_alive() and p.pid == procs[victim].pid:
                os.kill(p.pid, signal.SIGKILL)
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for r in range(nranks - 1):
        what, info = results[r]
        assert what == "ok", f"rank {r}: {info}"
        if per_host == 1 or info["error"] == "PeerLostError":
            assert f"rank {victim} is lost" in info["message"], info
        assert info["detected_s"] < (2.0 if how == "sigkill" else peer_timeout + 2.0), info
    return {r: info for r, (_what, info) in results.items()}
