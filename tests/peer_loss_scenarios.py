"""Peer-loss scenarios with one rank per process, shared by the simulator
(test_peer_loss_sim.py) and GPU (test_peer_loss_gpu.py) tests: a victim
that exits, is killed or stops, and the survivors that must report it."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import traceback

__all__ = ["check_dead_peer_reported"]

N = 3
VICTIM = 2
DEV = 3100


def _worker(uid: str, rank: int, how: str, peer_timeout, queue, detected, backend: str = "sim",
            path: str = "ring") -> None:
    try:
        import numpy as np

        import dfccl
        from dfccl import liveness, runtime
        from dfccl.bench import arrays

        device = DEV + rank if backend == "sim" else rank % runtime.cuda_device_count()

        def ones(n):
            return arrays.from_numpy(backend, device, np.ones(n, np.float32))

        opts = dfccl.CommOptions(path=path, peer_timeout=peer_timeout)
        comm = dfccl.Communicator(dfccl.UniqueId.from_string(uid), rank, N, backend=backend, device=device,
                                  options=opts, timeout=60)
        x = ones(1024)
        comm.all_reduce(x, tag="warm").synchronize(timeout=60)
        if rank == VICTIM:
            # Its status file stands before it dies: a survivor's monitor
            # that sees it exit removes it.
            deadline = time.monotonic() + 10
            while not os.path.exists(liveness.status_path()) and time.monotonic() < deadline:
                time.sleep(0.01)
            if how == "exit_during":
                comm.all_reduce(ones(1 << 16), tag="work")
                time.sleep(0.05)
                os._exit(3)
            if how == "exit_between":
                os._exit(0)
            queue.put((rank, "ready", None))
            time.sleep(120)          # the test kills or stops us
            os._exit(0)
        # A second communicator on the same daemon, in this process only.
        local = dfccl.Communicator.for_devices([device, device], backend=backend)
        # "work" may complete when the victim did its part before dying;
        # "work2" cannot (the victim never submits it).
        elapsed = None
        for tag in ("work", "work2"):
            t0 = time.monotonic()
            try:
                comm.all_reduce(ones(1 << 16), tag=tag).synchronize(timeout=60)
            except dfccl.PeerLostError as exc:
                elapsed = time.monotonic() - t0
                assert exc.origin == VICTIM and exc.peer == VICTIM, exc
                assert f"rank {VICTIM}" in str(exc)
                break
            if tag == "work2" or how != "exit_during":
                queue.put((rank, "error", f"{tag} completed without the lost rank"))
                return
        # Every survivor has seen the loss before any goes on to close: a
        # survivor that closes (or exits) is itself gone for the slower ones,
        # which could then rightly report it instead of the victim.
        detected.wait(timeout=60)
        try:
            comm.all_reduce(x, tag="after")
            queue.put((rank, "error", "submission after the loss was accepted"))
            return
        except dfccl.PeerLostError as exc:
            assert exc.origin == VICTIM
        st = comm.status()
        assert st.state == f"peer rank {VICTIM} lost", st
        assert any(e["event"] == "peer_lost" for e in st.recent)
        ys = [arrays.from_numpy(backend, device, np.full(64, i + 1, np.float32)) for i in range(2)]
        for ww in [c.all_reduce(y) for c, y in zip(local, ys)]:
            ww.synchronize(timeout=30)
        assert (arrays.to_numpy(ys[0]) == 3).all()
        for c in local:
            c.close()
        t1 = time.monotonic()
        comm.close()
        queue.put((rank, "ok", {"detected_s": elapsed, "close_s": time.monotonic() - t1}))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))


def check_dead_peer_reported(how: str, peer_timeout: float, bound: float, backend: str, path: str) -> None:
    """N ranks, one per process; the victim dies or stops as ``how`` says;
    every survivor must report PeerLostError within ``bound`` seconds, keep
    its other communicator working and close within 5 s.  The victim's
    status file is gone once the survivors are done: removed by their
    monitor when they see its process exit, or, for a stopped victim, which
    the test kills afterwards, by the next sweep."""
    import dfccl
    from dfccl import liveness

    uid = dfccl.UniqueId.create()
    mp_context = mp.get_context("spawn")
    # One queue per rank: a stopped process may hold a shared queue's lock.
    queues = [mp_context.Queue() for _ in range(N)]
    detected = mp_context.Barrier(N - 1)
    procs = [mp_context.Process(target=_worker, args=(str(uid), r, how, peer_timeout, queues[r], detected, backend, path),
                                daemon=True)
             for r in range(N)]
    for p in procs:
        p.start()
    results = {}
    try:
        deadline = time.monotonic() + 120
        while len([r for r in results if r != VICTIM]) < N - 1 and time.monotonic() < deadline:
            got = None
            for q in queues:
                try:
                    got = q.get_nowait()
                    break
                except Exception:
                    continue
            if got is None:
                time.sleep(0.05)
                continue
            rank, what, info = got
            if rank == VICTIM and what == "ready":
                os.kill(procs[VICTIM].pid, signal.SIGKILL if how == "sigkill" else signal.SIGSTOP)
                continue
            results[rank] = (what, info)
    finally:
        if how == "sigstop" and procs[VICTIM].is_alive():
            os.kill(procs[VICTIM].pid, signal.SIGKILL)
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for r in range(N - 1):
        assert r in results, f"rank {r} did not report (hung?): {results}"
        what, info = results[r]
        assert what == "ok", f"rank {r}: {info}"
        assert info["detected_s"] < bound, f"rank {r} saw the loss after {info['detected_s']:.1f} s"
        assert info["close_s"] < 5.0
    victim_file = liveness.status_path(procs[VICTIM].pid)
    if how == "sigstop":
        liveness.sweep()   # what `dfccl status` or the next process's monitor does
    assert not os.path.exists(victim_file), "the victim's status file was left behind"
