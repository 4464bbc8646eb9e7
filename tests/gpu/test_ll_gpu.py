"""The LL protocol on a GPU (marker ``gpu``): two ranks sharing one GPU (or on
two), every kind and dtype around the size limit, in and out of place,
divergent orders, a deep queue on one tag, preemption while polling
(bit-identical results), a bucket taken over while a peer lags, mismatch and
abort; one rank per process in test_multiprocess.py (``ll`` scenario)."""

from __future__ import annotations

import time

import numpy as np
import pytest

import dfccl
from dfccl import runtime
from dfccl.bench import arrays
from dfccl_support import scenarios as sc
from dfccl._native.layout import KIND_ALL_REDUCE, TASK_LL
from dfccl.planning import plan_geometry
from dfccl.types import as_data_type

pytestmark = pytest.mark.gpu

TIMEOUT = 60
LL = 4096


def _devices(n: int) -> list[int]:
    k = runtime.cuda_device_count()
    return [r % k for r in range(n)]


def _comms(n: int = 2, **kw):
    opts = dict(ll_max_bytes=LL, max_tags=256)
    opts.update(kw)
    return dfccl.Communicator.for_devices(_devices(n), backend="cuda", options=dfccl.CommOptions(**opts))


@pytest.fixture(scope="module")
def pair():
    comms = _comms(2)
    yield comms
    for c in comms:
        c.close()


def _run(comms, specs, seed, in_place=False, orders=None):
    insts = [[sc.RankInstance(s, c, seed + i, in_place=in_place) for i, s in enumerate(specs)] for c in comms]
    works = []
    for r in range(len(comms)):
        for i in (orders[r] if orders else range(len(specs))):
            works.append(insts[r][i].submit())
    for w in works:
        w.synchronize(timeout=TIMEOUT)
    for per_rank in insts:
        for inst in per_rank:
            inst.verify()
    return works


def test_ll_is_planned(pair):
    g = plan_geometry(KIND_ALL_REDUCE, 2, as_data_type("float32"), 2, pair[0].channels, True, pair[0]._options)
    assert g.flags & TASK_LL and g.nchannels == 1
    assert pair[0].ll_max_bytes == LL


@pytest.mark.parametrize("kind", ["all_reduce", "all_gather", "reduce_scatter"])
@pytest.mark.parametrize("in_place", [False, True])
def test_every_dtype_and_op_around_the_limit(pair, kind, in_place):
    specs = []
    for dtype in sc.DTYPES:
        esize = np.dtype(dtype).itemsize
        for op in (sc.OPS if kind != "all_gather" else ("sum",)):
            for count in (1, 3, LL // esize - 1, LL // esize, LL // esize + 1):
                specs.append(sc.Spec(("g", kind, dtype, op, count, int(in_place)), kind, count, dtype, op))
    _run(pair, specs, 5, in_place=in_place)


def test_divergent_orders(pair):
    rng = np.random.default_rng(1)
    specs = [sc.Spec(("d", i), ("all_reduce", "all_gather", "reduce_scatter")[i % 3], int(rng.integers(1, 300)),
                     "float32", "sum") for i in range(24)]
    _run(pair, specs, 9, orders=[list(range(24)), list(range(23, -1, -1))])


def test_queue_on_one_tag(pair):
    spec = sc.Spec("q", "all_reduce", 2, "float32", "sum")
    _run(pair, [spec] * 500, 3)


def test_preempted_while_polling_is_bit_identical():
    comms = _comms(2)
    try:
        spec = sc.Spec("bits", "all_reduce", 1000, "float32", "sum")
        got = []
        for late in (False, True):
            insts = [sc.RankInstance(spec, c, 77) for c in comms]
            w0 = insts[0].submit()
            if late:
                time.sleep(0.05)
            w1 = insts[1].submit()
            for w in (w0, w1):
                w.synchronize(timeout=TIMEOUT)
            if late:
                assert w0.stats["preemptions"] > 0
            got.append([arrays.to_numpy(i.recv).tobytes() for i in insts])
        assert got[0] == got[1] and got[0][0] == got[0][1]
    finally:
        for c in comms:
            c.close()


def test_many_tags_through_few_buckets():
    """Buckets change tags over and over (max_tags=4) while the ranks race."""
    comms = _comms(2, max_tags=4)
    try:
        for round_ in range(50):
            specs = [sc.Spec(("few", round_, i), "all_reduce", 16, "int32", "sum") for i in range(2)]
            _run(comms, specs, round_, orders=[[0, 1], [1, 0]])
    finally:
        for c in comms:
            c.close()


def test_mismatch_and_abort(pair):
    c0, c1 = pair
    a0 = arrays.from_numpy("cuda", c0.device, np.ones(4, np.float32))
    a1 = arrays.from_numpy("cuda", c1.device, np.ones(4, np.int32))
    w0, w1 = c0.all_reduce(a0, tag="mm"), c1.all_reduce(a1, tag="mm")
    for w in (w0, w1):
        with pytest.raises((dfccl.MismatchError, dfccl.PeerAbortedError)):
            w.synchronize(timeout=TIMEOUT)
    comms = _comms(2)
    try:
        x = arrays.from_numpy("cuda", comms[0].device, np.ones(4, np.float32))
        w = comms[0].all_reduce(x, tag="alone")
        time.sleep(0.05)
        comms[0].abort()
        with pytest.raises(dfccl.AbortedError):
            w.synchronize(timeout=TIMEOUT)
    finally:
        for c in comms:
            c.close()
