"""Point to point and all-to-all on a GPU (marker ``gpu``): two ranks of one
process on one device (``for_devices([0, 0])``; on two devices with
``multigpu``), on the direct path (the receiver reads the sender's buffer in
place) and the ring path (the sender pushes through the receiver's FIFO; the
all-to-all reads arena copies).  Two processes on one device are covered by
tests/sim/test_multiprocess.py (test_point_to_point_one_process_per_gpu)."""

from __future__ import annotations

import time

import numpy as np
import pytest

import dfccl
from dfccl import runtime
from dfccl.bench import arrays
from dfccl_support import scenarios as sc

pytestmark = pytest.mark.gpu
TIMEOUT = 60


def _devices(two_gpus: bool) -> list[int]:
    if two_gpus:
        if runtime.cuda_device_count() < 2:
            pytest.skip("needs two GPUs")
        return [0, 1]
    return [0, 0]


@pytest.fixture(params=[("direct", False), ("ring", False),
                        pytest.param(("direct", True), marks=pytest.mark.multigpu),
                        pytest.param(("ring", True), marks=pytest.mark.multigpu)],
                ids=lambda p: f"{p[0]}-{'2gpu' if p[1] else '1gpu'}")
def comms(request):
    path, two = request.param
    cs = dfccl.Communicator.for_devices(_devices(two), backend="cuda", options=dfccl.CommOptions(path=path))
    yield cs
    for c in cs:
        c.close()


def _msg(src: int, dst: int, salt: int, count: int, dtype="float32") -> np.ndarray:
    return sc.random_input(np.random.default_rng([src, dst, salt]), dtype, count, "sum")


def _dev(c, host: np.ndarray):
    return arrays.from_numpy("cuda", c.device, host)


def _empty(c, count: int, dtype="float32"):
    return arrays.empty("cuda", c.device, count, dtype, fill=sc.SENTINEL)


@pytest.mark.parametrize("count", [0, 1, 4099, (8 << 20) + 3])
def test_send_recv_both_orders(comms, count):
    for k, recv_first in enumerate((False, True)):
        x = _msg(0, 1, k, count)
        y0, y1 = _empty(comms[1], count), _empty(comms[0], count)
        x1 = _msg(1, 0, k, count)
        # Rank 0 sends then receives; rank 1 in the order under test.
        works = [comms[0].send(_dev(comms[0], x), 1), comms[0].recv(y1, 1)]
        r1 = [lambda: comms[1].recv(y0, 0), lambda: comms[1].send(_dev(comms[1], x1), 0)]
        works += [f() for f in (r1 if recv_first else r1[::-1])]
        for w in works:
            w.synchronize(timeout=TIMEOUT)
        assert np.array_equal(arrays.to_numpy(y0), x)
        assert np.array_equal(arrays.to_numpy(y1), x1)


@pytest.mark.parametrize("dtype", sc.DTYPES)
def test_send_recv_every_dtype(comms, dtype):
    x = _msg(0, 1, 0, 12345, dtype)
    y = _empty(comms[1], 12345, dtype)
    for w in (comms[1].recv(y, 0, tag=dtype), comms[0].send(_dev(comms[0], x), 1, tag=dtype)):
        w.synchronize(timeout=TIMEOUT)
    assert np.array_equal(arrays.to_numpy(y).view(np.uint8), x.view(np.uint8))


def test_queued_tags_and_preemption(comms):
    xs = [_msg(0, 1, q, 1000 + q) for q in range(100)]
    ys = [_empty(comms[1], x.size) for x in xs]
    recvs = [comms[1].recv(y, 0, tag="q") for y in ys]
    time.sleep(0.2)  # the first recv waits for its sender and is preempted
    sends = [comms[0].send(_dev(comms[0], x), 1, tag="q") for x in xs]
    for w in recvs + sends:
        w.synchronize(timeout=TIMEOUT)
    for x, y in zip(xs, ys):
        assert np.array_equal(arrays.to_numpy(y), x)
    assert recvs[0].stats["preemptions"] > 0


def test_mismatch_and_timeout(comms):
    works = [comms[0].send(_dev(comms[0], np.zeros(5, np.float32)), 1, tag="m"),
             comms[1].recv(_empty(comms[1], 6), 0, tag="m")]
    for w in works:
        with pytest.raises(dfccl.MismatchError):
            w.synchronize(timeout=TIMEOUT)
    w = comms[0].recv(_empty(comms[0], 10), 1, tag="never")
    with pytest.raises(dfccl.CollectiveTimeoutError) as info:
        w.synchronize(timeout=0.5)
    assert info.value.waiting_on == 1


def test_all_to_all_even_and_uneven(comms):
    n = 2
    for form, counts in (("even", [[1 << 20] * n] * n), ("uneven", [[0, 70001], [3, 1 << 20]])):
        sends = [np.concatenate([_msg(r, p, 7, counts[r][p]) for p in range(n)]) for r in range(n)]
        recvs = [_empty(comms[r], sum(counts[p][r] for p in range(n))) for r in range(n)]
        works = [c.all_to_all_single(_dev(c, sends[r]), recvs[r], send_splits=counts[r],
                                     recv_splits=[counts[p][r] for p in range(n)]) for r, c in enumerate(comms)]
        for w in works:
            w.synchronize(timeout=TIMEOUT)
        for r in range(n):
            want = np.concatenate([_msg(p, r, 7, counts[p][r]) for p in range(n)])
            assert np.array_equal(arrays.to_numpy(recvs[r]), want), f"{form} rank {r}"
