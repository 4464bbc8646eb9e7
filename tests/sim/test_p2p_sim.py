"""Point to point and all-to-all on the simulator: send / recv matched by
(peer, tag) in any order, mixed with collectives in divergent orders, every
dtype, empty and large messages, uneven splits with zeros, preemption,
mismatches reported on both sides, timeouts and aborts naming the peer, and
argument checks.  "direct" runs the in-place read path, "ring" the FIFO path
(send / recv) and the staged copy (all-to-all) that processes use."""

from __future__ import annotations

import time

import numpy as np
import pytest

import dfccl
from dfccl_support import scenarios as sc

PATHS = ("direct", "ring")
TIMEOUT = 60


def make_comms(n: int, path: str, **options):
    base = sc.fresh_sim_devices(1)[0]
    return dfccl.Communicator.for_devices([base + r for r in range(n)], backend="sim",
                                          options=dfccl.CommOptions(path=path, **options))


@pytest.fixture
def comms(request):
    n, path = request.param
    cs = make_comms(n, path)
    yield cs
    for c in cs:
        c.close()


def both(n_values=(2,)):
    return pytest.mark.parametrize("comms", [(n, p) for n in n_values for p in PATHS], indirect=True,
                                   ids=lambda v: f"{v[0]}ranks-{v[1]}")


def sync(works, timeout=TIMEOUT):
    for w in works:
        w.synchronize(timeout=timeout)


def data(rank: int, count: int, dtype="float32", salt: int = 0) -> np.ndarray:
    rng = np.random.default_rng(1000 * rank + salt)
    return sc.random_input(rng, dtype, count, "sum")


# -- send / recv ------------------------------------------------------------------------

@both()
@pytest.mark.parametrize("recv_first", (False, True))
def test_send_recv_either_order(comms, recv_first):
    x, y = data(0, 5000), np.zeros(5000, np.float32)
    if recv_first:
        works = [comms[1].recv(y, 0), comms[0].send(x, 1)]
    else:
        works = [comms[0].send(x, 1), comms[1].recv(y, 0)]
    sync(works)
    assert np.array_equal(x, y)


@both((2, 4))
def test_every_rank_sends_before_it_receives(comms):
    """A ring of blocking-style sends posted before the recvs: deadlocks when
    sends wait for their receivers in post order; here every pair meets."""
    n = len(comms)
    xs = [data(r, 3001) for r in range(n)]
    ys = [np.zeros(3001, np.float32) for _ in range(n)]
    sends = [c.send(xs[r], (r + 1) % n) for r, c in enumerate(comms)]
    recvs = [c.recv(ys[r], (r - 1) % n) for r, c in enumerate(comms)]
    sync(sends + recvs)
    for r in range(n):
        assert np.array_equal(ys[r], xs[(r - 1) % n])


@both()
def test_exchange_in_opposite_orders(comms):
    """Rank 0 sends then receives, rank 1 receives then sends, on one tag and
    untagged."""
    for tag in (None, "t"):
        x0, x1 = data(0, 999, salt=1), data(1, 999, salt=1)
        y0, y1 = np.zeros_like(x0), np.zeros_like(x1)
        works = [comms[0].send(x0, 1, tag=tag), comms[0].recv(y0, 1, tag=tag),
                 comms[1].recv(y1, 0, tag=tag), comms[1].send(x1, 0, tag=tag)]
        sync(works)
        assert np.array_equal(y0, x1) and np.array_equal(y1, x0)


@both()
def test_many_queued_on_one_tag_pair_in_order(comms):
    """The k-th send on (pair, tag) meets the k-th recv; untagged ones too."""
    for tag in ("q", None):
        xs = [data(0, 100 + k, salt=k) for k in range(60)]
        ys = [np.zeros_like(x) for x in xs]
        sends = [comms[0].send(x, 1, tag=tag) for x in xs]
        recvs = [comms[1].recv(y, 0, tag=tag) for y in ys]
        sync(sends + recvs)
        for x, y in zip(xs, ys):
            assert np.array_equal(x, y)


@both()
def test_tags_pick_the_message(comms):
    a, b = data(0, 10, salt=1), data(0, 20, salt=2)
    ya, yb = np.zeros_like(a), np.zeros_like(b)
    works = [comms[1].recv(yb, 0, tag=("b", 2)), comms[1].recv(ya, 0, tag=("a", 1)),
             comms[0].send(a, 1, tag=("a", 1)), comms[0].send(b, 1, tag=("b", 2))]
    sync(works)
    assert np.array_equal(a, ya) and np.array_equal(b, yb)


@both()
@pytest.mark.parametrize("dtype", sc.DTYPES)
def test_every_dtype(comms, dtype):
    x = data(0, 1031, dtype)
    y = np.zeros_like(x)
    sync([comms[0].send(x, 1, tag=dtype), comms[1].recv(y, 0, tag=dtype)])
    assert np.array_equal(x.view(np.uint8), y.view(np.uint8))


@both()
def test_empty_and_large_messages(comms):
    big = (3 << 20) + 7  # float32: 12 MiB, many FIFO slices and channels
    for count in (0, 1, 17, big):
        x = data(0, count, salt=count)
        y = np.zeros_like(x)
        sync([comms[1].recv(y, 0), comms[0].send(x, 1)])
        assert np.array_equal(x, y)


@both()
def test_preempted_transfer_is_exact(comms):
    """The recv waits (and is preempted) until the sender arrives much later;
    the data arrives exactly."""
    x = data(0, 1 << 18)
    y = np.zeros_like(x)
    w = comms[1].recv(y, 0)
    time.sleep(0.3)
    assert not w.done()
    s = comms[0].send(x, 1)
    sync([w, s])
    assert np.array_equal(x, y)
    assert w.stats["preemptions"] > 0


@both()
def test_mismatch_fails_both_sides(comms):
    cases = [(np.zeros(5, np.float32), np.zeros(6, np.float32)),
             (np.zeros(5, np.float32), np.zeros(5, np.int32))]
    for k, (x, y) in enumerate(cases):
        works = [comms[0].send(x, 1, tag=k), comms[1].recv(y, 0, tag=k)]
        for rank, w in enumerate(works):
            with pytest.raises(dfccl.MismatchError) as info:
                w.synchronize(timeout=TIMEOUT)
            assert info.value.peer == 1 - rank
    # The pair's other tags are unaffected.
    x = data(0, 50)
    y = np.zeros_like(x)
    sync([comms[0].send(x, 1), comms[1].recv(y, 0)])
    assert np.array_equal(x, y)


@both()
def test_timeout_and_abort_name_the_missing_peer(comms):
    y = np.zeros(100, np.float32)
    w = comms[0].recv(y, 1, tag="never")
    with pytest.raises(dfccl.CollectiveTimeoutError) as info:
        w.synchronize(timeout=0.5)
    assert info.value.waiting_on == 1
    assert "rank 1" in str(info.value)
    comms[0].abort()
    with pytest.raises(dfccl.AbortedError):
        w.synchronize(timeout=TIMEOUT)


# -- mixed with collectives ------------------------------------------------------------

@both((2, 4))
def test_divergent_orders_with_collectives(comms):
    """Even ranks: all-reduce, send, all-gather, recv; odd ranks the reverse
    (recv, all-gather, send, all-reduce): NCCL's order-based matching hangs."""
    n = len(comms)
    ar_in = [data(r, 4096, salt=1) for r in range(n)]
    ag_in = [data(r, 333, "int32", salt=2) for r in range(n)]
    ar_out = [np.zeros(4096, np.float32) for _ in range(n)]
    ag_out = [np.zeros(333 * n, np.int32) for _ in range(n)]
    p2p_in = [data(r, 2000, salt=3) for r in range(n)]
    p2p_out = [np.zeros(2000, np.float32) for _ in range(n)]
    works = []
    for r, c in enumerate(comms):
        partner = r ^ 1
        steps = [lambda: c.all_reduce(ar_in[r], ar_out[r], tag="ar"),
                 lambda: c.send(p2p_in[r], partner),
                 lambda: c.all_gather(ag_in[r], ag_out[r], tag="ag"),
                 lambda: c.recv(p2p_out[r], partner)]
        if r % 2:
            steps.reverse()
        works += [step() for step in steps]
    sync(works)
    ar_want = sc.reduce_reference(ar_in, "sum")
    for r in range(n):
        sc.assert_close(ar_out[r], ar_want, "float32", "sum", n)
        assert np.array_equal(ag_out[r], np.concatenate(ag_in))
        assert np.array_equal(p2p_out[r], p2p_in[r ^ 1])


# -- all-to-all ----------------------------------------------------------------------------

def a2a_reference(sends, send_splits):
    n = len(sends)
    offs = [np.concatenate([[0], np.cumsum(s)[:-1]]).astype(int) for s in send_splits]
    return [np.concatenate([sends[p][offs[p][r]:offs[p][r] + send_splits[p][r]] for p in range(n)])
            for r in range(n)]


@both((2, 3, 4))
@pytest.mark.parametrize("dtype", ("float32", "int8", "float64"))
def test_all_to_all_equal(comms, dtype):
    n = len(comms)
    per = 1000
    sends = [data(r, per * n, dtype) for r in range(n)]
    recvs = [np.zeros_like(s) for s in sends]
    sync([c.all_to_all(sends[r], recvs[r]) for r, c in enumerate(comms)])
    want = a2a_reference(sends, [[per] * n] * n)
    for r in range(n):
        assert np.array_equal(recvs[r], want[r])


@both((2, 3, 4))
def test_all_to_all_uneven_with_zeros(comms):
    n = len(comms)
    rng = np.random.default_rng(n)
    for round_ in range(3):
        counts = rng.integers(0, 3000, size=(n, n))
        counts[rng.random((n, n)) < 0.3] = 0  # counts[r][p]: r sends p
        sends = [data(r, int(counts[r].sum()), salt=round_) for r in range(n)]
        recvs = [np.full(int(counts[:, r].sum()), -1, np.float32) for r in range(n)]
        works = [c.all_to_all_single(sends[r], recvs[r], send_splits=counts[r].tolist(),
                                     recv_splits=counts[:, r].tolist()) for r, c in enumerate(comms)]
        sync(works)
        want = a2a_reference(sends, counts.tolist())
        for r in range(n):
            assert np.array_equal(recvs[r], want[r])


@both((2, 3))
def test_all_to_all_all_zero_and_mixed_order_with_collectives(comms):
    n = len(comms)
    zero = [c.all_to_all_single(np.zeros(0, np.float32), np.zeros(0, np.float32), send_splits=[0] * n,
                                recv_splits=[0] * n) for c in comms]
    sync(zero)
    # Tagged all-to-all and all-reduce in opposite orders on alternate ranks.
    sends = [data(r, 64 * n) for r in range(n)]
    recvs = [np.zeros_like(s) for s in sends]
    ar = [data(r, 100, salt=5) for r in range(n)]
    ar_out = [np.zeros_like(a) for a in ar]
    works = []
    for r, c in enumerate(comms):
        steps = [lambda: c.all_to_all(sends[r], recvs[r], tag="x"), lambda: c.all_reduce(ar[r], ar_out[r], tag="y")]
        works += [s() for s in (steps if r % 2 == 0 else steps[::-1])]
    sync(works)
    want = a2a_reference(sends, [[64] * n] * n)
    for r in range(n):
        assert np.array_equal(recvs[r], want[r])
        sc.assert_close(ar_out[r], sc.reduce_reference(ar, "sum"), "float32", "sum", n)


@both()
def test_all_to_all_preempted_is_exact(comms):
    """Rank 0 waits (preempted) for rank 1, which arrives much later."""
    splits = [[20000, 30000], [10000, 40000]]  # splits[r][p]: r sends p
    sends = [data(r, 50000) for r in range(2)]
    recvs = [np.zeros(30000, np.float32), np.zeros(70000, np.float32)]
    w0 = comms[0].all_to_all_single(sends[0], recvs[0], send_splits=splits[0], recv_splits=[20000, 10000])
    time.sleep(0.3)
    assert not w0.done()
    w1 = comms[1].all_to_all_single(sends[1], recvs[1], send_splits=splits[1], recv_splits=[30000, 40000])
    sync([w0, w1])
    want = a2a_reference(sends, splits)
    assert np.array_equal(recvs[0], want[0]) and np.array_equal(recvs[1], want[1])
    assert w0.stats["preemptions"] > 0


@both((2, 3))
def test_all_to_all_split_mismatch_fails_both_sides(comms):
    n = len(comms)
    send = [[4] * n for _ in range(n)]
    recv = [[4] * n for _ in range(n)]
    send[0][1], recv[0][0] = 5, 4  # rank 0 sends 5 to rank 1, which expects 4
    send[0][0] = 4
    works = []
    for r, c in enumerate(comms):
        works.append(c.all_to_all_single(np.zeros(sum(send[r]), np.float32), np.zeros(sum(recv[r]), np.float32),
                                         send_splits=send[r], recv_splits=recv[r], tag="m"))
    # Rank 0 meets rank 1 first and reports the mismatch; with two ranks so
    # does rank 1.  With more, rank 1 may first meet a rank that already gave
    # up the instance (the failure travels), and reports that.
    with pytest.raises(dfccl.MismatchError) as info:
        works[0].synchronize(timeout=TIMEOUT)
    assert info.value.peer == 1
    for r, w in enumerate(works[1:], 1):
        with pytest.raises(dfccl.MismatchError if n == 2 else (dfccl.MismatchError, dfccl.PeerAbortedError)):
            w.synchronize(timeout=TIMEOUT)


@both()
def test_all_to_all_tables_given_back_at_retirement(comms):
    """Each all-to-all instance has staging to itself (its split table and,
    across processes, a copy of its input); the tag table takes it back when
    the instance retires, and keeps a failed instance's (peers may still
    read it)."""
    n = len(comms)
    pools = [c._endpoint.staging for c in comms]
    before = [p.in_use for p in pools]
    for i in range(20):
        works = [c.all_to_all_single(np.arange(4 * n, dtype=np.float32), np.zeros(4 * n, np.float32), tag="given")
                 for c in comms]
        for w in works:
            w.synchronize(timeout=TIMEOUT)   # which retires it
    assert [p.in_use for p in pools] == before, "all-to-all staging was not given back"
    send = [[4] * n for _ in range(n)]
    send[0][1] = 5   # rank 1 expects 4 from rank 0: both fail
    works = [c.all_to_all_single(np.zeros(sum(send[r]), np.float32), np.zeros(4 * n, np.float32),
                                 send_splits=send[r], recv_splits=[4] * n, tag="kept")
             for r, c in enumerate(comms)]
    for w in works:
        with pytest.raises((dfccl.MismatchError, dfccl.PeerAbortedError)):
            w.synchronize(timeout=TIMEOUT)
    assert pools[0].in_use > before[0], "a failed all-to-all's table must stay (peers may still read it)"


def test_all_to_all_single_rank():
    (c,) = make_comms(1, "auto")
    try:
        x = data(0, 10)
        y = np.zeros_like(x)
        c.all_to_all(x, y).synchronize(timeout=TIMEOUT)
        assert np.array_equal(x, y)
    finally:
        c.close()


# -- argument checks ----------------------------------------------------------------------

def test_invalid_arguments():
    cs = make_comms(3, "auto")
    try:
        c = cs[0]
        x = np.zeros(6, np.float32)
        with pytest.raises(dfccl.InvalidArgumentError, match="outside 0..2"):
            c.send(x, 3)
        with pytest.raises(dfccl.InvalidArgumentError, match="this rank"):
            c.recv(x, 0)
        with pytest.raises(dfccl.InvalidArgumentError, match="peer must be an int"):
            c.send(x, 1.0)
        with pytest.raises(dfccl.InvalidArgumentError, match="read-only"):
            ro = np.zeros(4, np.float32)
            ro.flags.writeable = False
            c.recv(ro, 1)
        with pytest.raises(dfccl.InvalidArgumentError, match="multiple of the 3 ranks"):
            c.all_to_all(np.zeros(7, np.float32), np.zeros(7, np.float32))
        with pytest.raises(dfccl.InvalidArgumentError, match="send_splits sum to 5"):
            c.all_to_all_single(x, x.copy(), send_splits=[1, 2, 2])
        with pytest.raises(dfccl.InvalidArgumentError, match="has 2 entries, expected one per rank"):
            c.all_to_all_single(x, x.copy(), send_splits=[3, 3])
        with pytest.raises(dfccl.InvalidArgumentError, match=r"recv_splits\[1\] must be an int >= 0"):
            c.all_to_all_single(x, x.copy(), recv_splits=[3, -1, 4])
        with pytest.raises(dfccl.InvalidArgumentError, match="sends itself"):
            c.all_to_all_single(x, x.copy(), send_splits=[1, 2, 3], recv_splits=[2, 2, 2])
        with pytest.raises(dfccl.InvalidArgumentError, match="send is float32, recv is int32"):
            c.all_to_all(x, np.zeros(6, np.int32))
        buf = np.zeros(12, np.float32)
        with pytest.raises(dfccl.InvalidArgumentError, match="overlap"):
            c.all_to_all(buf[:6], buf[3:9])
        with pytest.raises(dfccl.InvalidArgumentError, match="overlap"):
            c.all_to_all(buf[:6], buf[:6])
    finally:
        for c in cs:
            c.close()
