"""Soak: many collectives of random sizes and tags in random per-rank orders:
nothing lost (every Work completes, exactly one done-callback each), nothing
duplicated or mixed up (every result exact), no hang.  On the simulator a
short run is part of the default suite and 100,000 collectives are marker
``slow`` (`pytest -m slow`); on a GPU (marker ``gpu``) 10,000 random sizes,
then an abort in the middle of heavy traffic."""

from __future__ import annotations

import collections
import threading
import time

import numpy as np
import pytest

import dfccl
from dfccl import runtime
from dfccl.bench import arrays

DEV = 3900          # simulator device ids of this module: 3900..3999
TIMEOUT = 60.0


def _orders(rng, tags, nranks):
    """Per-rank random orders that keep the instances of each tag in order
    (the k-th use of a tag meets the k-th use on every rank)."""
    out = []
    for _ in range(nranks):
        perm = list(rng.permutation(len(tags)))
        by_tag = collections.defaultdict(list)
        for i in range(len(tags)):
            by_tag[tags[i]].append(i)
        seq = {t: iter(v) for t, v in by_tag.items()}
        out.append([next(seq[tags[p]]) for p in perm])
    return out


def run_soak(comms, backend: str, total: int, seed: int, max_count: int, batch: int = 64, ntags: int = 16) -> int:
    """Runs ``total`` all-reduces (int64, exact) in batches; returns how many
    were checked."""
    n = len(comms)
    rng = np.random.default_rng(seed)
    checked = 0
    calls = collections.Counter()
    while checked < total:
        b = min(batch, total - checked)
        counts = rng.integers(1, max_count + 1, b)
        tags = [int(t) for t in rng.integers(0, ntags, b)]
        bufs = [[arrays.from_numpy(backend, comms[r].device,
                                   np.arange(counts[i], dtype=np.int64) + (checked + i) * 64 + r)
                 for i in range(b)] for r in range(n)]
        works = []
        for r, order in enumerate(_orders(rng, tags, n)):
            for i in order:
                w = comms[r].all_reduce(bufs[r][i], tag=tags[i])
                w.add_done_callback(lambda work, key=(r, checked + i): calls.update([key]))
                works.append(w)
        for w in works:
            w.synchronize(timeout=TIMEOUT)
        for i in range(b):
            want = n * np.arange(counts[i], dtype=np.int64) + n * (checked + i) * 64 + n * (n - 1) // 2
            for r in range(n):
                got = arrays.to_numpy(bufs[r][i])
                assert np.array_equal(got, want), f"collective {checked + i} (tag {tags[i]}) rank {r} is wrong"
        checked += b
    deadline = time.monotonic() + TIMEOUT
    while len(calls) < total * n and time.monotonic() < deadline:
        time.sleep(0.01)   # callbacks run on the progress thread
    assert len(calls) == total * n and set(calls.values()) == {1}, "a Work completed twice or not at all"
    return checked


def _sim(n, base, path):
    return dfccl.Communicator.for_devices(list(range(base, base + n)), backend="sim",
                                          options=dfccl.CommOptions(path=path))


@pytest.mark.parametrize("path", ("direct", "ring"))
def test_soak_short_sim(path):
    comms = _sim(4, DEV + (0 if path == "direct" else 4), path)
    try:
        assert run_soak(comms, "sim", 256, seed=1, max_count=300) == 256
    finally:
        for c in comms:
            c.close()


@pytest.mark.slow
@pytest.mark.timeout(4 * 3600)  # ~30 ms a collective on a 2-core machine: beyond the suite's 900 s
def test_soak_100k_sim():
    comms = _sim(4, DEV + 10, "auto")
    try:
        assert run_soak(comms, "sim", 100_000, seed=2, max_count=2000, batch=256) == 100_000
    finally:
        for c in comms:
            c.close()


def _abort_under_traffic(comms, backend: str, max_count: int, seconds: float) -> None:
    """Two threads submit as fast as they can; rank 0 aborts; every Work must
    finish (completed or a typed failure) and abort must return in bounded
    time; a new communicator on the same devices then works."""
    stop = threading.Event()
    works = [[], []]
    rng = np.random.default_rng(7)
    sizes = [int(s) for s in rng.integers(1, max_count, 100_000)]

    def traffic(r):
        for i, count in enumerate(sizes):
            if stop.is_set():
                return
            buf = arrays.from_numpy(backend, comms[r].device, np.ones(count, np.float32))
            try:
                works[r].append(comms[r].all_reduce(buf, tag=i % 8))
            except (dfccl.ClosedError, dfccl.ResourceError):
                return

    threads = [threading.Thread(target=traffic, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    time.sleep(seconds)
    t0 = time.monotonic()
    comms[0].abort(timeout=10.0)
    assert time.monotonic() - t0 < 11.0
    stop.set()
    for t in threads:
        t.join(timeout=60)
    comms[1].abort(timeout=10.0)
    for ws in works:
        for w in ws:
            assert w.done()
            err = w.exception()
            assert err is None or isinstance(err, (dfccl.AbortedError, dfccl.PeerAbortedError)), repr(err)
    for c in comms:
        c.close()


def test_abort_under_heavy_traffic_sim():
    devs = [DEV + 20, DEV + 21]
    comms = dfccl.Communicator.for_devices(devs, backend="sim")
    _abort_under_traffic(comms, "sim", 20000, 0.3)
    fresh = dfccl.Communicator.for_devices(devs, backend="sim")
    assert run_soak(fresh, "sim", 64, seed=3, max_count=100) == 64
    for c in fresh:
        c.close()


def _gpus(n):
    count = runtime.cuda_device_count()
    return [r % count for r in range(n)]


@pytest.mark.gpu
@pytest.mark.parametrize("path", ("direct", "ring"))
def test_soak_10k_random_sizes_gpu(path):
    comms = dfccl.Communicator.for_devices(_gpus(2), backend="cuda", options=dfccl.CommOptions(path=path))
    try:
        assert run_soak(comms, "cuda", 10_000, seed=11, max_count=1 << 18, batch=128) == 10_000
    finally:
        for c in comms:
            c.close()


@pytest.mark.gpu
def test_abort_under_heavy_traffic_gpu():
    devs = _gpus(2)
    comms = dfccl.Communicator.for_devices(devs, backend="cuda")
    _abort_under_traffic(comms, "cuda", 1 << 20, 1.0)
    fresh = dfccl.Communicator.for_devices(devs, backend="cuda")
    try:
        assert run_soak(fresh, "cuda", 256, seed=12, max_count=1 << 16) == 256
    finally:
        for c in fresh:
            c.close()
