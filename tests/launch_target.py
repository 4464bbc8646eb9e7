"""A rank of the jobs tests (tests/sim/test_jobs.py), started by
``python -m dfccl.launch``: ``launch_target.py SCENARIO``.  Prints
``RESULT <json>`` on success; any failure exits non-zero."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np

import dfccl
from dfccl.bench import arrays

TIMEOUT = 60


def on(comm: dfccl.Communicator, host: np.ndarray):
    """A copy of ``host`` where the communicator's backend needs it (device
    memory on GPUs)."""
    return arrays.from_numpy(comm.backend, comm.device, host)


def tp_dp(comm: dfccl.Communicator) -> dict:
    """TP = {0,1},{2,3}, DP = {0,2},{1,3} over 4 ranks; each rank issues its
    TP and DP collectives in an order that differs between ranks."""
    r = comm.rank
    tp = comm.split(r // 2, key=r)
    dp = comm.split(r % 2, key=r)
    nobody = comm.split(None if r == 3 else 0, key=-r)   # rank 3 opts out; order reversed by key
    rounds = 20
    tp_bufs = [on(comm, np.full(1000 + i, (r + 1) * (i + 1), np.float32)) for i in range(rounds)]
    dp_bufs = [on(comm, np.full(77, r + 10 * i, np.int64)) for i in range(rounds)]
    dp_out = [arrays.empty(comm.backend, comm.device, 77 * 2, np.int64, fill=-1) for _ in range(rounds)]
    works = []
    for i in range(rounds):
        a = lambda i=i: tp.all_reduce(tp_bufs[i], tag=("tp", i))
        b = lambda i=i: dp.all_gather(dp_bufs[i], dp_out[i], tag=("dp", i))
        # Ranks 0 and 3 issue TP first, 1 and 2 DP first; odd rounds flip it.
        first_tp = (r in (0, 3)) ^ (i % 2 == 1)
        works += [a(), b()] if first_tp else [b(), a()]
    for w in works:
        w.synchronize(timeout=TIMEOUT)
    tp_peers = [2 * (r // 2), 2 * (r // 2) + 1]
    dp_peers = [r % 2, r % 2 + 2]
    for i in range(rounds):
        got = arrays.to_numpy(tp_bufs[i])
        assert (got == sum((p + 1) * (i + 1) for p in tp_peers)).all(), ("tp", i, got[:4])
        want = np.concatenate([np.full(77, p + 10 * i, np.int64) for p in dp_peers])
        assert (arrays.to_numpy(dp_out[i]) == want).all(), ("dp", i)
    out = {"rank": r, "tp": [tp.rank, tp.world_size], "dp": [dp.rank, dp.world_size], "path": tp.path,
           "nobody": None if nobody is None else [nobody.rank, nobody.world_size]}
    if nobody is not None:
        x = on(comm, np.full(10, r, np.int32))
        nobody.all_reduce(x, op="max").synchronize(timeout=TIMEOUT)
        assert (arrays.to_numpy(x) == 2).all()
        nobody.close()
    tp.close()
    dp.close()
    return out


def fork(comm: dfccl.Communicator) -> dict:
    """Rank 0 forks a child that exits normally (its exit handlers run) while
    a collective of rank 0 is pending; the peers' status pages, arenas and
    store are the parent's and must stay untouched."""
    r, n = comm.rank, comm.world_size
    x = on(comm, np.full(1000, r + 1, np.float32))
    w = comm.all_reduce(x, tag="across the fork")
    exit_s = None
    if r == 0:
        t0 = time.monotonic()
        pid = os.fork()
        if pid == 0:
            sys.exit(0)   # a normal exit: the exit handlers run
        os.waitpid(pid, 0)
        exit_s = time.monotonic() - t0
    w.synchronize(timeout=TIMEOUT)
    assert (arrays.to_numpy(x) == n * (n + 1) / 2).all()
    time.sleep(0.5)   # a peer that saw rank 0 closed or lost would fail what follows
    y = on(comm, np.full(77, r + 1, np.float32))
    comm.all_reduce(y, tag="after").synchronize(timeout=TIMEOUT)
    assert (arrays.to_numpy(y) == n * (n + 1) / 2).all()
    return {"rank": r, "child_exit_s": exit_s}


def device_fault(comm: dfccl.Communicator) -> dict:
    """Rank 0's (simulated) device fails while every other rank waits for
    it; rank 0's process stays alive meanwhile, so what the others see is
    the fault itself (its status page), not an exit."""
    r = comm.rank
    x = on(comm, np.ones(64, np.float32))
    out: dict = {"rank": r}
    if r == 0:
        w = comm.all_reduce(x, tag="rank 0 alone")   # keeps its watcher looking
        time.sleep(0.2)
        comm._daemon.device.inject_fault(700)
        try:
            w.synchronize(timeout=TIMEOUT)
        except dfccl.BackendError as exc:
            out["error"] = type(exc).__name__
        time.sleep(3.0)
    else:
        t0 = time.monotonic()
        try:
            comm.all_reduce(x, tag="waits for rank 0").synchronize(timeout=TIMEOUT)
        except dfccl.PeerLostError as exc:
            out["error"], out["message"], out["origin"] = type(exc).__name__, str(exc), exc.origin
        out["seconds"] = time.monotonic() - t0
    return out


def stuck() -> int:
    """Rank 1 cannot be ended by a signal other than SIGKILL: STUCK_HOW=stop
    stops it (SIGSTOP), =ignore makes it ignore SIGTERM and SIGINT.  The
    other ranks wait two minutes, or with STUCK_OTHERS=fail, rank 0 fails
    once rank 1 is about to stop (it creates $STUCK_MARK first).  Every rank
    prints its pid first."""
    rank = int(os.environ["RANK"])
    mark = os.environ.get("STUCK_MARK")
    if rank == 1:
        how = os.environ.get("STUCK_HOW", "stop")
        if how == "ignore":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        print(f"pid {os.getpid()} stuck ({how})", flush=True)
        if mark:
            open(mark, "w").close()
        if how == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(120)
        return 0
    print(f"pid {os.getpid()} waiting", flush=True)
    if rank == 0 and os.environ.get("STUCK_OTHERS") == "fail":
        deadline = time.monotonic() + 60
        while not os.path.exists(mark) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)   # rank 1 has stopped by now
        print("rank 0 fails now", flush=True)
        return 3
    time.sleep(120)
    return 0


def main() -> int:
    scenario = sys.argv[1]
    if scenario == "fail":
        # Rank $RANK_THAT_FAILS (default 1; "none": no rank) fails at once;
        # the others would run for a minute.
        if os.environ["RANK"] == os.environ.get("RANK_THAT_FAILS", "1"):
            print(f"rank {os.environ['RANK']} fails now", flush=True)
            return 3
        time.sleep(60)
        return 0
    if scenario == "stuck":
        return stuck()
    comm = dfccl.init_from_env(timeout=TIMEOUT)
    print(f"up: rank {comm.rank} of {comm.world_size} on {comm.backend}:{comm.device} path={comm.path}", flush=True)
    if scenario == "all_reduce":
        x = on(comm, np.full(4099, comm.rank + 1, np.float32))
        comm.all_reduce(x).synchronize(timeout=TIMEOUT)
        n = comm.world_size
        assert (arrays.to_numpy(x) == n * (n + 1) / 2).all()
        out = {"rank": comm.rank, "size": n, "device": comm.device, "path": comm.path}
    elif scenario == "tp_dp":
        out = tp_dp(comm)
    elif scenario == "fork":
        out = fork(comm)
    elif scenario == "device_fault":
        out = device_fault(comm)
    elif scenario == "register":
        from registration_target import run_register
        out = run_register(comm)
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    comm.close()
    print("RESULT " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
