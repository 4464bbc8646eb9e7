"""Staging bounded independently of message size (docs/architecture.md,
"Staging budget"): a tag's ring FIFO is a fixed ring of slots per channel
that every instance of the tag reuses and that the ring loops over; at most
the shared staging // ring_tags per tag, so ring_tags tags get their planned
FIFOs at once whatever their sizes, and any number more loop through
reserved minimum FIFOs."""

from __future__ import annotations

import numpy as np
import pytest

import dfccl
from dfccl_support import scenarios as sc
from dfccl._native.layout import KIND_ALL_GATHER, KIND_ALL_REDUCE, KIND_REDUCE_SCATTER, KIND_BROADCAST
from dfccl.planning import PATH_RING, plan_geometry
from dfccl.tags import tag_key
from dfccl.types import DataType

TIMEOUT = 120


@pytest.mark.parametrize("backend", ["sim", "cuda"])
@pytest.mark.parametrize("ring_tags", [None, 1, 7, 100])
def test_tag_fifo_never_exceeds_its_share(backend, ring_tags):
    opts = dfccl.CommOptions(ring_tags=ring_tags).resolved(backend)
    share = opts.staging_bytes // opts.ring_tags
    for kind in (KIND_ALL_REDUCE, KIND_ALL_GATHER, KIND_REDUCE_SCATTER, KIND_BROADCAST):
        for count in (1, 1000, 1 << 20, 1 << 28, (1 << 31) + 5):
            for nranks in (2, 3, 8):
                for channels in (1, 2, 32):
                    g = plan_geometry(kind, count, DataType.FLOAT32, nranks, channels, False, opts)
                    assert g.path == PATH_RING
                    assert g.fifo_bytes <= max(share, channels * opts.ring_slots * 256), (kind, count, nranks)
                    assert g.slice_bytes % 16 == 0 and g.slice_bytes >= 256


def _pair(**options):
    return dfccl.Communicator.for_devices([40, 41], backend="sim", options=dfccl.CommOptions(path="ring", **options))


def test_thousand_queued_instances_of_one_tag_share_one_fifo():
    comms = _pair(staging_bytes=1 << 20, ring_tags=100)
    try:
        pool = comms[0]._endpoint.staging
        n, count = 1000, 4096
        xs = [[np.full(count, (r + 1) * (i % 7 + 1), np.float32) for i in range(n)] for r in range(2)]
        works = [comms[0].all_reduce(x, tag="one") for x in xs[0]]
        fifo = comms[0]._endpoint.tags.staging_of(tag_key(comms[0]._comm_key, "one"))[1]
        assert 0 < fifo < count * 4, "the FIFO is smaller than one message: the ring loops over it"
        assert pool.in_use == -(-fifo // 256) * 256, "1,000 queued instances hold one FIFO"
        works += [comms[1].all_reduce(x, tag="one") for x in xs[1]]
        for w in works:
            w.synchronize(timeout=TIMEOUT)
        for i in range(n):
            assert (xs[0][i] == 3 * (i % 7 + 1)).all() and (xs[1][i] == 3 * (i % 7 + 1)).all(), i
    finally:
        sc.settle(comms)


@pytest.mark.parametrize("options", [{}, {"staging_bytes": 4 << 20, "ring_tags": 100}],
                         ids=["defaults", "4MiB-for-100-tags"])
def test_hundred_distinct_tags_of_large_messages_fit(options):
    comms = _pair(**options)
    try:
        ntags, count = 100, 96 << 10      # 384 KiB each: larger than any tag's FIFO
        rng = np.random.default_rng(5)
        vals = [[rng.integers(-100, 100, count).astype(np.float32) for _ in range(ntags)] for _ in range(2)]
        want = [vals[0][t] + vals[1][t] for t in range(ntags)]
        # Rank 0 queues all 100 before rank 1 starts, in the opposite order.
        works = [comms[0].all_reduce(vals[0][t], tag=("t", t)) for t in range(ntags)]
        works += [comms[1].all_reduce(vals[1][t], tag=("t", t)) for t in reversed(range(ntags))]
        opts = comms[0]._options
        assert comms[0]._endpoint.staging.in_use <= opts.staging_bytes
        for w in works:
            w.synchronize(timeout=TIMEOUT)
        for t in range(ntags):
            assert (vals[0][t] == want[t]).all() and (vals[1][t] == want[t]).all(), t
    finally:
        sc.settle(comms)


@pytest.mark.parametrize("nranks", [2, 3])
def test_tags_beyond_the_budget_loop_through_reserved_fifos(nranks):
    """More tags pending at once than the shared staging holds at their
    planned FIFOs: the rest loop through reserved minimum FIFOs (once the
    fifth raised ResourceError).  Ranks queue them in opposite orders, so
    a tag's FIFO is planned on one rank and reserved on another: the ring
    runs with the smallest slot of all (broadcast and reduce chains too)."""
    comms = dfccl.Communicator.for_devices(sc.fresh_sim_devices(nranks), backend="sim", options=dfccl.CommOptions(
        path="ring", staging_bytes=1 << 20, ring_tags=4, max_tags=64))
    try:
        ntags, count = 24, 20_001
        kinds = ("all_reduce", "broadcast", "reduce")
        bufs = [[np.arange(count, dtype=np.int64) + 10 * r + t for t in range(ntags)] for r in range(nranks)]
        works = []
        for r, c in enumerate(comms):
            for t in (range(ntags) if r % 2 == 0 else reversed(range(ntags))):
                kind, root = kinds[t % 3], t % nranks
                works.append(getattr(c, kind)(bufs[r][t], tag=("b", t)) if kind == "all_reduce"
                             else getattr(c, kind)(bufs[r][t], root=root, tag=("b", t)))
            pool = c._endpoint.staging
            if r < nranks - 1:
                # Nothing has completed yet (the last rank has not submitted):
                # every tag still holds what it took.
                assert pool.free_blocks < pool.blocks - ntags // 2, "most tags hold reserved FIFOs"
            assert pool.in_use <= pool.size
        for w in works:
            w.synchronize(timeout=TIMEOUT)
        total = [sum(np.arange(count, dtype=np.int64) + 10 * r + t for r in range(nranks)) for t in range(ntags)]
        for t in range(ntags):
            root = t % nranks
            for r in range(nranks):
                want = {"all_reduce": total[t], "broadcast": np.arange(count, dtype=np.int64) + 10 * root + t,
                        "reduce": total[t] if r == root else np.arange(count, dtype=np.int64) + 10 * r + t}
                assert np.array_equal(bufs[r][t], want[kinds[t % 3]]), (t, r)
    finally:
        sc.settle(comms)


def test_instance_staging_beyond_the_budget_raises_resource_error_not_wait():
    """Staging an instance needs whole on its own (an all-to-all's table
    and copy) is not a FIFO to loop through: it raises when not free."""
    comms = _pair(staging_bytes=1 << 20, ring_tags=4)
    try:
        tags = comms[0]._endpoint.tags
        with pytest.raises(dfccl.ResourceError, match="staging"):
            tags.alloc_instance_staging(1 << 20)
    finally:
        sc.settle(comms)


@pytest.mark.parametrize("path", ["ring", "direct"])
def test_queued_instances_of_a_tag_with_other_sizes_and_channel_counts(path):
    """Instances of one tag share its staging, but run in order only per
    channel: with sizes that change the channel count or the slice, channel 0
    of instance k + 1 must not write where channel 1 of instance k still
    works.  Eight queued all-reduces of one tag per round, random sizes of one
    and two channels, exact int64 results (once failed with stale data in the
    second channel's part)."""
    rng = np.random.default_rng(5)
    devices = sc.fresh_sim_devices(2)
    opts = dfccl.CommOptions(path=path, bytes_per_channel=128 << 10, staged_max_bytes=1 << 20)
    comms = dfccl.Communicator.for_devices(devices, backend="sim", options=opts)
    try:
        for _ in range(40):
            counts = [int(c) for c in rng.integers(1, 65537, 8)]
            bufs = [[np.arange(c, dtype=np.int64) + 7 * r + i for i, c in enumerate(counts)] for r in range(2)]
            works = [comms[r].all_reduce(bufs[r][i], tag="one") for r in range(2) for i in range(8)]
            for w in works:
                w.synchronize(timeout=60)
            for i, c in enumerate(counts):
                want = 2 * np.arange(c, dtype=np.int64) + 7 + 2 * i
                for r in range(2):
                    assert np.array_equal(bufs[r][i], want), f"count {c} rank {r}"
    finally:
        for c in comms:
            c.close()
