"""Deadlock scenarios: sets of collectives that ranks issue in different orders,
with fresh random inputs and numpy references.  Used by ``dfccl demo`` and
``dfccl bench`` (and by the test suites and benchmarks, whose own helpers
live outside the package), on the simulator (numpy arrays) and on GPUs
(device arrays).

A scenario is a list of collective specs and, per rank, the order in which that
rank submits them.  ``run`` submits (optionally from one thread per rank, and
optionally waiting for each collective before submitting the next), waits for
everything, checks every output element, and reports preemption counters.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np

from dfccl.bench import arrays

__all__ = ["Spec", "Report", "random_input", "reduce_reference", "tolerance", "assert_close", "random_specs",
           "prepare", "submit", "verify", "run", "KINDS", "OPS", "DTYPES", "SENTINEL"]

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce")
OPS = ("sum", "prod", "min", "max", "avg")
DTYPES = ("int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "float32", "float64")
SENTINEL = 77


# -- references --------------------------------------------------------------------
def random_input(rng: np.random.Generator, dtype: str, count: int, op: str) -> np.ndarray:
    """Fresh random data, never all zeros.  Products use values near 1 (floats)
    or small magnitudes (integers) so that results stay meaningful."""
    dt = np.dtype(dtype)
    if dt.kind == "f":
        if op == "prod":
            return rng.uniform(0.5, 1.5, count).astype(dt)
        return rng.standard_normal(count).astype(dt)
    info = np.iinfo(dt)
    lo, hi = (max(info.min, -100), min(info.max, 100)) if op == "prod" else (info.min, info.max)
    return rng.integers(lo, hi, count, dtype=dt, endpoint=True)


def reduce_reference(inputs: list[np.ndarray], op: str) -> np.ndarray:
    """op over ranks with dfccl's semantics: integers wrap like their type,
    float16 accumulates in float32, AVG divides the sum once (C's truncating
    division for integers)."""
    dt = inputs[0].dtype
    acc = np.stack(inputs).astype(np.float32) if dt.kind == "f" and dt.itemsize < 4 else np.stack(inputs)
    with np.errstate(over="ignore"):
        if op in ("sum", "avg"):
            r = np.add.reduce(acc, axis=0, dtype=acc.dtype)
        elif op == "prod":
            r = np.multiply.reduce(acc, axis=0, dtype=acc.dtype)
        elif op == "min":
            r = np.minimum.reduce(acc, axis=0)
        else:
            r = np.maximum.reduce(acc, axis=0)
        if op == "avg":
            n = len(inputs)
            if dt.kind == "f":
                r = r / np.array(n, dtype=acc.dtype)
            elif dt.kind == "u":
                r = r // n
            else:
                q = np.abs(r.astype(np.int64)) // n if dt.itemsize < 8 else np.abs(r) // n
                r = np.where(r < 0, -q, q)
    return r.astype(dt)


def tolerance(dtype: str, op: str, nranks: int) -> float:
    dt = np.dtype(dtype)
    if dt.kind != "f":
        return 0.0
    eps = {2: 1e-2, 4: 1e-5, 8: 1e-12}[dt.itemsize]
    return eps * max(1, nranks) * (4 if op == "prod" else 1)


def assert_close(got: np.ndarray, want: np.ndarray, dtype: str, op: str, nranks: int, what: str = "") -> None:
    """Integers exactly; floats within ``tolerance``; NaN never passes."""
    tol = tolerance(dtype, op, nranks)
    if tol == 0.0:
        bad = np.flatnonzero(got != want)
        if bad.size:
            raise AssertionError(f"{what}: {bad.size} wrong elements, first at {bad[0]}: got {got[bad[0]]}, "
                                 f"want {want[bad[0]]}")
        return
    g = got.astype(np.float64)
    w = want.astype(np.float64)
    if not np.all(np.isfinite(g)):
        raise AssertionError(f"{what}: {int(np.sum(~np.isfinite(g)))} non-finite elements (unwritten output?)")
    err = np.abs(g - w) / (np.abs(w) + 1.0)
    if err.max(initial=0.0) > tol:
        i = int(err.argmax())
        raise AssertionError(f"{what}: relative error {err[i]:.3g} > {tol:.3g} at {i}: got {g[i]}, want {w[i]}")


# -- specs -------------------------------------------------------------------------
@dataclass(frozen=True)
class Spec:
    """One collective.  ``count``: elements of the buffer for all_reduce,
    broadcast and reduce; each rank's contribution for all_gather; each rank's
    result for reduce_scatter."""

    tag: object
    kind: str
    count: int
    dtype: str = "float32"
    op: str = "sum"
    root: int = 0


def random_specs(rng: np.random.Generator, n: int, *, nranks: int, min_bytes: int = 4, max_bytes: int = 4 << 20,
                 kinds=KINDS, dtypes=("float32", "int32", "float16", "int64"), prefix: str = "c") -> list[Spec]:
    """``n`` collectives of mixed kinds, log-uniform sizes in [min_bytes, max_bytes]."""
    specs = []
    for i in range(n):
        kind = kinds[int(rng.integers(len(kinds)))]
        dtype = dtypes[int(rng.integers(len(dtypes)))]
        size = np.dtype(dtype).itemsize
        nbytes = int(np.exp(rng.uniform(np.log(max(min_bytes, size)), np.log(max_bytes))))
        count = max(1, nbytes // size)
        if kind in ("all_gather", "reduce_scatter"):
            count = max(1, count // nranks)
        op = "sum" if kind in ("all_gather", "broadcast") else OPS[int(rng.integers(len(OPS)))]
        if np.dtype(dtype).kind == "f" and np.dtype(dtype).itemsize == 2 and op == "prod":
            op = "max"
        specs.append(Spec(f"{prefix}{i}", kind, count, dtype, op, int(rng.integers(nranks))))
    return specs


# -- one instance of a spec ----------------------------------------------------------
@dataclass
class _Instance:
    spec: Spec
    inputs: list[np.ndarray]
    sends: list
    recvs: list
    works: list = field(default_factory=list)


def prepare(spec: Spec, comms, rng) -> _Instance:
    """Fresh random inputs on every rank and poisoned outputs for ``spec``."""
    n = len(comms)
    in_count = spec.count * (n if spec.kind == "reduce_scatter" else 1)
    out_count = spec.count * (n if spec.kind == "all_gather" else 1)
    inputs = [random_input(rng, spec.dtype, in_count, spec.op) for _ in range(n)]
    sends, recvs = [], []
    for r, c in enumerate(comms):
        sends.append(arrays.from_numpy(c.backend, c.device, inputs[r]))
        recvs.append(arrays.empty(c.backend, c.device, out_count, spec.dtype, fill=SENTINEL))
    return _Instance(spec, inputs, sends, recvs, [None] * n)


def submit(inst: _Instance, comm):
    """Submits ``comm``'s part of the instance; returns its Work."""
    s = inst.spec
    r = comm.rank
    send, recv = inst.sends[r], inst.recvs[r]
    if s.kind == "all_reduce":
        w = comm.all_reduce(send, recv, op=s.op, tag=s.tag)
    elif s.kind == "all_gather":
        w = comm.all_gather(send, recv, tag=s.tag)
    elif s.kind == "reduce_scatter":
        w = comm.reduce_scatter(send, recv, op=s.op, tag=s.tag)
    elif s.kind == "broadcast":
        w = comm.broadcast(send, recv, root=s.root, tag=s.tag)
    else:
        w = comm.reduce(send, recv, op=s.op, root=s.root, tag=s.tag)
    inst.works[r] = w
    return w


def verify(inst: _Instance) -> None:
    """Checks every rank's output against numpy (AssertionError on mismatch)."""
    s = inst.spec
    n = len(inst.inputs)
    total = None
    for r in range(n):
        got = arrays.to_numpy(inst.recvs[r])
        if s.kind == "all_reduce":
            total = reduce_reference(inst.inputs, s.op) if total is None else total
            want = total
        elif s.kind == "all_gather":
            want = np.concatenate(inst.inputs)
        elif s.kind == "reduce_scatter":
            total = reduce_reference(inst.inputs, s.op) if total is None else total
            want = total[r * s.count:(r + 1) * s.count]
        elif s.kind == "broadcast":
            want = inst.inputs[s.root]
        else:
            if r != s.root:
                if not np.all(got == np.array(SENTINEL, dtype=s.dtype)):
                    raise AssertionError(f"{s.tag}: reduce wrote the output of non-root rank {r}")
                continue
            want = reduce_reference(inst.inputs, s.op)
        assert_close(got, want, s.dtype, s.op, n, f"{s.kind} {s.tag!r} {s.dtype} {s.op} count={s.count} rank {r}")


# -- running a scenario ----------------------------------------------------------------
@dataclass
class Report:
    seconds: float
    collectives: int
    preemptions: dict        # tag -> preemptions summed over ranks
    resumes: dict
    orders: list             # per rank, the tags in submission order

    @property
    def total_preemptions(self) -> int:
        return sum(self.preemptions.values())


def run(comms, specs: list[Spec], orders: list[list[int]], *, rng=None, threads: bool = False,
        wait_each: set | frozenset = frozenset(), timeout: float = 120.0, rounds: int = 1,
        between=None) -> Report:
    """Submits ``specs`` on every rank in its order (indices into specs),
    waits, verifies every output and returns the counters.

    threads: submit from one thread per rank (else one thread, rank by rank).
    wait_each: ranks that wait for each collective before submitting the next
        (the pattern that hangs NCCL through synchronisation).
    between: optional callable(rank, index) run before each submission (e.g.
        a device-wide synchronise).
    rounds: repeat with fresh inputs."""
    rng = rng if rng is not None else np.random.default_rng()
    n = len(comms)
    if len(orders) != n:
        raise ValueError("one order per rank")
    if wait_each and not threads:
        raise ValueError("wait_each needs threads=True: one thread cannot wait for a collective its peers have "
                         "not been given yet")
    pre = {s.tag: 0 for s in specs}
    res = {s.tag: 0 for s in specs}
    t0 = time.perf_counter()
    for _ in range(rounds):
        insts = [prepare(s, comms, rng) for s in specs]
        errors: list[BaseException] = []

        def drive(rank: int):
            try:
                for k, idx in enumerate(orders[rank]):
                    if between is not None:
                        between(rank, k)
                    w = submit(insts[idx], comms[rank])
                    if rank in wait_each:
                        w.synchronize(timeout=timeout)
            except BaseException as exc:  # reported by the caller's thread
                errors.append(exc)

        if threads:
            ts = [threading.Thread(target=drive, args=(r,), name=f"rank{r}") for r in range(n)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
        else:
            for r in range(n):
                drive(r)
        if errors:
            raise errors[0]
        for inst in insts:
            for w in inst.works:
                w.synchronize(timeout=timeout)
        for inst in insts:
            verify(inst)
            for w in inst.works:
                pre[inst.spec.tag] += w.stats["preemptions"]
                res[inst.spec.tag] += w.stats["resumes"]
    return Report(time.perf_counter() - t0, len(specs) * rounds, pre, res,
                  [[specs[i].tag for i in order] for order in orders])
