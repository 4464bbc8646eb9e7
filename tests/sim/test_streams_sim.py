"""Stream-ordered collectives on the simulator's streams (SimStream: a host
thread per stream running its operations in order, as a GPU runs a
stream's): a collective submitted on a stream runs once the stream reaches
it, Work.wait(stream) holds up what is queued after it until the collective
completes, the daemon leaves while what it holds is not armed and comes back
when it is, and ranks may issue stream-ordered collectives in different
orders."""

from __future__ import annotations

import time

import numpy as np
import pytest

import dfccl
from dfccl import runtime
from dfccl_support import scenarios as sc

DEV = 4300          # device ids of this module: 4300..4399
TIMEOUT = 30.0


_setup = sc.sim_ranks_with_streams


def _close(comms, streams):
    for s in streams:
        s.close()
    sc.settle(comms)


def test_a_collective_runs_once_its_stream_reaches_it():
    comms, streams = _setup(DEV)
    try:
        xs = [np.full(64, r + 1, np.float32) for r in range(2)]
        streams[0].delay(0.3)                       # a long kernel before the collective
        t0 = time.monotonic()
        w0 = comms[0].all_reduce(xs[0], tag="behind a kernel", stream=streams[0])
        assert w0.stream_ordered and comms[0]._daemon.stream_reached(w0) is False
        w1 = comms[1].all_reduce(xs[1], tag="behind a kernel")
        w1.synchronize(timeout=TIMEOUT)
        assert time.monotonic() - t0 >= 0.25        # it waited for rank 0's stream
        w0.synchronize(timeout=TIMEOUT)
        assert (xs[0] == 3).all() and (xs[1] == 3).all()
        assert comms[0]._daemon.stream_reached(w0) is None   # retired
    finally:
        _close(comms, streams)


def test_wait_holds_up_the_stream_until_the_collective_completes():
    comms, streams = _setup(DEV + 2)
    try:
        xs = [np.full(64, r + 1, np.float32) for r in range(2)]
        flag = np.zeros(1, np.uint32)
        w0 = comms[0].all_reduce(xs[0], tag="waited on a stream")
        w0.wait(streams[0])                          # returns at once: the host never blocks
        streams[0].write32(flag.ctypes.data, 7)      # what the stream does after the wait
        time.sleep(0.2)
        assert flag[0] == 0 and streams[0].pending() == 2 and comms[0]._daemon.stream_waits == 1
        comms[1].all_reduce(xs[1], tag="waited on a stream").synchronize(timeout=TIMEOUT)
        assert streams[0].synchronize(timeout=TIMEOUT)
        assert flag[0] == 7 and (xs[0] == 3).all()
    finally:
        _close(comms, streams)


def test_daemon_leaves_while_nothing_is_armed_and_comes_back():
    """Both ranks' collectives sit behind a second of stream work: the
    daemons leave (they hold only unarmed collectives, and a device
    synchronisation must be able to return) and are brought back after a
    backoff; the collectives then complete."""
    comms, streams = _setup(DEV + 4)
    try:
        xs = [np.full(4096, r + 1, np.float32) for r in range(2)]
        for s in streams:
            s.delay(1.0)
        works = [c.all_reduce(x, tag="late", stream=s) for c, x, s in zip(comms, xs, streams)]
        launches = [c._daemon.launches for c in comms]
        for w in works:
            w.synchronize(timeout=TIMEOUT)
        assert all((x == 3).all() for x in xs)
        assert all(c._daemon.launches > n for c, n in zip(comms, launches)), (launches, [c._daemon.launches for c in comms])
    finally:
        _close(comms, streams)


@pytest.mark.parametrize("seed", range(3))
def test_stream_ordered_collectives_in_rank_divergent_orders(seed):
    """Four ranks issue the same tagged collectives on their streams in
    orders of their own, each behind stream work of random length, then
    make the stream wait for all of them: nothing hangs, every result is
    right.  (A stream that waited for each collective before reaching the
    next would order them itself, and rank-divergent orders would then be
    a real cycle, as under any library.)"""
    rng = np.random.default_rng(seed)
    n, k = 4, 6
    comms, streams = _setup(DEV + 10 + 5 * seed, n)
    try:
        sizes = [int(rng.integers(1, 3000)) for _ in range(k)]
        xs = [[rng.standard_normal(sizes[i]).astype(np.float32) for i in range(k)] for _ in range(n)]
        want = [sum(xs[r][i] for r in range(n)) for i in range(k)]
        works = []
        for r in range(n):
            mine = []
            for i in rng.permutation(k):
                streams[r].delay(float(rng.uniform(0, 0.02)))
                mine.append(comms[r].all_reduce(xs[r][i], tag=("divergent", int(i)), stream=streams[r]))
            for w in mine:
                w.wait(streams[r])
            works += mine
        for w in works:
            w.synchronize(timeout=TIMEOUT)
        for s in streams:
            assert s.synchronize(timeout=TIMEOUT)
        for r in range(n):
            for i in range(k):
                sc.assert_close(xs[r][i], want[i], "float32", "sum", n, f"rank {r} collective {i}")
    finally:
        _close(comms, streams)


def test_an_unknown_stream_is_refused():
    comms, streams = _setup(DEV + 30)
    try:
        other = runtime.get_device("sim", DEV + 31).create_stream()   # rank 1's device, not rank 0's
        with pytest.raises(dfccl.InvalidArgumentError, match="needs one of its streams"):
            comms[0].all_reduce(np.ones(4, np.float32), stream=other)
        with pytest.raises(dfccl.InvalidArgumentError, match="needs one of its streams"):
            comms[0].all_reduce(np.ones(4, np.float32), stream=12345)
        other.close()
        with pytest.raises(dfccl.InvalidArgumentError, match="closed"):
            other.delay(0.1)
    finally:
        _close(comms, streams)


def test_abort_releases_a_stream_that_waits_for_the_collective():
    """A stream waiting for a collective whose peer never comes is not held
    for ever: abort() fails the collective, the daemon writes its completion
    word, and what the stream queued after the wait runs."""
    comms, streams = _setup(DEV + 32)
    try:
        flag = np.zeros(1, np.uint32)
        w = comms[0].all_reduce(np.ones(64, np.float32), tag="alone")   # rank 1 never joins
        w.wait(streams[0])
        streams[0].write32(flag.ctypes.data, 1)
        time.sleep(0.1)
        assert flag[0] == 0
        comms[0].abort()
        assert streams[0].synchronize(timeout=TIMEOUT) and flag[0] == 1
        with pytest.raises(dfccl.AbortedError):
            w.synchronize(timeout=TIMEOUT)
    finally:
        _close(comms, streams)


def _tags_sharing_a_home_bucket(comm, count: int, avoid: int = 2):
    """``count`` tags whose records start probing at the same bucket of
    ``comm``'s table, and one more whose home is none of the next ``avoid``
    buckets after it (the keys hash the communicator, so they differ per run)."""
    from dfccl.tags import home_bucket, tag_key

    cap = comm._endpoint.capacity
    homes: dict[int, list[str]] = {}
    for i in range(100_000):
        homes.setdefault(home_bucket(tag_key(comm._comm_key, f"t{i}"), cap), []).append(f"t{i}")
        shared = next((h for h, tags in homes.items() if len(tags) >= count), None)
        if shared is not None:
            break
    near = {(shared + k) % cap for k in range(count + avoid)}
    other = next(t for h, tags in homes.items() if h not in near for t in tags)
    return homes[shared][:count], other


def test_a_tag_placed_past_one_not_yet_published_is_found():
    """Two tags share a home bucket.  On rank 0 the first one (A) claims it
    but sits behind a stream that waits for a third collective (X), so it
    does not publish; the second (B) goes to the next bucket.  Rank 1 does
    B first and waits for it on the host, then X and A.  Peers probing for
    B must not stop at A's bucket as if it were empty (the probe's end),
    else B waits for A, A for X, X for rank 1, rank 1 for B: a hang that
    only a hash collision of the two tags shows."""
    comms, streams = _setup(DEV + 40)
    try:
        (tag_a, tag_b), tag_x = _tags_sharing_a_home_bucket(comms[0], 2)
        xs = {t: [np.full(64, (r + 1) * k, np.float32) for r in range(2)] for k, t in enumerate((tag_a, tag_b, tag_x), 1)}
        wx0 = comms[0].all_reduce(xs[tag_x][0], tag=tag_x)
        wx0.wait(streams[0])                                   # rank 0's stream waits for X ...
        wa0 = comms[0].all_reduce(xs[tag_a][0], tag=tag_a, stream=streams[0])   # ... before A
        wb0 = comms[0].all_reduce(xs[tag_b][0], tag=tag_b)
        # The setting this is about: on rank 0, B's record is one bucket past A's.
        from dfccl.tags import tag_key
        table = comms[0]._endpoint.tags
        bucket = {t: table.bucket_of(tag_key(comms[0]._comm_key, t)) for t in (tag_a, tag_b)}
        assert bucket[tag_b] == (bucket[tag_a] + 1) % comms[0]._endpoint.capacity, bucket
        comms[1].all_reduce(xs[tag_b][1], tag=tag_b).synchronize(timeout=10.0)
        wb0.synchronize(timeout=TIMEOUT)
        comms[1].all_reduce(xs[tag_x][1], tag=tag_x).synchronize(timeout=TIMEOUT)
        comms[1].all_reduce(xs[tag_a][1], tag=tag_a).synchronize(timeout=TIMEOUT)
        wx0.synchronize(timeout=TIMEOUT)
        wa0.synchronize(timeout=TIMEOUT)
        for k, t in enumerate((tag_a, tag_b, tag_x), 1):
            assert (xs[t][0] == 3 * k).all() and (xs[t][1] == 3 * k).all(), t
    finally:
        _close(comms, streams)


def test_a_tag_that_moved_buckets_is_found_past_its_old_one():
    """Tag T ran once and went idle in its bucket; on rank 0 a tag U with
    the same home bucket takes that bucket over but sits behind a stream
    that waits for a third collective X, so it has not published there,
    and the bucket still carries T's key and T's old instance.  T's next
    instance goes one bucket further on.  Rank 1 must find that live record
    past the old one (a probe that stopped at the first record of T waited
    for U, U for X, X for rank 1, rank 1 for T: a hang)."""
    comms, streams = _setup(DEV + 42)
    try:
        (tag_t, tag_u), tag_x = _tags_sharing_a_home_bucket(comms[0], 2)
        xs = [np.full(64, r + 1, np.float32) for r in range(2)]
        for w in [comms[r].all_reduce(xs[r], tag=tag_t) for r in range(2)]:
            w.synchronize(timeout=TIMEOUT)
        wx0 = comms[0].all_reduce(np.ones(64, np.float32), tag=tag_x)
        wx0.wait(streams[0])
        wu0 = comms[0].all_reduce(np.ones(64, np.float32), tag=tag_u, stream=streams[0])
        t_again = [np.full(64, 10.0 * (r + 1), np.float32) for r in range(2)]
        wt0 = comms[0].all_reduce(t_again[0], tag=tag_t)
        from dfccl.tags import tag_key
        table = comms[0]._endpoint.tags
        bucket = {t: table.bucket_of(tag_key(comms[0]._comm_key, t)) for t in (tag_t, tag_u)}
        assert bucket[tag_t] == (bucket[tag_u] + 1) % comms[0]._endpoint.capacity, bucket   # T moved on
        comms[1].all_reduce(t_again[1], tag=tag_t).synchronize(timeout=10.0)
        wt0.synchronize(timeout=TIMEOUT)
        comms[1].all_reduce(np.ones(64, np.float32), tag=tag_x).synchronize(timeout=TIMEOUT)
        comms[1].all_reduce(np.ones(64, np.float32), tag=tag_u).synchronize(timeout=TIMEOUT)
        wx0.synchronize(timeout=TIMEOUT)
        wu0.synchronize(timeout=TIMEOUT)
        assert (t_again[0] == 30).all() and (t_again[1] == 30).all()
    finally:
        _close(comms, streams)
