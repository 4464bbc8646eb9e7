"""The scenarios of dfccl.scenarios, and what only the tests and
benchmarks need besides: fresh simulated devices, running callables side by
side, settling what a test left pending, and one rank's instance of a spec
(for one process per rank)."""

from __future__ import annotations

import itertools
import sys
import threading
import time

import numpy as np

from dfccl.bench import arrays
from dfccl.errors import DfcclError
from dfccl.scenarios import *  # noqa: F401,F403 - the scenarios themselves, under one name for the tests
from dfccl.scenarios import SENTINEL, Spec, assert_close, reduce_reference, verify
from dfccl.scenarios import __all__ as _scenarios_all

__all__ = [*_scenarios_all, "fresh_sim_devices", "sim_ranks_with_streams", "run_concurrently", "settle", "settle_after_abort", "rank_inputs",
           "expected_output", "RankInstance"]



# -- fresh devices -----------------------------------------------------------------
_next_sim_device = itertools.count(100_000, 100)


def fresh_sim_devices(n: int) -> list[int]:
    """``n`` simulated device numbers no other caller in this process gets:
    each simulated device has one daemon per process, created with
    the options of its first user, so tests that need their own daemon
    options (or a daemon to themselves) take fresh ones.  Blocks of 100 from
    100,000 up, clear of the fixed ranges tests use for shared devices."""
    base = next(_next_sim_device)
    if n > 100:
        raise ValueError(f"at most 100 fresh devices per call, not {n}")
    return [base + r for r in range(n)]


def sim_ranks_with_streams(first_device: int, n: int = 2):
    """``n`` ranks on simulator devices ``first_device``.. in one process,
    and a stream on each rank's device: (communicators, streams)."""
    import dfccl
    from dfccl import runtime

    comms = dfccl.Communicator.for_devices(list(range(first_device, first_device + n)), backend="sim")
    streams = [runtime.get_device("sim", first_device + r).create_stream() for r in range(n)]
    return comms, streams


def run_concurrently(targets, *, timeout: float, switch_interval: float = 1e-5) -> None:
    """Runs each callable on a thread of its own, with the interpreter
    switching threads every ``switch_interval`` seconds (so inside submit
    and wait too); returns when all have returned, AssertionError naming
    how many still run after ``timeout`` seconds."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(switch_interval)
    try:
        threads = [threading.Thread(target=t, daemon=True) for t in targets]
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        running = sum(t.is_alive() for t in threads)
        assert running == 0, f"{running} of {len(threads)} threads still run after {timeout} s"
    finally:
        sys.setswitchinterval(interval)


def settle(comms, timeout: float = 10.0) -> None:
    """Aborts and retires whatever a test left pending on ``comms``, then
    closes them (close() is only called once every work is retired)."""
    for c in comms:
        if not c.closed:
            c.abort()
    for c in comms:
        if c.closed or c._endpoint.id is None or c._daemon.closed:
            continue
        for w in c._daemon.pending_works(c._endpoint.id):
            try:
                w.synchronize(timeout=timeout)
            except DfcclError:
                pass
    for c in comms:
        c.close()


def settle_after_abort(insts, timeout: float = 30.0) -> int:
    """After an abort, every collective must finish: fail with AbortedError or
    PeerAbortedError (it was pending when the abort arrived), or have completed
    before the abort reached it, with correct results on every rank.  Returns
    how many Works finished; raises if one hangs or a completed one is wrong."""
    from dfccl.errors import AbortedError, PeerAbortedError

    finished = 0
    for inst in insts:
        failed = 0
        for w in inst.works:
            try:
                w.synchronize(timeout=timeout)
            except (AbortedError, PeerAbortedError):
                failed += 1
            finished += 1
        if failed == 0:
            verify(inst)
    return finished


# -- one rank per process ------------------------------------------------------------
def rank_inputs(spec: Spec, nranks: int, seed: int) -> list[np.ndarray]:
    """Every rank's input of ``spec``, the same in every process for one seed."""
    rng = np.random.default_rng(seed)
    in_count = spec.count * (nranks if spec.kind == "reduce_scatter" else 1)
    return [random_input(rng, spec.dtype, in_count, spec.op) for _ in range(nranks)]


def expected_output(spec: Spec, inputs: list[np.ndarray], rank: int) -> np.ndarray | None:
    """What ``rank`` must hold after ``spec`` (None: its output is not written)."""
    if spec.kind == "all_reduce":
        return reduce_reference(inputs, spec.op)
    if spec.kind == "all_gather":
        return np.concatenate(inputs)
    if spec.kind == "reduce_scatter":
        return reduce_reference(inputs, spec.op)[rank * spec.count:(rank + 1) * spec.count]
    if spec.kind == "broadcast":
        return inputs[spec.root]
    return reduce_reference(inputs, spec.op) if rank == spec.root else None


class RankInstance:
    """One rank's part of ``spec`` in a communicator whose other ranks live in
    other processes: fresh inputs drawn from ``seed``, poisoned output."""

    def __init__(self, spec: Spec, comm, seed: int, in_place: bool = False):
        n, r = comm.world_size, comm.rank
        self.spec, self.comm = spec, comm
        self.inputs = rank_inputs(spec, n, seed)
        out_count = spec.count * (n if spec.kind == "all_gather" else 1)
        self.in_place = in_place and spec.kind != "reduce"
        if self.in_place:
            if spec.kind == "all_gather":
                full = np.full(out_count, SENTINEL, dtype=spec.dtype)
                full[r * spec.count:(r + 1) * spec.count] = self.inputs[r]
                self.recv = arrays.from_numpy(comm.backend, comm.device, full)
                self.send = self.recv[r * spec.count:(r + 1) * spec.count]
            else:
                self.send = arrays.from_numpy(comm.backend, comm.device, self.inputs[r])
                self.recv = self.send[r * spec.count:(r + 1) * spec.count] if spec.kind == "reduce_scatter" \
                    else self.send
        else:
            self.send = arrays.from_numpy(comm.backend, comm.device, self.inputs[r])
            self.recv = arrays.empty(comm.backend, comm.device, out_count, spec.dtype, fill=SENTINEL)
        self.work = None

    def submit(self):
        s, c = self.spec, self.comm
        if s.kind == "all_reduce":
            self.work = c.all_reduce(self.send, self.recv, op=s.op, tag=s.tag)
        elif s.kind == "all_gather":
            self.work = c.all_gather(self.send, self.recv, tag=s.tag)
        elif s.kind == "reduce_scatter":
            self.work = c.reduce_scatter(self.send, self.recv, op=s.op, tag=s.tag)
        elif s.kind == "broadcast":
            self.work = c.broadcast(self.send, self.recv, root=s.root, tag=s.tag)
        else:
            self.work = c.reduce(self.send, self.recv, op=s.op, root=s.root, tag=s.tag)
        return self.work

    def verify(self) -> None:
        s, r, n = self.spec, self.comm.rank, self.comm.world_size
        want = expected_output(s, self.inputs, r)
        got = arrays.to_numpy(self.recv)
        if want is None:
            if not np.all(got == np.array(SENTINEL, dtype=s.dtype)):
                raise AssertionError(f"{s.tag}: reduce wrote the output of non-root rank {r}")
            return
        assert_close(got, want, s.dtype, s.op, n, f"{s.kind} {s.tag!r} {s.dtype} {s.op} count={s.count} rank {r}"
                     f"{' in place' if self.in_place else ''} path {self.comm.path}")
