"""Ranks on "different hosts" (DFCCL_HOST_ID) in separate processes on the
simulator: every peer is reached through the network proxy over UCX (TCP on
loopback), never through shared memory.  Every ring collective and dtype
from one element to a few MiB, bit-identical to the same collective on one
host; rank-divergent orders; a remote rank killed or stopped is
PeerLostError within peer_timeout."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
import traceback

import importlib.util

import numpy as np
import pytest

import dfccl

needs_ucx = pytest.mark.skipif(importlib.util.find_spec("libucx") is None,
                               reason='the network path needs UCX: pip install "dfccl[net]"')

TIMEOUT = 60
#: UCX over TCP on loopback, whatever else this machine offers.
UCX_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}


def _comm(uid: str, rank: int, nranks: int, host: str, **options):
    os.environ["DFCCL_HOST_ID"] = host
    return dfccl.Communicator(dfccl.UniqueId.from_string(uid), rank, nranks, backend="sim", device=4200 + rank,
                              options=dfccl.CommOptions(**options), timeout=TIMEOUT)


def _sweep_specs():
    """(spec, in_place) of the correctness sweep: every kind and dtype at
    sizes across the slice and the channels, a few MiB for some."""
    from dfccl_support import scenarios as sc

    out = []
    for k, kind in enumerate(sc.KINDS):
        for d, dtype in enumerate(sc.DTYPES):
            esize = np.dtype(dtype).itemsize
            counts = [1, 4099]
            if d % 3 == k % 3:
                counts.append((3 << 20) // esize + 5)     # a few MiB, odd count
            for j, count in enumerate(counts):
                op = "sum" if kind in ("all_gather", "broadcast") else sc.OPS[(k + d + j) % len(sc.OPS)]
                spec = sc.Spec(("net", kind, dtype, count), kind, count, dtype, op, root=(k + d + j) % 3)
                out.append((spec, kind != "reduce" and (d + j) % 2 == 1))
    return out


def _worker(uid: str, one_host_uid: str, rank: int, nranks: int, scenario: str, results) -> None:
    try:
        os.environ.update(UCX_ENV)
        from dfccl_support import scenarios as sc

        comm = _comm(uid, rank, nranks, f"host-{rank}")
        out = {"path": comm.path, "transports": comm.transports}
        if scenario == "sweep":
            # The same collectives on one host (the ring through shared
            # memory): the network must give the same bits.
            local = _comm(one_host_uid, rank, nranks, "one-host", path="ring")
            checked = 0
            for i, (spec, in_place) in enumerate(_sweep_specs()):
                net = sc.RankInstance(spec, comm, 7000 + i, in_place=in_place)
                net.submit().synchronize(timeout=TIMEOUT)
                net.verify()
                ref = sc.RankInstance(spec, local, 7000 + i, in_place=in_place)
                ref.submit().synchronize(timeout=TIMEOUT)
                from dfccl.bench import arrays
                got, want = arrays.to_numpy(net.recv), arrays.to_numpy(ref.recv)
                assert got.tobytes() == want.tobytes(), f"{spec.tag}: not bit-identical to one host"
                checked += 1
            local.close()
            out["checked"] = checked
        elif scenario == "divergent":
            # Tags in opposite orders on even and odd ranks (hangs NCCL), then
            # a queue on one tag behind them.
            kinds = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce")
            specs = [sc.Spec(("d", i), kinds[i % 5], 1000 + 97 * i, "float32", "sum", root=i % nranks)
                     for i in range(10)]
            insts = [sc.RankInstance(s, comm, 100 + i) for i, s in enumerate(specs)]
            order = insts if rank % 2 == 0 else insts[::-1]
            works = [i.submit() for i in order]
            queue = [sc.RankInstance(sc.Spec("q", "all_reduce", 3000, "int32"), comm, 500 + i) for i in range(50)]
            works += [i.submit() for i in queue]
            for w in works:
                w.synchronize(timeout=TIMEOUT)
            for i in insts + queue:
                i.verify()
            out["checked"] = len(insts) + len(queue)
            stats = [w.stats for w in works]
            out["preemptions"] = sum(s["preemptions"] for s in stats)
        elif scenario == "refused":
            from dfccl.bench import arrays
            x = arrays.from_numpy("sim", comm.device, np.ones(4, np.float32))
            with pytest.raises(dfccl.InvalidArgumentError, match="different hosts"):
                comm.send(x, (rank + 1) % nranks)
            out["checked"] = 1
        comm.close()
        results.put((rank, "ok", out))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def _run(scenario: str, nranks: int) -> dict:
    uid, one_host = dfccl.UniqueId.create(), dfccl.UniqueId.create()
    mp_context = mp.get_context("spawn")
    results = mp_context.Queue()
    procs = [mp_context.Process(target=_worker, args=(str(uid), str(one_host), r, nranks, scenario, results))
             for r in range(nranks)]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in procs:
            rank, what, info = results.get(timeout=600)
            assert what == "ok", f"rank {rank}:\n{info}"
            got[rank] = info
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return got


@needs_ucx
def test_every_ring_collective_bit_identical_to_one_host():
    got = _run("sweep", 3)
    for r, info in got.items():
        assert info["path"] == "ring"
        assert info["transports"] == tuple("self" if p == r else "ucx" for p in range(3))
        assert info["checked"] == len(_sweep_specs())


@needs_ucx
@pytest.mark.parametrize("nranks", [2, 4])
def test_divergent_orders_complete(nranks):
    got = _run("divergent", nranks)
    assert all(info["checked"] == 60 for info in got.values())


@needs_ucx
def test_point_to_point_refused_across_hosts():
    _run("refused", 2)


@needs_ucx
def test_bench_net_script(tmp_path):
    """benchmarks/bench_net.py runs both sides and writes its record."""
    import json

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "bench_net.py"), "--iters", "2",
                           "--warmup", "1", "--sizes", "65536", "--perftest-iters", "20", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    rec = json.loads((tmp_path / "net.jsonl").read_text().splitlines()[-1])
    row = rec["results"]["rows"][0]
    assert row["size"] == 65536 and row["broadcast_mib_s"] > 0 and row["ucx_perftest_mib_s"] > 0, row


def test_transports_of_one_process(monkeypatch):
    """Without UCX: ranks of one host id never take the network."""
    monkeypatch.setenv("DFCCL_HOST_ID", "node-a")
    comms = dfccl.Communicator.for_devices([0, 0], backend="sim")
    try:
        assert [c.transports for c in comms] == [("self", "local"), ("local", "self")]
        assert comms[0]._endpoint.describe()["host_id"] == "node-a"
    finally:
        for c in comms:
            c.close()


# -- peer loss -------------------------------------------------------------------
N_LOSS = 3
VICTIM = 2


def _loss_worker(uid: str, rank: int, peer_timeout: float, queue, survivors_done) -> None:
    try:
        os.environ.update(UCX_ENV)
        from dfccl.bench import arrays

        comm = _comm(uid, rank, N_LOSS, f"host-{rank}", peer_timeout=peer_timeout)
        x = arrays.from_numpy("sim", comm.device, np.ones(1 << 16, np.float32))
        comm.all_reduce(x, tag="warm").synchronize(timeout=TIMEOUT)
        if rank == VICTIM:
            queue.put((rank, "ready", None))
            time.sleep(120)    # the test kills or stops us
            os._exit(0)
        t0 = time.monotonic()
        try:
            comm.all_reduce(x, tag="work").synchronize(timeout=TIMEOUT)
            queue.put((rank, "error", "completed without the lost rank"))
            return
        except dfccl.PeerLostError as exc:
            elapsed, message = time.monotonic() - t0, str(exc)
            assert exc.origin == VICTIM, exc
        queue.put((rank, "ok", {"detected_s": elapsed, "message": message}))
        queue.close()
        queue.join_thread()
        # No close, and not before every survivor has seen the loss: a
        # survivor that leaves is itself a lost peer to a slower one.
        survivors_done.wait(timeout=60)
        os._exit(0)
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))


@needs_ucx
@pytest.mark.parametrize("how", ["sigkill", "sigstop"])
def test_remote_peer_lost_within_peer_timeout(how):
    """A killed rank's connection drops (seen at once); a stopped one stops
    its heartbeat (seen within peer_timeout)."""
    peer_timeout = 3.0
    uid = dfccl.UniqueId.create()
    mp_context = mp.get_context("spawn")
    queue = mp_context.Queue()
    survivors_done = mp_context.Barrier(N_LOSS - 1)
    procs = [mp_context.Process(target=_loss_worker, args=(str(uid), r, peer_timeout, queue, survivors_done),
                                daemon=True)
             for r in range(N_LOSS)]
    for p in procs:
        p.start()
    results = {}
    try:
        deadline = time.monotonic() + 120
        while len(results) < N_LOSS - 1 and time.monotonic() < deadline:
            rank, what, info = queue.get(timeout=120)
            if rank == VICTIM and what == "ready":
                time.sleep(0.2)
                os.kill(procs[VICTIM].pid, signal.SIGKILL if how == "sigkill" else signal.SIGSTOP)
                continue
            results[rank] = (what, info)
    finally:
        for p in procs:
            if p.is_alive() and p.pid == procs[VICTIM].pid:
                os.kill(p.pid, signal.SIGKILL)
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for r in range(N_LOSS - 1):
        what, info = results[r]
        assert what == "ok", f"rank {r}: {info}"
        assert f"rank {VICTIM} is lost" in info["message"], info
        # Killed: its connection resets at once; stopped: its heartbeat stops.
        assert info["detected_s"] < (2.0 if how == "sigkill" else peer_timeout + 2.0), info
