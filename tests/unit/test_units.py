"""Pure-Python units: tags, the staging pool, ring geometry, types, stream
handles and buffer descriptions.  Nothing here starts a daemon."""

from __future__ import annotations

import hashlib
import itertools
import struct
from dataclasses import replace

import numpy as np
import pytest

from dfccl import tags as tags_mod
from dfccl._native.layout import (KIND_ALL_GATHER, KIND_ALL_REDUCE, KIND_BROADCAST, KIND_REDUCE,
                                  KIND_REDUCE_SCATTER, PATH_DIRECT, PATH_RING, TASK_LL, TASK_ONE_SHOT, mix64)
from dfccl.buffers import Buffer, as_buffer
from dfccl.errors import InvalidArgumentError, ResourceError
from dfccl.options import CommOptions
from dfccl.planning import fifo_blocks, plan_geometry
from dfccl.staging import ALIGN, StagingPool
from dfccl.streams import stream_handle
from dfccl.tags import TagTable, home_bucket, tag_key
from dfccl.types import (DataType, ReduceOp, as_data_type, as_reduce_op, dtype_from_dlpack, dtype_from_typestr)

M64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15


# ==========================================================================================
# tags
# ==========================================================================================
def splitmix64_finaliser(z: int) -> int:
    """Written independently of dfccl.tags (Steele, Lea & Flood / Vigna)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % (1 << 64)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % (1 << 64)
    return z ^ (z >> 31)


def test_mix64_published_splitmix64_vectors():
    # splitmix64 seeded with 0 outputs mix(k * golden) for k = 1, 2, 3: the
    # published first outputs of the generator.
    want = [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]
    assert [mix64((k * GOLDEN) & M64) for k in (1, 2, 3)] == want
    assert [splitmix64_finaliser((k * GOLDEN) & M64) for k in (1, 2, 3)] == want


@pytest.mark.parametrize("x", [0, 1, 2, 0xFF, 1 << 63, M64, 0x0123456789ABCDEF, 0xDEADBEEFCAFEBABE, 12345678901234567])
def test_mix64_matches_independent_finaliser(x):
    assert mix64(x) == splitmix64_finaliser(x)
    assert 0 <= mix64(x) <= M64
    assert mix64(x + (1 << 64)) == mix64(x), "mix64 works on the low 64 bits"


def test_mix64_zero_and_bijective_sample():
    assert mix64(0) == 0
    rng = np.random.default_rng(1)
    xs = {int(v) for v in rng.integers(0, 1 << 63, 2000, dtype=np.int64)}
    assert len({mix64(x) for x in xs}) == len(xs)


def test_instance_token_and_first_block_from_the_header():
    from dfccl._native.layout import first_block, instance_token
    # instance_token: mix of key + instance * golden ratio, never zero.
    for key, inst in [(1, 1), (0xDEADBEEF, 7), (M64, 3)]:
        assert instance_token(key, inst) == splitmix64_finaliser((key + inst * GOLDEN) & M64) | 1
    assert instance_token(0, 0) != 0
    # first_block: within the daemon's blocks, the same for every call, and
    # the ranks of one device (consecutive endpoints) on different blocks.
    for key in (1, 12345, M64):
        for nblocks in (1, 2, 7, 32):
            b = first_block(key, 0, nblocks)
            assert 0 <= b < nblocks and first_block(key, 0, nblocks) == b
            assert first_block(key, 1, nblocks) == (b + 1) % nblocks
    with pytest.raises(ValueError):
        first_block(1, 0, 0)


@pytest.mark.parametrize("capacity", [1, 2, 3, 7, 8192, 1 << 20, 999983])
def test_home_bucket(capacity):
    rng = np.random.default_rng(capacity)
    for key in [1, 2, M64, *map(int, rng.integers(1, 1 << 62, 50))]:
        b = home_bucket(key, capacity)
        assert b == splitmix64_finaliser(key) % capacity
        assert 0 <= b < capacity


def _independent_tag_bytes(tag) -> bytes:
    if isinstance(tag, int):
        return b"i" + str(tag).encode()
    if isinstance(tag, str):
        return b"s" + tag.encode("utf-8")
    parts = [_independent_tag_bytes(t) for t in tag]
    return b"t" + b"".join(len(p).to_bytes(4, "big") + p for p in parts)


SAMPLE_TAGS = [0, 1, -1, 2**64, "0", "1", "", "a", "ab", "é", (), (1,), ("1",), (1, 2), (12,), ("a", "bc"), ("ab", "c"),
               ((1, 2),), ((1,), 2), (1, (2,)), ("grad", 3), ("grad", 3, 0)]


@pytest.mark.parametrize("tag", SAMPLE_TAGS)
def test_tag_key_value(tag):
    comm = 0x1234_5678_9ABC_DEF0
    raw = hashlib.blake2b(struct.pack("!Q", comm) + _independent_tag_bytes(tag), digest_size=8).digest()
    want = int.from_bytes(raw, "little") or 1
    assert tag_key(comm, tag) == want
    assert tag_key(comm, tag) == tag_key(comm, tag), "deterministic"


def test_tag_keys_distinct_and_nonzero():
    keys = {}
    for comm in (1, 2, M64):
        for tag in SAMPLE_TAGS + [("#seq", 1), ("#plan", 1), ("#seq", 2)]:
            k = tag_key(comm, tag)
            assert 0 < k <= M64
            assert (comm, repr(tag)) not in keys
            keys[(comm, repr(tag))] = k
    assert len(set(keys.values())) == len(keys), "different (communicator, tag) pairs must get different keys"


def test_tag_key_never_zero(monkeypatch):
    class ZeroDigest:
        def __init__(self, *a, **k):
            pass

        def digest(self):
            return bytes(8)

    monkeypatch.setattr(tags_mod.hashlib, "blake2b", ZeroDigest)
    assert tag_key(5, "x") == 1


@pytest.mark.parametrize("bad", [True, False, 1.0, None, b"x", [1], {"a": 1}, (1, True), ("a", (None,)), frozenset()])
def test_tag_key_rejects(bad):
    with pytest.raises(InvalidArgumentError, match="tag"):
        tag_key(1, bad)


def _keys_with_home(bucket: int, capacity: int, n: int, start: int = 1) -> list[int]:
    out, k = [], start
    while len(out) < n:
        if splitmix64_finaliser(k) % capacity == bucket:
            out.append(k)
        k += 1
    return out


def test_tag_table_instances():
    t = TagTable(16)
    key = 0xABCDEF
    b1, i1 = t.acquire(key, False)
    b2, i2 = t.acquire(key, False)
    b3, i3 = t.acquire(key, False)
    assert (i1, i2, i3) == (1, 2, 3)
    assert b1 == b2 == b3 == splitmix64_finaliser(key) % 16
    assert t.used == 1 and t.instances(key) == 3
    t.release(key, False)
    t.release(key, False)
    assert t.acquire(key, False)[1] == 4
    t.release(key, False)
    t.release(key, False)
    assert t.used == 0, "no instance pending: the bucket is free"
    b5, i5 = t.acquire(key, False)
    assert i5 == 5, "a persistent tag keeps counting"
    assert b5 == b1 and t.used == 1


def test_tag_table_keyed_once_an_instance_in_the_bucket_retired():
    """Until an instance placed in a bucket retires, the daemon's copy of
    the bucket may read as never used: submissions to it ask the daemon to
    write the key (DFCCL_TASK_KEY_BUCKET).  A cancelled submission never
    reached the daemon and keys nothing; a failed one did."""
    t = TagTable(8)
    a, b = 11, 12
    ba, _ = t.acquire(a, False)
    assert not t.keyed(ba)
    t.cancel(a)
    assert not t.keyed(ba), "a cancelled submission never reached the daemon"
    ba, _ = t.acquire(a, False)
    t.acquire(a, False)
    t.release(a, False)
    assert t.keyed(ba), "an instance there retired: the daemon pulled it"
    bb, _ = t.acquire(b, False)
    assert not t.keyed(bb) and bb != ba
    t.release(b, True)
    assert t.keyed(bb), "a failed instance reached the daemon too"


def test_tag_table_cancel_gives_the_instance_back():
    t = TagTable(8)
    key = 5
    t.acquire(key, False)
    assert t.acquire(key, False)[1] == 2
    t.cancel(key)
    assert t.instances(key) == 1 and t.used == 1
    assert t.acquire(key, False)[1] == 2


def test_tag_table_transient_forgets():
    t = TagTable(8)
    key = 77
    assert t.acquire(key, True)[1] == 1
    t.release(key, False)
    assert t.instances(key) == 0 and t.used == 0
    assert t.acquire(key, True) == (splitmix64_finaliser(key) % 8, 1)


def test_tag_table_linear_probing_free_and_reuse():
    cap = 8
    k1, k2, k3 = _keys_with_home(5, cap, 3)
    t = TagTable(cap)
    assert t.acquire(k1, False)[0] == 5
    assert t.acquire(k2, False)[0] == 6, "collision: next bucket"
    t.release(k1, False)
    assert t.used == 1
    assert t.acquire(k3, False)[0] == 5, "freed bucket is reused"
    # wrap-around from the last bucket
    j1, j2 = _keys_with_home(cap - 1, cap, 2)
    t2 = TagTable(cap)
    assert t2.acquire(j1, False)[0] == cap - 1
    assert t2.acquire(j2, False)[0] == 0


def test_tag_table_poisoned_stays_bound():
    cap = 4
    k1, k2 = _keys_with_home(2, cap, 2)
    t = TagTable(cap)
    b = t.acquire(k1, True)[0]
    t.release(k1, failed=True)
    assert t.used == 1, "a failed instance keeps its bucket (peers may read the abort marker)"
    assert t.acquire(k2, False)[0] == (b + 1) % cap, "the poisoned bucket is not handed to another tag"
    b_again, inst = t.acquire(k1, True)
    assert (b_again, inst) == (b, 2), "the poisoned tag keeps its bucket and its count"
    t.release(k1, failed=False)
    assert t.used == 2 and t.instances(k1) == 2, "still bound after a later success"


def test_tag_table_full():
    t = TagTable(3)
    for k in (11, 12, 13):
        t.acquire(k, False)
    with pytest.raises(ResourceError, match="tag records"):
        t.acquire(14, False)
    assert t.instances(14) == 0, "a failed acquire registers no instance"
    assert t.acquire(12, False)[1] == 2, "a tag already bound still gets new instances"
    t.release(12, False)
    t.release(12, False)
    assert t.acquire(14, False)[1] == 1


# ==========================================================================================
# staging pool
# ==========================================================================================
def test_staging_alloc_alignment_and_exhaustion():
    base, size = 270336, 16 * ALIGN
    p = StagingPool(base, size)
    assert ALIGN == 256
    a = p.alloc(1)
    b = p.alloc(257)
    c = p.alloc(256)
    assert (a, b, c) == (base, base + 256, base + 768)
    assert p.in_use == 256 + 512 + 256
    assert all((x - base) % ALIGN == 0 for x in (a, b, c))
    assert p.alloc(size) is None, "more than what is free"
    d = p.alloc(size - p.in_use)
    assert d == base + 1024
    assert p.alloc(1) is None and p.in_use == size
    p.free(b, 257)
    assert p.alloc(512) == b and p.in_use == size


def test_staging_coalescing_any_order():
    base, size = 4096, 8 * ALIGN
    for order in itertools.permutations(range(4)):
        p = StagingPool(base, size)
        offs = [p.alloc(2 * ALIGN) for _ in range(4)]
        assert offs == [base + 2 * ALIGN * i for i in range(4)]
        for i in order:
            p.free(offs[i], 2 * ALIGN)
        assert p.in_use == 0
        assert p.alloc(size) == base, f"free order {order}: the ranges were not merged back into one"


def test_staging_neighbours_merge():
    p = StagingPool(0, 10 * ALIGN)
    o = [p.alloc(ALIGN) for _ in range(10)]
    p.free(o[3], ALIGN)
    p.free(o[5], ALIGN)
    assert p.alloc(2 * ALIGN) is None
    p.free(o[4], 100)   # merges with both neighbours (rounded up to 256)
    assert p.alloc(3 * ALIGN) == o[3]


def test_staging_random_against_model():
    """Random alloc/free against a unit bitmap: no overlap, first fit, in_use
    exact, None only when no free run is long enough."""
    rng = np.random.default_rng(42)
    units = 64
    base = 1 << 20
    p = StagingPool(base, units * ALIGN)
    used = np.zeros(units, bool)
    live = {}
    for step in range(3000):
        if live and (rng.random() < 0.45 or len(live) > 20):
            off = list(live)[int(rng.integers(len(live)))]
            nbytes = live.pop(off)
            p.free(off, nbytes)
            u0, n = (off - base) // ALIGN, -(-nbytes // ALIGN)
            assert used[u0:u0 + n].all()
            used[u0:u0 + n] = False
        else:
            nbytes = int(rng.integers(1, 12 * ALIGN))
            n = -(-nbytes // ALIGN)
            first = None
            for u in range(units - n + 1):
                if not used[u:u + n].any():
                    first = u
                    break
            off = p.alloc(nbytes)
            if first is None:
                assert off is None, f"step {step}: alloc({nbytes}) succeeded without a free run"
                continue
            assert off == base + first * ALIGN, f"step {step}: alloc({nbytes}) -> {off}, first fit is {base + first * ALIGN}"
            used[first:first + n] = True
            live[off] = nbytes
        assert p.in_use == int(used.sum()) * ALIGN, f"step {step}: in_use {p.in_use}"


def test_staging_pool_reserved_blocks_apart_from_the_shared_part():
    """Reserved blocks (one per tag that can be pending) are never handed out
    by alloc(), and alloc_block() never touches the shared part."""
    base, bb = 1 << 20, 4 * ALIGN
    p = StagingPool(base, 3 * bb + 10 * ALIGN, block_bytes=bb, blocks=3)
    shared = p.alloc(10 * ALIGN)
    assert shared == base + 3 * bb and p.alloc(1) is None
    blocks = [p.alloc_block() for _ in range(3)]
    assert blocks == [base, base + bb, base + 2 * bb] and p.alloc_block() is None
    assert p.in_use == p.size and p.free_blocks == 0
    p.free(blocks[1], bb)
    assert p.alloc(1) is None and p.alloc_block() == blocks[1]
    p.free(shared, 10 * ALIGN)
    assert p.alloc(10 * ALIGN) == shared
    with pytest.raises(ValueError):
        StagingPool(base, bb, block_bytes=bb, blocks=2)


@pytest.mark.parametrize("reserved,tags,channels", [(64 << 20, 4096, 32), (256 << 10, 4096, 2), (1 << 20, 8, 32),
                                                    (256, 4096, 2), (0, 16, 1)])
def test_fifo_blocks_hold_two_minimal_slots_per_channel(reserved, tags, channels):
    block, blocks = fifo_blocks(reserved, tags, channels)
    assert block % ALIGN == 0 and block >= channels * 2 * 16
    assert blocks * block <= reserved and blocks <= tags
    assert blocks == tags or block == -(-channels * 32 // ALIGN) * ALIGN, "fewer blocks only when the least do not fit"


# ==========================================================================================
# plan_geometry
# ==========================================================================================
OPTS = CommOptions().resolved("sim")
GPU_OPTS = CommOptions().resolved("cuda")
KIND_IDS = {"all_reduce": KIND_ALL_REDUCE, "all_gather": KIND_ALL_GATHER, "reduce_scatter": KIND_REDUCE_SCATTER,
            "broadcast": KIND_BROADCAST, "reduce": KIND_REDUCE}
ALL_TYPES = list(DataType)


def test_geometry_single_rank_and_direct():
    g = plan_geometry(KIND_ALL_REDUCE, 1000, DataType.FLOAT32, 1, 2, False, OPTS)
    assert g.path == PATH_DIRECT and g.fifo_bytes == 0, "one rank: no ring"
    for kind in KIND_IDS.values():
        g = plan_geometry(kind, 1000, DataType.FLOAT32, 4, 2, True, OPTS)
        assert g.path == PATH_DIRECT and g.fifo_bytes == 0 and g.slice_bytes == 0
        g = plan_geometry(kind, 1000, DataType.FLOAT32, 4, 2, False, OPTS)
        assert g.path == PATH_RING and g.fifo_bytes == g.nchannels * g.fifo_slots * g.slice_bytes > 0
        assert g.fifo_slots == OPTS.ring_slots and g.flags == 0


def test_geometry_one_shot_only_small_direct_all_reduce():
    # Eligibility only: the daemon runs one phase if, in addition, no rank is in place.
    small = OPTS.one_shot_bytes // 4
    assert plan_geometry(KIND_ALL_REDUCE, small, DataType.FLOAT32, 4, 2, True, OPTS).flags == TASK_ONE_SHOT
    assert plan_geometry(KIND_ALL_REDUCE, 1, DataType.INT8, 2, 2, True, OPTS).flags == TASK_ONE_SHOT
    assert plan_geometry(KIND_ALL_REDUCE, small + 1, DataType.FLOAT32, 4, 2, True, OPTS).flags == 0, "too big"
    assert plan_geometry(KIND_ALL_REDUCE, small, DataType.FLOAT32, 4, 2, False, OPTS).flags == 0, "ring"
    for kind in (KIND_ALL_GATHER, KIND_REDUCE_SCATTER, KIND_BROADCAST, KIND_REDUCE):
        assert plan_geometry(kind, 4, DataType.FLOAT32, 4, 2, True, OPTS).flags == 0


@pytest.mark.parametrize("kind", list(KIND_IDS))
@pytest.mark.parametrize("direct", (True, False))
def test_geometry_channels(kind, direct):
    k = KIND_IDS[kind]
    for n, maxch, count, dt in itertools.product((2, 3, 8), (1, 2, 5, 32), (0, 1, 17, 65537, 1 << 22),
                                                 (DataType.INT8, DataType.FLOAT32, DataType.FLOAT64)):
        g = plan_geometry(k, count, dt, n, maxch, direct, OPTS)
        assert 1 <= g.nchannels <= maxch
        total = count * dt.itemsize * (n if kind in ("all_gather", "reduce_scatter") else 1)
        assert g.nchannels == max(1, min(maxch, -(-total // OPTS.bytes_per_channel)))


def test_two_channels_from_two_channel_bytes():
    """Across hosts a collective of 256 KiB or more takes two channels (the
    proxy's two lanes) where bytes_per_channel alone gives one; 0 turns the
    floor off; `channels` still caps it; p2p and all-to-all take the rule."""
    from dfccl.planning import channel_count
    from dfccl.point_to_point import plan_p2p

    net = CommOptions().resolved_for_network(CommOptions().resolved("cuda"))
    assert net.bytes_per_channel == 512 << 10 and net.two_channel_bytes == 256 << 10
    off = replace(net, two_channel_bytes=0)
    for moved, want, want_off in ((0, 1, 1), (4096, 1, 1), ((256 << 10) - 16, 1, 1), (256 << 10, 2, 1),
                                  (512 << 10, 2, 1), ((512 << 10) + 1, 2, 2), (1 << 20, 2, 2), (4 << 20, 8, 8)):
        assert channel_count(moved, 32, net) == want, moved
        assert channel_count(moved, 32, off) == want_off, moved
        assert channel_count(moved, 1, net) == 1
    for kind in ("all_reduce", "broadcast", "reduce"):
        g = plan_geometry(KIND_IDS[kind], 64 << 10, DataType.FLOAT32, 2, 32, False, net)
        assert g.path == PATH_RING and g.nchannels == 2, (kind, g)
    # all-gather / reduce-scatter count the n-times-larger side.
    assert plan_geometry(KIND_IDS["all_gather"], 32 << 10, DataType.FLOAT32, 2, 32, False, net,
                         ll_reach=False).nchannels == 2
    assert plan_p2p(64 << 10, DataType.FLOAT32, 32, False, net).nchannels == 2
    assert plan_p2p(64 << 10, DataType.FLOAT32, 32, False, off).nchannels == 1
    # On one host the floor is off by default.
    assert CommOptions().resolved("cuda").two_channel_bytes == 0


def test_network_defaults_keep_what_the_user_set():
    from dfccl.options import (NET_BYTES_PER_CHANNEL, NET_MAX_SLICE_BYTES, NET_MIN_SLICE_BYTES,
                               NET_TWO_CHANNEL_BYTES)

    for backend in ("sim", "cuda"):
        assert CommOptions().resolved(backend).min_slice_bytes == 256
        net = CommOptions().resolved_for_network(CommOptions().resolved(backend))
        assert (net.bytes_per_channel, net.max_slice_bytes, net.min_slice_bytes, net.two_channel_bytes) == (
            NET_BYTES_PER_CHANNEL, NET_MAX_SLICE_BYTES, NET_MIN_SLICE_BYTES, NET_TWO_CHANNEL_BYTES)
        assert net.staging_bytes == CommOptions().resolved(backend).staging_bytes
        user = CommOptions(bytes_per_channel=4096, max_slice_bytes=1024, min_slice_bytes=512, two_channel_bytes=0)
        net = user.resolved_for_network(user.resolved(backend))
        assert (net.bytes_per_channel, net.max_slice_bytes, net.min_slice_bytes, net.two_channel_bytes) == (
            4096, 1024, 512, 0)
    with pytest.raises(InvalidArgumentError, match="two_channel_bytes"):
        CommOptions(two_channel_bytes=-1)


def test_ll_across_hosts_takes_the_small_symmetric_collectives():
    """A communicator that spans hosts runs the ring, yet its peers' LL areas
    are reached through the proxy (ll_reach): the three symmetric kinds and
    broadcast up to ll_max_bytes take LL there, on one channel; the rest
    stays on the ring, and protocol="simple" keeps everything on it."""
    from dataclasses import replace

    opts = replace(CommOptions().resolved_for_network(OPTS), ll_max_bytes=2048)
    f32 = DataType.FLOAT32
    for kind in (KIND_ALL_REDUCE, KIND_ALL_GATHER, KIND_REDUCE_SCATTER):
        g = plan_geometry(kind, 512, f32, 4, 8, False, opts, ll_reach=True)
        assert (g.path, g.nchannels, g.flags) == (PATH_DIRECT, 1, TASK_LL)
        assert plan_geometry(kind, 513, f32, 4, 8, False, opts, ll_reach=True).path == PATH_RING, "over ll_max_bytes"
        assert plan_geometry(kind, 512, f32, 4, 8, False, opts).path == PATH_RING, "no reach"
        assert plan_geometry(kind, 512, f32, 9, 8, False, opts, ll_reach=True).path == PATH_RING, "over 8 ranks"
        simple = replace(opts, protocol="simple")
        assert plan_geometry(kind, 512, f32, 4, 8, False, simple, ll_reach=True).path == PATH_RING
    # A broadcast takes LL's rooted form across hosts only; reduce never.
    g = plan_geometry(KIND_BROADCAST, 512, f32, 4, 8, False, opts, ll_reach=True)
    assert (g.path, g.nchannels, g.flags) == (PATH_DIRECT, 1, TASK_LL)
    assert plan_geometry(KIND_BROADCAST, 513, f32, 4, 8, False, opts, ll_reach=True).path == PATH_RING
    assert plan_geometry(KIND_BROADCAST, 512, f32, 4, 8, True, opts).flags != TASK_LL, "one host: direct"
    assert plan_geometry(KIND_REDUCE, 512, f32, 4, 8, False, opts, ll_reach=True).path == PATH_RING


def test_min_slice_bytes_cuts_small_channels_in_fewer_slices():
    """Across hosts a channel under NET_MIN_SLICE_BYTES goes as one slice (one
    message, one credit) instead of ring_slots small ones; larger channels
    are cut as before, and min_slice_bytes=256 plans as on one host."""
    from dfccl.point_to_point import plan_p2p

    with pytest.raises(InvalidArgumentError):
        CommOptions(min_slice_bytes=1000)
    with pytest.raises(InvalidArgumentError):
        CommOptions(min_slice_bytes=128)
    for backend in ("sim", "cuda"):
        net = CommOptions().resolved_for_network(CommOptions().resolved(backend))
        as_before = CommOptions(min_slice_bytes=256)
        old = as_before.resolved_for_network(as_before.resolved(backend))
        f32 = DataType.FLOAT32
        for kind in (KIND_BROADCAST, KIND_REDUCE):
            assert plan_geometry(kind, 1024, f32, 2, 8, False, net).slice_bytes == 4096
            assert plan_geometry(kind, 1024, f32, 2, 8, False, old).slice_bytes == 1024
            # A MiB: two channels of 512 KiB, each cut in ring_slots slices.
            assert plan_geometry(kind, 1 << 18, f32, 2, 8, False, net).slice_bytes == 128 << 10
            assert plan_geometry(kind, 1 << 14, f32, 2, 8, False, net).slice_bytes == 64 << 10
            # Never more than the channel holds, rounded to whole packs.
            assert plan_geometry(kind, 3, f32, 2, 8, False, net).slice_bytes == 256
        assert plan_p2p(1024, f32, 8, False, net).slice_bytes == 4096
        assert plan_p2p(1024, f32, 8, False, old).slice_bytes == 1024
        # The staging budget's cap still wins over the floor.
        user = CommOptions(max_slice_bytes=4096)
        tight = user.resolved_for_network(user.resolved(backend))
        assert plan_geometry(KIND_BROADCAST, 1 << 14, f32, 2, 8, False, tight).slice_bytes == 4096


@pytest.mark.parametrize("opts", [OPTS, GPU_OPTS, CommOptions(max_slice_bytes=256).resolved("sim"),
                                  CommOptions().resolved_for_network(CommOptions().resolved("cuda")),
                                  CommOptions(max_slice_bytes=4096, ring_slots=2).resolved("sim"),
                                  CommOptions(bytes_per_channel=1024, ring_slots=8).resolved("sim")],
                         ids=["sim", "cuda-defaults", "slice256", "network", "slice4k", "bpc1k"])
def test_geometry_ring_slices(opts):
    for kind, n, count, dt in itertools.product(KIND_IDS.values(), (2, 3, 4, 8, 16),
                                                (1, 3, 17, 1000, 4099, 65537, 1 << 20), ALL_TYPES):
        g = plan_geometry(kind, count, dt, n, 8, False, opts)
        what = f"kind {kind} n {n} count {count} {dt.name}"
        assert g.path == PATH_RING, what
        assert g.slice_bytes % 16 == 0, f"{what}: slice_bytes {g.slice_bytes} is not a multiple of 16"
        assert 256 <= g.slice_bytes <= max(256, opts.max_slice_bytes), f"{what}: slice_bytes {g.slice_bytes}"
        assert g.slice_bytes % dt.itemsize == 0
        assert g == plan_geometry(kind, count, dt, n, 8, False, opts), f"{what}: not deterministic"


def test_geometry_slice_multiple_of_16_for_any_max_slice_bytes():
    with pytest.raises(InvalidArgumentError):
        CommOptions(max_slice_bytes=1000)
    for max_slice in (256, 1008, 4096 + 16, 65536):
        opts = CommOptions(max_slice_bytes=max_slice).resolved("sim")
        g = plan_geometry(KIND_ALL_REDUCE, 100003, DataType.FLOAT32, 3, 2, False, opts)
        assert g.slice_bytes % 16 == 0 and 256 <= g.slice_bytes <= max_slice, g


def test_geometry_identical_inputs_identical_results():
    args = (KIND_REDUCE_SCATTER, 12345, DataType.BFLOAT16, 6, 4, False, OPTS)
    assert plan_geometry(*args) == plan_geometry(*args)
    assert hash(plan_geometry(*args)) == hash(plan_geometry(*args))
    same_opts = CommOptions(extra={"ignored": 1}).resolved("sim")
    assert plan_geometry(*args[:-1], same_opts) == plan_geometry(*args)


# ==========================================================================================
# types
# ==========================================================================================
@pytest.mark.parametrize("value,want", [
    ("int8", DataType.INT8), ("uint8", DataType.UINT8), ("int32", DataType.INT32), ("uint32", DataType.UINT32),
    ("int64", DataType.INT64), ("uint64", DataType.UINT64), ("float16", DataType.FLOAT16), ("half", DataType.FLOAT16),
    ("float32", DataType.FLOAT32), ("float", DataType.FLOAT32), ("float64", DataType.FLOAT64),
    ("double", DataType.FLOAT64), ("bfloat16", DataType.BFLOAT16), ("FLOAT32", DataType.FLOAT32),
    ("torch.bfloat16", DataType.BFLOAT16), (np.dtype("uint64"), DataType.UINT64), (np.dtype("<f2"), DataType.FLOAT16),
    (DataType.INT32, DataType.INT32)])
def test_as_data_type(value, want):
    assert as_data_type(value) is want


def test_as_data_type_objects_with_name_or_str():
    class TorchLikeDtype:           # torch.dtype has no .name; str() is "torch.float16"
        def __str__(self):
            return "torch.float16"

    class Named:
        name = "int64"

    assert as_data_type(TorchLikeDtype()) is DataType.FLOAT16
    assert as_data_type(Named()) is DataType.INT64


@pytest.mark.parametrize("bad", ["complex64", "int16", "uint16", "bool", "float8", "", None, 3.5, np.dtype("c8")])
def test_as_data_type_rejects(bad):
    with pytest.raises(InvalidArgumentError, match="unsupported dtype"):
        as_data_type(bad)


@pytest.mark.parametrize("scalar_type", [np.float32, np.int8, np.uint64, np.float16])
def test_as_data_type_numpy_scalar_types(scalar_type):
    assert as_data_type(scalar_type) is as_data_type(np.dtype(scalar_type))


def test_datatype_itemsize_and_values():
    sizes = {"INT8": 1, "UINT8": 1, "INT32": 4, "UINT32": 4, "INT64": 8, "UINT64": 8, "FLOAT16": 2, "FLOAT32": 4,
             "FLOAT64": 8, "BFLOAT16": 2}
    assert {d.name: d.itemsize for d in DataType} == sizes
    assert [int(d) for d in DataType] == list(range(10))
    assert [int(o) for o in ReduceOp] == list(range(5))


@pytest.mark.parametrize("value,want", [("sum", ReduceOp.SUM), ("SUM", ReduceOp.SUM), ("prod", ReduceOp.PROD),
                                        ("product", ReduceOp.PROD), ("min", ReduceOp.MIN), ("Max", ReduceOp.MAX),
                                        ("avg", ReduceOp.AVG), ("mean", ReduceOp.AVG), (ReduceOp.MIN, ReduceOp.MIN)])
def test_as_reduce_op(value, want):
    assert as_reduce_op(value) is want


def test_buffer_element_type_agrees_with_the_typestr_rules_and_skips_the_name_when_it_can():
    """as_buffer takes '<f4'-style typestrs from one table (BY_FULL_TYPESTR)
    without reading the array's dtype name; every other typestr goes through
    dtype_from_typestr with that name, as before.  Same answer or same
    error on every typestr, except that a 1-, 4- or 8-byte typestr is its
    own type even where the name says bfloat16."""
    from dfccl.buffers import _dtype_of
    from dfccl.types import BY_FULL_TYPESTR

    assert "<f2" not in BY_FULL_TYPESTR and "<V2" not in BY_FULL_TYPESTR and ">f4" not in BY_FULL_TYPESTR

    class Named:
        def __init__(self, name):
            self.reads = 0
            self._name = name

        @property
        def name(self):
            self.reads += 1
            return self._name

    class Arr:
        def __init__(self, name):
            self.dtype = Named(name)

    for typestr in ("<f4", "|i1", ">u1", "<V2", ">f4", ">i8", "<c8", "|b1", "<i2", "|O", "<f16", "<f2", "|u1",
                    "<u8", "=f4"):
        for name in ("float32", "bfloat16", None):
            arr = Arr(name)
            try:
                want = dtype_from_typestr(typestr, name)
            except InvalidArgumentError:
                with pytest.raises(InvalidArgumentError, match="send"):
                    _dtype_of(arr, typestr, "send")
                continue
            fast = typestr in ("<f4", "|i1", "|u1", "<u8")
            if fast and name == "bfloat16":
                # A 1-, 4- or 8-byte element is not bfloat16 whatever the
                # name says: the typestr's own type.
                assert _dtype_of(arr, typestr, "send") is dtype_from_typestr(typestr), typestr
                continue
            assert _dtype_of(arr, typestr, "send") is want, (typestr, name)
            assert arr.dtype.reads == (0 if fast else 1), typestr


@pytest.mark.parametrize("bad", ["median", "", " sum", None, 0, 1.0, b"sum"])
def test_as_reduce_op_rejects(bad):
    with pytest.raises(InvalidArgumentError, match="unsupported reduction"):
        as_reduce_op(bad)


def test_dtype_from_typestr_and_dlpack():
    assert dtype_from_typestr("<f4") is DataType.FLOAT32
    assert dtype_from_typestr("|i1") is DataType.INT8
    assert dtype_from_typestr(">u1") is DataType.UINT8, "one-byte types have no byte order"
    assert dtype_from_typestr("<V2", "bfloat16") is DataType.BFLOAT16
    for bad in (">f4", ">i8", "<c8", "|b1", "<i2", "|O", "<f16"):
        with pytest.raises(InvalidArgumentError):
            dtype_from_typestr(bad)
    assert dtype_from_dlpack(4, 16, 1) is DataType.BFLOAT16
    assert dtype_from_dlpack(2, 32, 1) is DataType.FLOAT32
    for bad in ((2, 32, 4), (6, 8, 1), (5, 64, 1), (0, 16, 1), (2, 8, 1)):
        with pytest.raises(InvalidArgumentError, match="DLPack"):
            dtype_from_dlpack(*bad)


# ==========================================================================================
# streams
# ==========================================================================================
class _CudaStreamAttr:
    def __init__(self, v):
        self.cuda_stream = v


class _Protocol:
    def __init__(self, v):
        self._v = v
        self.cuda_stream = 999   # the protocol wins over the attribute

    def __cuda_stream__(self):
        return self._v


class _ProtocolAttr:
    __cuda_stream__ = (0, 4242)


class _Ptr:
    ptr = 77


class _Handle:
    handle = 88


@pytest.mark.parametrize("stream,want", [(0, 0), (1, 1), (0xDEADBEEF, 0xDEADBEEF), (2**63, 2**63),
                                         (np.int64(5).item(), 5), (_CudaStreamAttr(1234), 1234),
                                         (_CudaStreamAttr(0), 0), (_Protocol((0, 5678)), 5678), (_Protocol(91), 91),
                                         (_ProtocolAttr(), 4242), (_Ptr(), 77), (_Handle(), 88)])
def test_stream_handle(stream, want):
    assert stream_handle(stream) == want
    assert isinstance(stream_handle(stream), int)


@pytest.mark.parametrize("bad", [True, False, None, object(), "0", 1.5, [1]])
def test_stream_handle_rejects(bad):
    with pytest.raises(InvalidArgumentError, match="stream"):
        stream_handle(bad)


# ==========================================================================================
# buffers
# ==========================================================================================
NUMPY_DTYPES = [("int8", DataType.INT8), ("uint8", DataType.UINT8), ("int32", DataType.INT32),
                ("uint32", DataType.UINT32), ("int64", DataType.INT64), ("uint64", DataType.UINT64),
                ("float16", DataType.FLOAT16), ("float32", DataType.FLOAT32), ("float64", DataType.FLOAT64)]


@pytest.mark.parametrize("name,want", NUMPY_DTYPES)
def test_as_buffer_numpy(name, want):
    a = np.arange(10).astype(name)
    b = as_buffer(a)
    assert (b.ptr, b.count, b.dtype, b.device_type, b.device, b.readonly) == (a.ctypes.data, 10, want, "cpu", -1, False)
    assert b.owner is a and b.nbytes == a.nbytes
    a.setflags(write=False)
    assert as_buffer(a).readonly
    e = np.zeros(0, name)
    assert as_buffer(e).count == 0


def test_as_buffer_shapes():
    a = np.zeros((4, 5), np.float32)
    assert as_buffer(a).count == 20
    assert as_buffer(a[1]).ptr == a.ctypes.data + 5 * 4
    assert as_buffer(a[1:3]).count == 10
    assert as_buffer(a[:, None, :]).count == 20, "size-1 dimensions do not break contiguity"
    assert as_buffer(np.full((), 3.0)).count == 1, "a 0-d array owns its memory"
    with pytest.raises(InvalidArgumentError, match="numpy scalar"):
        as_buffer(np.float64(3.0) * np.ones(()))   # a numpy scalar: its export is a temporary copy
    assert as_buffer(np.zeros((0, 3), np.int8)[:, ::2]).count == 0
    for bad in (np.asfortranarray(a), a[:, 1], a[::2], a.T, np.zeros(10, np.int32)[::-1]):
        with pytest.raises(InvalidArgumentError, match="contiguous"):
            as_buffer(bad)


@pytest.mark.parametrize("bad", [np.zeros(3, np.bool_), np.zeros(3, np.complex64), np.zeros(3, np.int16),
                                 np.zeros(3, ">i4"), np.zeros(3, object), np.zeros(3, "U3")])
def test_as_buffer_unsupported_dtypes(bad):
    with pytest.raises(InvalidArgumentError):
        as_buffer(bad)


@pytest.mark.parametrize("bad", [[1, 2, 3], (1.0,), 5, None, b"abc", "abc", memoryview(b"abc")])
def test_as_buffer_non_arrays(bad):
    with pytest.raises(InvalidArgumentError, match="not an array"):
        as_buffer(bad, "send")


def test_as_buffer_passes_buffers_through_and_names_what():
    buf = Buffer.from_pointer(4096, 3, "float32")
    assert as_buffer(buf) is buf
    with pytest.raises(InvalidArgumentError, match="^my recv"):
        as_buffer(np.zeros((3, 3))[:, 0], "my recv")


class _DLPackOnly:
    """Exposes only the DLPack protocol, delegating to a numpy array."""

    def __init__(self, arr):
        self._arr = arr

    def __dlpack__(self, *args, **kwargs):
        return self._arr.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self._arr.__dlpack_device__()


@pytest.mark.parametrize("name,want", NUMPY_DTYPES)
def test_as_buffer_dlpack(name, want):
    a = np.arange(12).astype(name).reshape(3, 4)
    obj = _DLPackOnly(a)
    assert not hasattr(obj, "__array_interface__")
    b = as_buffer(obj)
    assert (b.ptr, b.count, b.dtype, b.device_type, b.device) == (a.ctypes.data, 12, want, "cpu", -1)
    assert as_buffer(_DLPackOnly(a[1])).ptr == a.ctypes.data + 4 * a.itemsize
    with pytest.raises(InvalidArgumentError, match="contiguous"):
        as_buffer(_DLPackOnly(a[:, ::2]))
    with pytest.raises(InvalidArgumentError, match="contiguous"):
        as_buffer(_DLPackOnly(np.asfortranarray(a)))


def test_as_buffer_dlpack_unsupported_dtype():
    for arr in (np.zeros(4, np.complex64), np.zeros(4, np.int16), np.zeros(4, np.bool_)):
        with pytest.raises(InvalidArgumentError):
            as_buffer(_DLPackOnly(arr))


def test_as_buffer_bfloat16_array_interface():
    """An ml_dtypes-style bfloat16 array: typestr '<V2' with dtype name 'bfloat16'."""
    storage = np.zeros(6, np.uint16)

    class BF16Array:
        class dtype:
            name = "bfloat16"
        __array_interface__ = {"typestr": "<V2", "data": (storage.ctypes.data, False), "shape": (6,),
                               "strides": None, "version": 3}

    b = as_buffer(BF16Array())
    assert (b.dtype, b.count, b.ptr, b.device_type) == (DataType.BFLOAT16, 6, storage.ctypes.data, "cpu")


def test_as_buffer_cuda_array_interface_without_cuda():
    class FakeDevArray:
        def __init__(self, n):
            self.__cuda_array_interface__ = {"typestr": "<f4", "data": (0x7F0000000000, False), "shape": (n,),
                                             "strides": None, "version": 3}

    with pytest.raises(InvalidArgumentError, match="not CUDA device memory"):
        as_buffer(FakeDevArray(4))
    empty = as_buffer(FakeDevArray(0))
    assert (empty.device_type, empty.count) == ("cuda", 0)


def test_as_buffer_cuda_array_interface_raising_falls_back_to_dlpack():
    a = np.arange(6, dtype=np.float32)

    class TensorLike(_DLPackOnly):
        @property
        def __cuda_array_interface__(self):
            raise TypeError("dtype not supported by __cuda_array_interface__")

    b = as_buffer(TensorLike(a))
    assert (b.ptr, b.count, b.dtype) == (a.ctypes.data, 6, DataType.FLOAT32)


def test_as_buffer_void_cuda_array_interface_uses_dlpack():
    """torch 2.11 exports a CUDA bfloat16 tensor's interface with typestr
    '<V2' (no type name): the type comes from DLPack instead."""
    torch = pytest.importorskip("torch")
    t = torch.arange(6, dtype=torch.bfloat16)

    class CudaBF16Like:
        __cuda_array_interface__ = {"typestr": "<V2", "data": (t.data_ptr(), False), "shape": (6,),
                                    "strides": None, "version": 3}

        def __dlpack__(self, stream=None):
            return t.__dlpack__()

        def __dlpack_device__(self):
            return t.__dlpack_device__()

    b = as_buffer(CudaBF16Like())
    assert (b.dtype, b.count, b.ptr) == (DataType.BFLOAT16, 6, t.data_ptr())
    with pytest.raises(InvalidArgumentError, match="unsupported array element type '<V2'"):
        as_buffer(type("NoDLPack", (), {"__cuda_array_interface__": CudaBF16Like.__cuda_array_interface__})())


@pytest.mark.parametrize("dtype", [np.complex64, np.bool_, object])
def test_unsupported_element_type_names_the_argument_and_what_is_supported(dtype):
    with pytest.raises(InvalidArgumentError, match=r"^all_reduce send: unsupported array element type .*; "
                                                   r"supported: int8, uint8, .*float32, float64, bfloat16$"):
        as_buffer(np.zeros(4, dtype), "all_reduce send")


def test_buffer_from_pointer_and_view():
    arr = np.zeros(8, np.uint16)
    b = Buffer.from_pointer(arr.ctypes.data, 8, "bfloat16", owner=arr)
    assert (b.device_type, b.device, b.readonly, b.nbytes, b.owner) == ("cpu", -1, False, 16, arr)
    v = b.view(3, 2)
    assert (v.ptr, v.count, v.dtype, v.owner) == (arr.ctypes.data + 6, 2, DataType.BFLOAT16, arr)
    d = Buffer.from_pointer(1 << 40, 4, DataType.FLOAT64, device=1, readonly=True)
    assert (d.device_type, d.device, d.readonly) == ("cuda", 1, True)
    for ptr, count in ((-1, 4), (4096, -1)):
        with pytest.raises(InvalidArgumentError):
            Buffer.from_pointer(ptr, count, "float32")
    with pytest.raises(InvalidArgumentError, match="unsupported dtype"):
        Buffer.from_pointer(4096, 1, "int16")
    with pytest.raises(Exception):
        b.count = 3   # frozen


def test_link_ahead_option_and_environment(monkeypatch):
    from dfccl.options import DaemonOptions, link_ahead, LINK_AHEAD_ENV
    monkeypatch.delenv(LINK_AHEAD_ENV, raising=False)
    assert link_ahead(DaemonOptions()) == 0
    assert link_ahead(DaemonOptions(link_ahead=1)) == 1
    monkeypatch.setenv(LINK_AHEAD_ENV, "3")
    assert link_ahead(DaemonOptions()) == 3
    assert link_ahead(DaemonOptions(link_ahead=2)) == 2, "the option wins over the environment"
    for bad in ("4", "-1", "two"):
        monkeypatch.setenv(LINK_AHEAD_ENV, bad)
        with pytest.raises(InvalidArgumentError, match=LINK_AHEAD_ENV):
            link_ahead(DaemonOptions())
    for bad in (4, -1, True, 1.0):
        with pytest.raises(InvalidArgumentError, match="link_ahead"):
            DaemonOptions(link_ahead=bad)


def test_window_policy_adapts_towards_twice_the_p90_wait():
    from dfccl.policy import WindowPolicy
    p = WindowPolicy(base_window_ns=200_000, max_window_ns=10**9, idle_quit_ns=10**9, relaunch_backoff_ns=1,
                     min_base_ns=50_000, max_base_ns=1_000_000)
    assert p.adapt(7, 0, [1000] * 7) is None, "fewer than 8 completions: no change"
    # Short waits: halfway (geometrically) towards the floor.
    assert p.adapt(10, 5, [1000] * 10) == 100_000 and p.history[-1] == (100_000, 0.5)
    # Peers that arrive late: the base grows towards twice the 90th percentile.
    waits = [10_000] * 5 + [900_000] * 5
    assert p.adapt(10, 0, waits * 10) == int((100_000 * 1_000_000) ** 0.5)
    fixed = WindowPolicy(base_window_ns=200_000, max_window_ns=10**9, idle_quit_ns=10**9, relaunch_backoff_ns=1,
                         min_base_ns=50_000, max_base_ns=1_000_000, adaptive=False)
    assert fixed.adapt(100, 0, [1000] * 100) is None and fixed.base_window_ns == 200_000


def test_empty_quit_defaults_and_bounds():
    """The empty quit: 50 us on a GPU, 2 ms in the simulator, never longer
    than the idle quit, negative refused; preemption off keeps the daemon
    (both infinite unless asked)."""
    from dfccl.options import DaemonOptions
    from dfccl.policy import EMPTY_QUIT_GPU_NS, INFINITE_NS, default_policy

    gpu, sim = default_policy("cuda", DaemonOptions()), default_policy("sim", DaemonOptions())
    assert gpu.empty_quit_ns == EMPTY_QUIT_GPU_NS == 50_000 and gpu.idle_quit_ns == 5_000_000
    assert sim.empty_quit_ns == 2_000_000 and sim.idle_quit_ns == 20_000_000
    assert default_policy("cuda", DaemonOptions(empty_quit_ns=10**6)).empty_quit_ns == 10**6
    capped = default_policy("cuda", DaemonOptions(idle_quit_ns=30_000, empty_quit_ns=10**6))
    assert capped.empty_quit_ns == 30_000, "an empty daemon does not stay longer than an idle one"
    assert default_policy("cuda", DaemonOptions(preemption=False)).empty_quit_ns == INFINITE_NS
    with pytest.raises(InvalidArgumentError, match="empty_quit_ns"):
        DaemonOptions(empty_quit_ns=-1)


def test_daemon_share_gives_sharing_ranks_disjoint_blocks():
    from dfccl.sharing import daemon_share

    def peer(pid, device, blocks=32):
        return {"host": "h", "pid": pid, "backend": "cuda", "device": device, "blocks": blocks}

    # Two ranks in one process on one device: 16 channels each, 16 blocks apart.
    two = [peer(1, 0), peer(1, 0)]
    assert [daemon_share(two, r, 32) for r in range(2)] == [(16, 0), (16, 16)]
    # Ranks in separate processes each have a daemon of their own.
    apart = [peer(1, 0), peer(2, 0)]
    assert [daemon_share(apart, r, 32) for r in range(2)] == [(32, 0), (32, 0)]
    # The smallest share sets every rank's channels; offsets count within a daemon.
    mixed = [peer(1, 0), peer(1, 1), peer(1, 0), peer(1, 0), peer(2, 0, blocks=8)]
    got = [daemon_share(mixed, r, 32) for r in range(5)]
    assert {c for c, _ in got} == {8}
    assert [o for _, o in got] == [0, 0, 8, 16, 0]
    # Never below one channel, and never above what was asked.
    crowd = [peer(1, 0, blocks=2)] * 5
    assert [daemon_share(crowd, r, 32) for r in range(5)] == [(1, k) for k in range(5)]
    assert daemon_share(two, 0, 4) == (4, 0) and daemon_share(two, 1, 4) == (4, 4)
