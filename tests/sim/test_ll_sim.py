"""The eager low-latency (LL) protocol on the simulator: which collectives take
it, results for every dtype and op around the size limit (in and out of
place), rank-divergent orders, deep queues on one tag, preemption while
polling, a bucket taken over by another tag while a peer lags, mismatches and
aborts.  One process here; one rank per process in test_multiprocess.py."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import dfccl
from dfccl_support import scenarios as sc
from dfccl._native.layout import KIND_ALL_GATHER, KIND_ALL_REDUCE, KIND_BROADCAST, KIND_REDUCE, KIND_REDUCE_SCATTER
from dfccl._native.layout import TASK_LL
from dfccl.options import CommOptions
from dfccl.planning import default_ll_max_bytes, ll_region_bytes, plan_geometry
from dfccl.tags import home_bucket, tag_key
from dfccl.types import as_data_type

TIMEOUT = 60
LL = 256  # ll_max_bytes of these tests


def _comms(n: int, **kw) -> list[dfccl.Communicator]:
    opts = dict(ll_max_bytes=LL, max_tags=512)
    opts.update(kw)
    return dfccl.Communicator.for_devices(list(range(n)), backend="sim", options=CommOptions(**opts))


@pytest.fixture(scope="module")
def trio():
    comms = _comms(3)
    yield comms
    for c in comms:
        c.close()


def _is_ll(comm, kind: int, count: int, dtype: str) -> bool:
    g = plan_geometry(kind, count, as_data_type(dtype), comm.world_size, comm.channels, comm._direct, comm._options,
                      staged=comm._staged)
    return bool(g.flags & TASK_LL)


# -- planning ------------------------------------------------------------------------
def test_size_table():
    opts = CommOptions(ll_max_bytes=LL).resolved("sim")
    f32 = as_data_type("float32")
    for kind in (KIND_ALL_REDUCE, KIND_ALL_GATHER, KIND_REDUCE_SCATTER):
        g = plan_geometry(kind, LL // 4, f32, 4, 2, True, opts)
        assert g.flags & TASK_LL and g.nchannels == 1 and g.fifo_bytes == 0
        g = plan_geometry(kind, LL // 4, f32, 4, 2, True, opts, staged=True)
        assert g.flags & TASK_LL and g.stage_bytes == 0  # replaces the staged copy
        assert not plan_geometry(kind, LL // 4 + 1, f32, 4, 2, True, opts).flags & TASK_LL
        assert not plan_geometry(kind, 1, f32, 4, 2, False, opts).flags & TASK_LL   # ring communicator
        assert not plan_geometry(kind, 1, f32, 9, 2, True, opts).flags & TASK_LL    # > 8 ranks
        simple = CommOptions(ll_max_bytes=LL, protocol="simple").resolved("sim")
        assert not plan_geometry(kind, 1, f32, 4, 2, True, simple).flags & TASK_LL
    for kind in (KIND_BROADCAST, KIND_REDUCE):  # not symmetric: the direct path
        assert not plan_geometry(kind, 1, f32, 4, 2, True, opts).flags & TASK_LL


def test_default_limit_fits_the_budget():
    for capacity, n, budget in ((8192, 2, 128 << 20), (8192, 8, 128 << 20), (64, 2, 8 << 20), (8192, 2, 8 << 20),
                                (8192, 8, 1000)):
        ll = default_ll_max_bytes(capacity, n, budget)
        assert ll % 16 == 0 and 0 <= ll <= 4096
        assert ll_region_bytes(capacity, n, ll) <= budget or ll == 0
        if ll < 4096:
            assert ll_region_bytes(capacity, n, ll + 16) > budget
    assert default_ll_max_bytes(8192, 2, 128 << 20) >= 1024


def test_options_validation():
    with pytest.raises(dfccl.InvalidArgumentError):
        CommOptions(protocol="fast")
    with pytest.raises(dfccl.InvalidArgumentError):
        CommOptions(ll_max_bytes=-1)
    with pytest.raises(dfccl.InvalidArgumentError):
        CommOptions(ll_max_bytes=True)
    comms = _comms(2, protocol="simple")
    try:
        assert comms[0].ll_max_bytes == 0 and not _is_ll(comms[0], KIND_ALL_REDUCE, 1, "float32")
    finally:
        for c in comms:
            c.close()
    with pytest.raises(dfccl.InvalidArgumentError):
        _comms(2, protocol="ll", path="ring")


# -- results -------------------------------------------------------------------------
def _run_specs(comms, specs, seed, in_place=False, orders=None):
    """Every rank submits its part of every spec (in `orders[rank]` if given);
    waits; checks every element."""
    n = len(comms)
    insts = [[sc.RankInstance(s, c, seed + i, in_place=in_place) for i, s in enumerate(specs)] for c in comms]
    works = []
    for r in range(n):
        order = orders[r] if orders else range(len(specs))
        works += [insts[r][i].submit() for i in order]
    for w in works:
        w.synchronize(timeout=TIMEOUT)
    for r in range(n):
        for inst in insts[r]:
            inst.verify()
    return insts


KINDS3 = ("all_reduce", "all_gather", "reduce_scatter")


@pytest.mark.parametrize("kind", KINDS3)
@pytest.mark.parametrize("in_place", [False, True])
def test_every_dtype_and_op_around_the_limit(trio, kind, in_place):
    specs = []
    ops = sc.OPS if kind != "all_gather" else ("sum",)
    for dtype in sc.DTYPES:
        esize = np.dtype(dtype).itemsize
        for op in ops:
            for count in (1, LL // esize - 1, LL // esize, LL // esize + 1):
                specs.append(sc.Spec(("ll", kind, dtype, op, count, int(in_place)), kind, count, dtype, op))
    assert any(_is_ll(trio[0], KIND_ALL_REDUCE, s.count, s.dtype) for s in specs)
    assert not all(_is_ll(trio[0], KIND_ALL_REDUCE, s.count, s.dtype) for s in specs)
    _run_specs(trio, specs, 17, in_place=in_place)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_rank_counts(n):
    comms = _comms(n, channels=1)
    try:
        specs = [sc.Spec(("n", k), k, 5, "float32", "sum") for k in KINDS3]
        _run_specs(comms, specs, 3)
    finally:
        for c in comms:
            c.close()


def test_divergent_orders_across_tags(trio):
    """Each rank submits the same LL collectives in its own order (NCCL hangs)."""
    rng = np.random.default_rng(5)
    specs = [sc.Spec(("div", i), KINDS3[i % 3], int(rng.integers(1, LL // 8)), ("float32", "int64", "uint8")[i % 3],
                     ("sum", "max", "min")[i % 3]) for i in range(12)]
    orders = [list(rng.permutation(len(specs))) for _ in trio]
    _run_specs(trio, specs, 11, orders=orders)


@pytest.mark.parametrize("wait_each", [False, True])
def test_random_permutations_eight_ranks(wait_each):
    """8 ranks x 32 small collectives of every kind (LL where it applies, the
    direct path for broadcast and reduce), each rank in its own random order,
    from its own thread; with wait_each, the even ranks wait for each
    collective before submitting the next, in one shared order (the pattern
    that hangs NCCL; waiting ranks in different orders would be a deadlock
    of the application itself)."""
    comms = _comms(8, channels=1)
    try:
        rng = np.random.default_rng(21 + wait_each)
        specs = sc.random_specs(rng, 32, nranks=8, max_bytes=LL, prefix=f"perm{int(wait_each)}")
        assert sum(_is_ll(comms[0], KIND_ALL_REDUCE, s.count, s.dtype) for s in specs if s.kind == "all_reduce") > 0
        orders = [list(rng.permutation(len(specs))) for _ in comms]
        if wait_each:
            orders[2::2] = [orders[0]] * 3
        sc.run(comms, specs, orders, rng=rng, threads=True, wait_each=frozenset(range(0, 8, 2)) if wait_each
               else frozenset(), timeout=TIMEOUT)
    finally:
        for c in comms:
            c.close()


def test_many_instances_queued_on_one_tag(trio):
    """300 instances of one tag queued before any completes: the two parities
    of each area alternate, credits hold every push until the receiver took
    the instance two back."""
    n = 300
    spec = sc.Spec("queue", "all_reduce", 9, "float32", "sum")
    insts = [[sc.RankInstance(spec, c, 100 + i) for i in range(n)] for c in trio]
    works = [[inst.submit() for inst in per_rank] for per_rank in insts]
    for per_rank in works:
        for w in per_rank:
            w.synchronize(timeout=TIMEOUT)
    for per_rank in insts:
        for inst in per_rank:
            inst.verify()


def test_mixed_protocols_on_one_tag(trio):
    """Instances of one tag alternate between LL and the direct path."""
    specs = []
    for i in range(10):
        count = 3 if i % 2 == 0 else LL  # LL // 4 + ...: above the limit in float32
        specs.append(sc.Spec("mixed", "all_reduce", count, "float32", "sum"))
    n = len(trio)
    insts = [[sc.RankInstance(s, c, 40 + i) for i, s in enumerate(specs)] for c in trio]
    works = [w for per_rank in insts for w in (inst.submit() for inst in per_rank)]
    for w in works:
        w.synchronize(timeout=TIMEOUT)
    for per_rank in insts:
        for inst in per_rank:
            inst.verify()
    assert n == 3 and _is_ll(trio[0], KIND_ALL_REDUCE, 3, "float32")
    assert not _is_ll(trio[0], KIND_ALL_REDUCE, LL, "float32")


# -- preemption ---------------------------------------------------------------------
def test_preempted_while_polling_is_bit_identical():
    """A rank that arrives late makes the others poll until preempted, many
    times; the result is bit for bit the one of an uninterrupted run."""
    comms = _comms(3, channels=1)
    try:
        spec = sc.Spec("bits", "all_reduce", 50, "float32", "sum")
        results = []
        for late in (False, True):
            insts = [sc.RankInstance(spec, c, 77) for c in comms]
            works = [insts[0].submit(), insts[1].submit()]
            if late:
                time.sleep(0.3)
            works.append(insts[2].submit())
            for w in works:
                w.synchronize(timeout=TIMEOUT)
            if late:
                assert works[0].stats["preemptions"] > 0
            results.append([dfccl.bench.arrays.to_numpy(i.recv).tobytes() for i in insts])
        assert results[0] == results[1]
        assert len(set(results[0])) == 1  # every rank holds the same bits
    finally:
        for c in comms:
            c.close()


# -- bucket reuse ----------------------------------------------------------------------
def _colliding_tags(comm_key: int, capacity: int, count: int) -> list[str]:
    """Tags of the same home bucket."""
    by_home: dict[int, list[str]] = {}
    i = 0
    while True:
        t = f"t{i}"
        h = home_bucket(tag_key(comm_key, t), capacity)
        by_home.setdefault(h, []).append(t)
        if len(by_home[h]) == count:
            return by_home[h]
        i += 1


def test_bucket_taken_over_while_a_peer_lags():
    """Rank 0 finishes tag A, then tag B takes A's bucket (capacity 2, same
    home bucket).  Rank 1 has not yet taken A's lines (its only block is busy
    with a long copy), so B must wait for rank 1's acknowledgement of A
    before it publishes and pushes; then everything completes correctly.
    Both are instance 1 of their tag, so B's lines go to the very area that
    held A's: without the wait they would overwrite A's before rank 1 took
    them, and rank 1's A would never complete."""
    ctx_opts = dfccl.DaemonOptions(blocks=1, base_window_ns=200_000, max_window_ns=1_000_000, adaptive=False)
    # Devices of their own: daemon options are per device and process.
    comms = dfccl.Communicator.for_devices([7790, 7791], backend="sim", options=CommOptions(ll_max_bytes=LL, max_tags=2),
                                           daemon_options=ctx_opts)
    # Another communicator on rank 1's device: one rank, a long copy.
    busy = dfccl.Communicator.for_devices([7791], backend="sim", daemon_options=ctx_opts)[0]
    big = np.ones(96 << 20, dtype=np.uint8)
    big_out = np.zeros_like(big)
    lagged = 0
    try:
        table = comms[0]._endpoint.tags
        for attempt in range(3):
            tag_a, tag_b = _colliding_tags(comms[0]._comm_key, 2, 2 + 2 * attempt)[-2:]
            a = [sc.RankInstance(sc.Spec(tag_a, "all_reduce", 8, "int32", "sum"), c, 1) for c in comms]
            b = [sc.RankInstance(sc.Spec(tag_b, "all_reduce", 8, "int32", "sum"), c, 2) for c in comms]
            w1a = a[1].submit()           # pushes, then polls for rank 0 until preempted
            time.sleep(0.02)
            w_busy = busy.all_reduce(big, big_out)  # holds rank 1's only block
            time.sleep(0.002)
            w0a = a[0].submit()
            bucket_a = table.bucket_of(tag_key(comms[0]._comm_key, tag_a))
            w0a.synchronize(timeout=TIMEOUT)  # rank 1's lines were there
            lagged += not w1a.done()          # rank 1 has not taken rank 0's lines yet
            w0b = b[0].submit()           # takes A's bucket on rank 0
            assert table.bucket_of(tag_key(comms[0]._comm_key, tag_b)) == bucket_a
            w1b = b[1].submit()
            for w in (w0b, w1a, w1b, w_busy):
                w.synchronize(timeout=TIMEOUT)
            for inst in a + b:
                inst.verify()
            assert np.array_equal(big, big_out)
            big_out[:] = 0
            if lagged:
                break
        assert lagged, "rank 1 never lagged: the scenario did not happen"
    finally:
        busy.close()
        for c in comms:
            c.close()


def test_bucket_reuse_stress():
    """Many tags through few buckets, ranks submitting from their own threads
    in shuffled orders: buckets change tags while peers are behind."""
    comms = _comms(3, max_tags=4, channels=1)
    try:
        rng = np.random.default_rng(9)
        errors = []

        def rank_main(r, order, insts):
            try:
                for batch in range(0, len(order), 2):
                    ws = [insts[i].submit() for i in order[batch:batch + 2]]
                    for w in ws:
                        w.synchronize(timeout=TIMEOUT)
                    time.sleep(float(rng.uniform(0, 0.002)) if r == 1 else 0)
            except BaseException as exc:  # reported below
                errors.append(exc)

        for round_ in range(4):
            specs = [sc.Spec(("stress", round_, i), "all_reduce", 4, "int64", "sum") for i in range(8)]
            insts = [[sc.RankInstance(s, c, 1000 * round_ + i) for i, s in enumerate(specs)] for c in comms]
            # Pairs of tags in the same order on every rank (at most 2 pending
            # per rank within 4 buckets), pairs shuffled within themselves.
            orders = []
            for r in range(3):
                order = []
                for p in range(0, 8, 2):
                    pair = [p, p + 1]
                    if (r + round_) % 2:
                        pair.reverse()
                    order += pair
                orders.append(order)
            threads = [threading.Thread(target=rank_main, args=(r, orders[r], insts[r])) for r in range(3)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(TIMEOUT)
            assert not errors, errors
            for per_rank in insts:
                for inst in per_rank:
                    inst.verify()
    finally:
        for c in comms:
            c.close()


# -- failures -------------------------------------------------------------------------
@pytest.mark.parametrize("what", ["dtype", "op", "count", "kind"])
def test_mismatch_on_the_ll_path(what):
    comms = _comms(2)
    try:
        c0, c1 = comms
        a = np.ones(4, np.float32)
        out = [np.zeros(4, np.float32), np.zeros(4, np.float32)]
        w0 = c0.all_reduce(a, out[0], tag="mm")
        if what == "dtype":
            w1 = c1.all_reduce(np.ones(4, np.int32), np.zeros(4, np.int32), tag="mm")
        elif what == "op":
            w1 = c1.all_reduce(a.copy(), out[1], op="max", tag="mm")
        elif what == "count":  # 1000 floats: not LL on rank 1
            w1 = c1.all_reduce(np.ones(1000, np.float32), np.zeros(1000, np.float32), tag="mm")
        else:
            w1 = c1.all_gather(np.ones(2, np.float32), np.zeros(4, np.float32), tag="mm")
        for w in (w0, w1):
            with pytest.raises((dfccl.MismatchError, dfccl.PeerAbortedError)):
                w.synchronize(timeout=TIMEOUT)
        assert any(isinstance(w.exception(), dfccl.MismatchError) for w in (w0, w1))
    finally:
        for c in comms:
            c.close()


def test_abort_while_polling():
    comms = _comms(2)
    try:
        c0, c1 = comms
        w0 = c0.all_reduce(np.ones(4, np.float32), np.zeros(4, np.float32), tag="lonely")
        time.sleep(0.05)
        assert not w0.done()
        c0.abort()
        with pytest.raises(dfccl.AbortedError):
            w0.synchronize(timeout=TIMEOUT)
    finally:
        for c in comms:
            c.close()


def test_peer_abort_reaches_a_polling_rank():
    comms = _comms(3)
    try:
        w0 = comms[0].all_reduce(np.ones(4, np.float32), np.zeros(4, np.float32), tag="pa")
        w1 = comms[1].all_reduce(np.ones(4, np.float32), np.zeros(4, np.float32), tag="pa")
        time.sleep(0.05)
        comms[1].abort()
        with pytest.raises(dfccl.AbortedError):
            w1.synchronize(timeout=TIMEOUT)
        with pytest.raises(dfccl.PeerAbortedError):
            w0.synchronize(timeout=TIMEOUT)
    finally:
        for c in comms:
            c.close()


def test_timeout_names_the_missing_rank():
    comms = _comms(2)
    try:
        w0 = comms[0].all_reduce(np.ones(4, np.float32), np.zeros(4, np.float32), tag="late")
        with pytest.raises(dfccl.CollectiveTimeoutError) as err:
            w0.synchronize(timeout=0.2)
        assert "1" in str(err.value)
        w1 = comms[1].all_reduce(np.ones(4, np.float32), np.zeros(4, np.float32), tag="late")
        for w in (w0, w1):
            w.synchronize(timeout=TIMEOUT)
    finally:
        for c in comms:
            c.close()


def test_abort_after_the_push_reaches_a_later_peer():
    """Rank 0 pushed its lines, then gave the instance up: rank 1, arriving
    later, must not take them (the token line is marked aborted)."""
    comms = _comms(2)
    try:
        w0 = comms[0].all_reduce(np.ones(4, np.float32), np.zeros(4, np.float32), tag="gone")
        time.sleep(0.02)
        comms[0].abort()
        with pytest.raises(dfccl.AbortedError):
            w0.synchronize(timeout=TIMEOUT)
        w1 = comms[1].all_reduce(np.ones(4, np.float32), np.zeros(4, np.float32), tag="gone")
        with pytest.raises(dfccl.PeerAbortedError) as err:
            w1.synchronize(timeout=TIMEOUT)
        assert err.value.origin == 0
    finally:
        for c in comms:
            c.close()


@pytest.mark.parametrize("late", [0, 2])
def test_every_completed_instance_has_published_its_record(trio, late):
    """A rank publishes its record before RECV's first wait, or, when every
    peer's lines are already there (the last rank to arrive), during
    FINISH's move; either way before its completion word.  After each
    instance, every rank's record names it (peers probing for a first
    instance, or for a tag that moved buckets, need it)."""
    x = np.arange(4, dtype=np.float32)
    for i in range(6):
        outs = [np.zeros(4, np.float32) for _ in trio]
        works = [None] * len(trio)
        for r, c in enumerate(trio):
            if r == late:
                continue
            works[r] = c.all_reduce(x + r, outs[r], tag=("published", late))
        time.sleep(0.01)   # the others poll (and have published); `late` finds their lines
        works[late] = trio[late].all_reduce(x + late, outs[late], tag=("published", late))
        for w in works:
            w.synchronize(timeout=TIMEOUT)
        for out in outs:
            np.testing.assert_array_equal(out, 3 * x + 3)
        w = works[late]
        assert _is_ll(trio[late], KIND_ALL_REDUCE, 4, "float32")
        for r, c in enumerate(trio):
            for p in range(len(trio)):
                assert c._diag.published(p, w.key, w.instance) is not None, (i, r, p)
