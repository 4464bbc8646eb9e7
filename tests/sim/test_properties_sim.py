"""Property-based tests (hypothesis) of the public API on the simulator:
random collectives, sizes, dtypes, ops, tags and per-rank orders complete
with the reference result; random timeouts leave the collective pending and
completable; random aborts and closes finish every Work with a typed error or
the right result, and nothing hangs.  Each example is small; the whole module
takes about a minute."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dfccl
from dfccl_support import scenarios as sc

DEV = 3600          # device ids of this module: 3600..3799
TIMEOUT = 30.0
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce")
DTYPES = ("int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "float32", "float64")
OPS = ("sum", "prod", "min", "max", "avg")

_SETTINGS = settings(max_examples=25, deadline=None, derandomize=True,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

_comms = {}


def _get(n, path):
    key = (n, path)
    if key not in _comms:
        base = DEV + 10 * len(_comms)
        _comms[key] = dfccl.Communicator.for_devices(list(range(base, base + n)), backend="sim",
                                                     options=dfccl.CommOptions(path=path))
    return _comms[key]


@pytest.fixture(scope="module", autouse=True)
def _teardown():
    yield
    for comms in _comms.values():
        sc.settle(comms)


_tags = st.one_of(st.integers(0, 5), st.sampled_from(["a", "b", "c"]), st.tuples(st.just("t"), st.integers(0, 3)))


@st.composite
def _spec(draw, n):
    kind = draw(st.sampled_from(KINDS))
    dtype = draw(st.sampled_from(DTYPES))
    op = draw(st.sampled_from(OPS)) if kind in ("all_reduce", "reduce_scatter", "reduce") else "sum"
    if op == "avg" and "int" in dtype:
        op = "sum"
    return kind, draw(st.integers(0, 3000)), dtype, op, draw(st.integers(0, n - 1))


@st.composite
def _program(draw):
    n = draw(st.integers(2, 3))
    path = draw(st.sampled_from(("direct", "ring")))
    specs = draw(st.lists(_spec(n), min_size=1, max_size=5))
    tags = draw(st.lists(_tags, min_size=len(specs), max_size=len(specs), unique=True))
    orders = [draw(st.permutations(range(len(specs)))) for _ in range(n)]
    in_place = draw(st.lists(st.booleans(), min_size=len(specs), max_size=len(specs)))
    return n, path, specs, tags, orders, in_place


@_SETTINGS
@given(_program(), st.integers(0, 2 ** 32 - 1))
def test_random_collectives_in_random_orders_complete_correctly(program, seed):
    n, path, specs, tags, orders, in_place = program
    comms = _get(n, path)
    rng = np.random.default_rng(seed)
    insts = []
    for (kind, count, dtype, op, root), tag, ip in zip(specs, tags, in_place):
        spec = sc.Spec(("prop", seed, tag), kind, count, dtype, op, root=root)
        insts.append(sc.prepare(spec, comms, rng))
    for r in range(n):
        for i in orders[r]:
            sc.submit(insts[i], comms[r])
    for inst in insts:
        for w in inst.works:
            w.synchronize(timeout=TIMEOUT)
        sc.verify(inst)


@_SETTINGS
@given(st.integers(1, 2000), st.sampled_from(("direct", "ring")), st.floats(0.0, 0.05), st.integers(0, 2))
def test_timeout_leaves_the_collective_pending_and_completable(count, path, timeout, late):
    comms = _get(3, path)
    xs = [np.full(count, r + 1, np.float64) for r in range(3)]
    tag = f"late-{count}-{path}-{timeout!r}-{late}"
    early = [comms[r].all_reduce(xs[r], tag=tag) for r in range(3) if r != late]
    with pytest.raises(dfccl.CollectiveTimeoutError) as info:
        early[0].synchronize(timeout=timeout)
    err = info.value
    # Ranks that have submitted but not run yet have not joined either.
    assert late in err.missing_ranks and err.waiting_on == err.missing_ranks[0]
    assert sorted(err.missing_ranks + err.joined_ranks) == [0, 1, 2] and err.rank in err.joined_ranks
    assert not early[0].done()
    last = comms[late].all_reduce(xs[late], tag=tag)
    for w in early + [last]:
        w.synchronize(timeout=TIMEOUT)
    assert all((x == 6).all() for x in xs)


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(2, 3), st.sampled_from(("direct", "ring")), st.integers(1, 6), st.integers(0, 5000),
       st.sampled_from(("abort", "close")), st.integers(0, 2), st.integers(0, 2 ** 32 - 1))
def test_abort_or_close_mid_traffic_finishes_every_work(n, path, ncoll, count, how, who, seed):
    who = who % n
    base = DEV + 100 + (seed % 50) * 3
    comms = dfccl.Communicator.for_devices(list(range(base, base + n)), backend="sim",
                                           options=dfccl.CommOptions(path=path))
    rng = np.random.default_rng(seed)
    insts = [sc.prepare(sc.Spec(("ab", i), "all_reduce", count + i, "float32", "sum"), comms, rng)
             for i in range(ncoll)]
    for r in range(n):
        for i in rng.permutation(ncoll):
            if r == who and i == ncoll - 1:
                continue   # the aborting rank leaves one collective out: peers wait for it
            sc.submit(insts[i], comms[r])
    getattr(comms[who], how)()
    for inst in insts:
        failed = False
        works = [w for w in inst.works if w is not None]
        for w in works:
            try:
                w.synchronize(timeout=TIMEOUT)
            except (dfccl.AbortedError, dfccl.PeerAbortedError) as exc:
                failed = True
                if isinstance(exc, dfccl.PeerAbortedError):
                    assert exc.origin == who, str(exc)
        if not failed and len(works) == n:
            sc.verify(inst)
    with pytest.raises(dfccl.ClosedError):
        comms[who].all_reduce(np.ones(4, np.float32))
    sc.settle(comms)
