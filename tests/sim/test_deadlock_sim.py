"""Deadlock freedom on the simulator: the scenarios that hang NCCL complete with
every element checked, and the same scenarios hang when preemption is off
(windows infinite, i.e. NCCL-like run-to-completion), which shows that
preemption is what saves them."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import dfccl
from dfccl._native.layout import first_block
from dfccl.tags import tag_key
from dfccl_support import scenarios as sc

PATHS = ("direct", "ring")


def make_comms(n: int, path: str, *, per_device: int = 1, daemon_options=None):
    """n ranks on fresh simulated GPUs (``per_device`` ranks share one)."""
    base = sc.fresh_sim_devices(1)[0]
    devices = [base + r // per_device for r in range(n)]
    return dfccl.Communicator.for_devices(devices, backend="sim", options=dfccl.CommOptions(path=path),
                                          daemon_options=daemon_options)


def close_all(comms):
    for c in comms:
        c.close()


@pytest.fixture
def rng(request):
    seed = abs(hash(request.node.nodeid)) % (2**32)
    return np.random.default_rng(seed)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("n", [2, 4, 8])
def test_inconsistent_order(n, path, rng):
    """Half the ranks issue A then B, the others B then A."""
    comms = make_comms(n, path)
    try:
        specs = [sc.Spec("A", "all_reduce", 1 << 16, "float32"), sc.Spec("B", "all_reduce", 1 << 10, "int32", "max")]
        orders = [[0, 1] if r % 2 == 0 else [1, 0] for r in range(n)]
        rep = sc.run(comms, specs, orders, rng=rng, timeout=60)
        assert rep.collectives == 2
    finally:
        close_all(comms)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("n", [2, 4, 8])
def test_random_permutations(n, path, rng):
    """Every rank issues the same 32 collectives (mixed kinds, 4 B .. 4 MiB)
    in its own random permutation, three rounds with fresh data."""
    comms = make_comms(n, path)
    try:
        specs = sc.random_specs(rng, 32, nranks=n, max_bytes=(4 << 20) if n <= 4 else (1 << 20))
        orders = [list(rng.permutation(len(specs))) for _ in range(n)]
        rep = sc.run(comms, specs, orders, rng=rng, rounds=3, timeout=120)
        assert rep.collectives == 96
        assert len(rep.preemptions) == 32
    finally:
        close_all(comms)


@pytest.mark.parametrize("path", PATHS)
def test_overlapping_communicators(path, rng):
    """4 ranks in a world communicator, two pair communicators and a middle
    pair, each rank issuing its share in its own order across communicators
    (the tensor/data/pipeline-parallel pattern)."""
    n = 4
    base = sc.fresh_sim_devices(1)[0]
    devices = [base + r for r in range(n)]
    opts = dfccl.CommOptions(path=path)
    world = dfccl.Communicator.for_devices(devices, backend="sim", options=opts)
    pairs = [dfccl.Communicator.for_devices(devices[i:i + 2], backend="sim", options=opts) for i in (0, 2)]
    middle = dfccl.Communicator.for_devices(devices[1:3], backend="sim", options=opts)
    comm_of = {}  # (group name, global rank) -> communicator
    for r in range(n):
        comm_of[("world", r)] = world[r]
    for g, (lo, comms) in enumerate(zip((0, 2), pairs)):
        for i, c in enumerate(comms):
            comm_of[(f"pair{g}", lo + i)] = c
    for i, c in enumerate(middle):
        comm_of[("middle", 1 + i)] = c
    groups = {"world": [0, 1, 2, 3], "pair0": [0, 1], "pair1": [2, 3], "middle": [1, 2]}
    specs = {g: sc.random_specs(rng, 6, nranks=len(m), max_bytes=256 << 10, prefix=f"{g}-") for g, m in groups.items()}
    # Each rank: all its collectives across groups, shuffled.
    per_rank = {r: [(g, i) for g, m in groups.items() if r in m for i in range(6)] for r in range(n)}
    for r in per_rank:
        rng.shuffle(per_rank[r])
    insts = {g: [sc.prepare(s, [comm_of[(g, r)] for r in m], rng) for s in specs[g]] for g, m in groups.items()}
    errors = []

    def drive(r):
        try:
            for g, i in per_rank[r]:
                sc.submit(insts[g][i], comm_of[(g, r)])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=drive, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    try:
        for g in groups:
            for inst in insts[g]:
                for w in inst.works:
                    w.synchronize(timeout=120)
                sc.verify(inst)
    finally:
        for comms in [world, middle, *pairs]:
            close_all(comms)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("n", [2, 4])
def test_wait_between_collectives(n, path, rng):
    """Rank 0 waits for each collective before submitting the next; the other
    ranks issue them in the opposite order without waiting.  With NCCL the
    others' streams block on the first collective rank 0 has not issued while
    rank 0 blocks on one queued behind it."""
    comms = make_comms(n, path)
    try:
        specs = sc.random_specs(rng, 6, nranks=n, max_bytes=1 << 20)
        orders = [list(range(6)) if r == 0 else list(range(5, -1, -1)) for r in range(n)]
        sc.run(comms, specs, orders, rng=rng, threads=True, wait_each={0}, timeout=60)
    finally:
        close_all(comms)


@pytest.mark.parametrize("path", PATHS)
def test_device_sync_between_collectives(path, rng):
    """A device-wide synchronise on rank 0 while its collective waits for rank
    1, which only submits after that synchronise returns (one thread drives
    both, as a single-process multi-GPU program does)."""
    comms = make_comms(2, path)
    try:
        specs = [sc.Spec(f"S{i}", "all_reduce", 4096, "float32") for i in range(3)]
        insts = [sc.prepare(s, comms, rng) for s in specs]
        t0 = time.perf_counter()
        for inst in insts:
            sc.submit(inst, comms[0])
            dfccl.device_synchronize("sim", comms[0].device)  # returns once the daemon quits idle
            sc.submit(inst, comms[1])
        for inst in insts:
            for w in inst.works:
                w.synchronize(timeout=30)
            sc.verify(inst)
        assert time.perf_counter() - t0 < 30
    finally:
        close_all(comms)


@pytest.mark.parametrize("path", PATHS)
def test_thousand_queued_before_peer_starts(path, rng):
    """Rank 0 queues 1,000 collectives before rank 1 submits any, then rank 1
    submits them in reverse order."""
    comms = make_comms(2, path)
    try:
        count = 1000
        specs = [sc.Spec(i, "all_reduce", 1 + i % 64, "int32") for i in range(count)]
        orders = [list(range(count)), list(range(count - 1, -1, -1))]
        rep = sc.run(comms, specs, orders, rng=rng, timeout=300)
        assert rep.collectives == count
    finally:
        close_all(comms)


def submit_then_check(comms, insts, *, stagger: bool = False):
    """Submits every instance on every rank (with ``stagger``, all of rank 0's
    first, then the others' after rank 0's daemon has cycled through them for
    50 ms), waits for all and checks every element."""
    if stagger:
        for inst in insts:
            sc.submit(inst, comms[0])
        time.sleep(0.05)
        assert not any(inst.works[0].done() for inst in insts), "completed without its peers"
    for inst in insts:
        for c in comms[1 if stagger else 0:]:
            sc.submit(inst, c)
    for inst in insts:
        for w in inst.works:
            w.synchronize(timeout=60)
        sc.verify(inst)


@pytest.mark.parametrize("path", PATHS)
def test_one_tag_pending_with_different_channel_counts(path, rng):
    """Instances of one tag run in order on every channel, also when they use
    different numbers of channels: rank 0 queues large, small, large, small,
    large instances of one tag (4, 1, 4, 1, 4 channels) before rank 1 submits
    any; a later large instance must not start on channel 2 while an earlier
    one still waits there."""
    base = sc.fresh_sim_devices(1)[0]
    opts = dfccl.CommOptions(path=path, channels=4, bytes_per_channel=4096)
    comms = dfccl.Communicator.for_devices([base, base + 1], backend="sim", options=opts,
                                           daemon_options=dfccl.DaemonOptions(blocks=4))
    try:
        counts = [16384, 64, 16384, 64, 16384]
        insts = [sc.prepare(sc.Spec("t", "all_reduce", c, "int32"), comms, rng) for c in counts]
        submit_then_check(comms, insts, stagger=True)
        assert [i.works[0].stats["channels"] for i in insts] == [4, 1, 4, 1, 4]
    finally:
        close_all(comms)


@pytest.mark.parametrize("path", PATHS)
def test_freed_bucket_taken_by_another_tag(path, rng):
    """A tag's record bucket, freed once its instances completed, is taken by
    another tag whose instances then queue up: they still run one at a time."""
    base = sc.fresh_sim_devices(1)[0]
    opts = dfccl.CommOptions(path=path, max_tags=1)
    comms = dfccl.Communicator.for_devices([base, base + 1], backend="sim", options=opts)
    try:
        submit_then_check(comms, [sc.prepare(sc.Spec("a", "all_reduce", 100, "int32"), comms, rng) for _ in range(5)])
        second = [sc.prepare(sc.Spec("b", "all_reduce", 1000 + i, "int32"), comms, rng) for i in range(3)]
        submit_then_check(comms, second, stagger=True)
    finally:
        close_all(comms)


def test_submission_ring_wraps_many_times(rng):
    """A small ring (8 slots, 16 entries) reused 40 times over by collectives
    that use 1 or 4 of 4 channels, so that blocks skip entries: every
    collective is copied, pulled and run exactly once."""
    base = sc.fresh_sim_devices(1)[0]
    opts = dfccl.CommOptions(path="direct", channels=4, bytes_per_channel=1024)
    comms = dfccl.Communicator.for_devices([base, base + 1], backend="sim", options=opts,
                                           daemon_options=dfccl.DaemonOptions(blocks=4, max_outstanding=8))
    try:
        for batch in range(80):
            insts = [sc.prepare(sc.Spec(("w", batch, i), "all_reduce", 16 if (batch + i) % 2 else 4096, "int32"),
                                comms, rng) for i in range(4)]
            submit_then_check(comms, insts)
    finally:
        close_all(comms)


@pytest.mark.parametrize("path", PATHS)
def test_several_ranks_per_device(path, rng):
    """8 ranks on 2 simulated GPUs (4 per daemon) in random orders: ranks that
    share a daemon preempt each other too."""
    comms = make_comms(8, path, per_device=4)
    try:
        specs = sc.random_specs(rng, 16, nranks=8, max_bytes=256 << 10)
        orders = [list(rng.permutation(16)) for _ in range(8)]
        sc.run(comms, specs, orders, rng=rng, timeout=120)
    finally:
        close_all(comms)


def test_without_preemption_the_same_order_hangs(rng):
    """Control: with preemption off (infinite windows: run to completion like
    NCCL), A,B vs B,A never completes; the timeout reports which rank each
    side waits for, and abort() releases both sides.  One daemon block per
    device, as NCCL runs one kernel at a time per stream: with more, A and B
    may land on different blocks and run side by side."""
    base = sc.fresh_sim_devices(1)[0]
    opts = dfccl.DaemonOptions(preemption=False, blocks=1)
    comms = dfccl.Communicator.for_devices([base, base + 1], backend="sim", daemon_options=opts,
                                           options=dfccl.CommOptions(path="direct"))
    specs = [sc.Spec("A", "all_reduce", 4096, "float32"), sc.Spec("B", "all_reduce", 4096, "float32")]
    insts = [sc.prepare(s, comms, rng) for s in specs]
    sc.submit(insts[0], comms[0])
    sc.submit(insts[1], comms[0])
    sc.submit(insts[1], comms[1])
    sc.submit(insts[0], comms[1])
    first = [insts[0].works[0], insts[1].works[1]]  # what each daemon runs first
    for w, peer in zip(first, (1, 0)):
        with pytest.raises(dfccl.CollectiveTimeoutError) as info:
            w.synchronize(timeout=1.0)
        assert info.value.waiting_on == peer
    assert not any(w.done() for inst in insts for w in inst.works)
    for c in comms:
        c.abort()
    assert sc.settle_after_abort(insts) == 4
    close_all(comms)


def test_same_scenario_with_preemption_completes(rng):
    """The control's twin: the identical submission order and blocks,
    preemption on."""
    comms = make_comms(2, "direct", daemon_options=dfccl.DaemonOptions(blocks=1))
    try:
        specs = [sc.Spec("A", "all_reduce", 4096, "float32"), sc.Spec("B", "all_reduce", 4096, "float32")]
        rep = sc.run(comms, specs, [[0, 1], [1, 0]], rng=rng, timeout=30)
        assert rep.total_preemptions >= 1  # someone had to give way
    finally:
        close_all(comms)


@pytest.mark.parametrize("path", PATHS)
def test_sixty_four_ranks_random_orders(path, rng):
    """64 simulated GPUs (one block each), every rank its own order of a few
    collectives of different kinds: deadlock experiments past the GPUs we
    have."""
    base = sc.fresh_sim_devices(1)[0]
    comms = dfccl.Communicator.for_devices(list(range(base, base + 64)), backend="sim",
                                           options=dfccl.CommOptions(path=path),
                                           daemon_options=dfccl.DaemonOptions(blocks=1, max_outstanding=64))
    try:
        specs = [sc.Spec("x", "all_reduce", 1000, "float32"), sc.Spec("y", "all_gather", 100, "int32"),
                 sc.Spec("z", "broadcast", 5000, "float32", root=63), sc.Spec("w", "reduce_scatter", 37, "int64")]
        orders = [list(rng.permutation(len(specs))) for _ in range(64)]
        sc.run(comms, specs, orders, rng=rng, timeout=120)
    finally:
        close_all(comms)


def _wait_for_state(daemon, state: str, timeout: float = 10.0) -> float:
    """Seconds until the daemon of ``daemon`` publishes ``state``."""
    start = time.monotonic()
    while daemon.daemon_state[1] != state:
        assert time.monotonic() - start < timeout, daemon.daemon_state
        time.sleep(1e-3)
    return time.monotonic() - start


def _tags_on_distinct_blocks(comm, nblocks: int, count: int) -> list[str]:
    """Tags whose instances start on different daemon blocks (channel 0 runs
    on dfccl_first_block(key, block offset, nblocks))."""
    found: dict[int, str] = {}
    for i in range(1000):
        tag = f"t{i}"
        found.setdefault(first_block(tag_key(comm._comm_key, tag), comm._block_offset, nblocks), tag)
        if len(found) == count:
            return list(found.values())
    raise AssertionError("no tags on distinct blocks")


def test_tags_on_distinct_blocks_run_side_by_side(rng):
    """Small collectives of different tags are dealt to different daemon
    blocks: A,B vs B,A then completes even with preemption off, with no
    preemption at all (each block runs its tag to completion)."""
    base = sc.fresh_sim_devices(1)[0]
    opts = dfccl.DaemonOptions(preemption=False, blocks=4)
    comms = dfccl.Communicator.for_devices([base, base + 1], backend="sim", daemon_options=opts,
                                           options=dfccl.CommOptions(path="direct"))
    try:
        a, b = _tags_on_distinct_blocks(comms[0], 4, 2)
        specs = [sc.Spec(a, "all_reduce", 256, "float32"), sc.Spec(b, "all_reduce", 256, "float32")]
        rep = sc.run(comms, specs, [[0, 1], [1, 0]], rng=rng, timeout=30)
        assert rep.collectives == 2 and rep.total_preemptions == 0
    finally:
        close_all(comms)


def test_ranks_sharing_a_device_run_side_by_side(rng):
    """Two ranks of one communicator on one device run the same tag's
    channel on different blocks, so neither waits for the other's turn: an
    all-reduce completes even with preemption off (on one shared block it
    could never finish: the block would wait for itself)."""
    base = sc.fresh_sim_devices(1)[0]
    opts = dfccl.DaemonOptions(preemption=False, blocks=2)
    comms = dfccl.Communicator.for_devices([base, base], backend="sim", daemon_options=opts,
                                           options=dfccl.CommOptions(path="direct"))
    try:
        specs = [sc.Spec("shared", "all_reduce", 256, "float32")]
        rep = sc.run(comms, specs, [[0], [0]], rng=rng, timeout=30)
        assert rep.collectives == 1 and rep.total_preemptions == 0
    finally:
        close_all(comms)


def test_daemon_comes_back_while_the_gil_is_held_and_completions_wait(rng):
    """As above, with completed collectives waiting for retirement while the
    GIL is held: retiring needs the GIL, relaunching must not wait for it.
    The main thread keeps the GIL throughout (a switch interval longer than
    the test), so whatever needs it waits; rank 0's daemon must still come
    back for the collective that is not complete."""
    import ctypes
    import sys

    base = sc.fresh_sim_devices(2)[0]
    opts = dfccl.DaemonOptions(idle_quit_ns=2_000_000, relaunch_backoff_ns=300_000_000)
    comms = dfccl.Communicator.for_devices([base, base + 1], backend="sim", daemon_options=opts)
    interval = sys.getswitchinterval()
    try:
        firsts = [np.full(8, r + 1, np.float32) for r in range(2)]
        xs = [np.full(64, r + 1, np.float32) for r in range(2)]
        sys.setswitchinterval(1000.0)
        try:
            a = [c.all_reduce(x, tag="first") for c, x in zip(comms, firsts)]
            deadline = time.monotonic() + 10
            while not (a[0]._peek_done() and a[1]._peek_done()):  # complete, not retired
                assert time.monotonic() < deadline
            w0 = comms[0].all_reduce(xs[0], tag="late")
            while comms[0]._daemon.daemon_state[1] != "exited":     # it waited for rank 1, then left
                assert time.monotonic() < deadline, comms[0]._daemon.daemon_state
            w1 = comms[1].all_reduce(xs[1], tag="late")
            ctypes.PyDLL(None).usleep(1_500_000)                 # holds the GIL for 1.5 s
            came_back = w0._peek_done() and w1._peek_done()
        finally:
            sys.setswitchinterval(interval)
        assert came_back, "rank 0's daemon did not come back while the GIL was held"
        for w in a + [w0, w1]:
            w.synchronize(timeout=10)
        assert (xs[0] == 3).all() and (xs[1] == 3).all() and (firsts[0] == 3).all()
    finally:
        close_all(comms)


def test_daemon_comes_back_while_a_thread_holds_the_gil(rng):
    """A rank's daemon that left while its collective waited (idle quit) is
    brought back by a watcher that needs no GIL: here the only host thread
    holds the GIL in a C call (as a synchronising torch op does while it waits
    for the collective) from just before the peer submits until well after
    the relaunch is due; both collectives complete meanwhile.  With the
    relaunch in a Python thread, it could not run, and they never would."""
    import ctypes

    base = sc.fresh_sim_devices(2)[0]
    opts = dfccl.DaemonOptions(idle_quit_ns=2_000_000, relaunch_backoff_ns=300_000_000)
    comms = dfccl.Communicator.for_devices([base, base + 1], backend="sim", daemon_options=opts)
    try:
        xs = [np.full(64, r + 1, np.float32) for r in range(2)]
        w0 = comms[0].all_reduce(xs[0], tag="late")
        _wait_for_state(comms[0]._daemon, "exited")            # it waited for rank 1, then left
        w1 = comms[1].all_reduce(xs[1], tag="late")
        ctypes.PyDLL(None).usleep(1_500_000)                 # holds the GIL for 1.5 s
        assert w0.done() and w1.done(), "rank 0's daemon did not come back while the GIL was held"
        assert (xs[0] == 3).all() and (xs[1] == 3).all()
    finally:
        close_all(comms)


def test_daemon_stays_while_a_stream_waits():
    """A collective some stream waits for keeps its daemon from leaving
    (design decision 27: on a hardware queue shared with that stream, a
    relaunch would be queued behind the wait and never run).  The simulator
    has no streams; Daemon._hold_for_stream_of is the part of
    Work.wait(stream) that counts the wait and makes sure the daemon runs.
    Rank 0 waits 25 idle-quit periods for rank 1 and its daemon stays; once
    the collective completes the count drops and the daemon leaves; without
    the hold it leaves while rank 1 is still absent."""
    base = sc.fresh_sim_devices(2)[0]
    opts = dfccl.DaemonOptions(idle_quit_ns=2_000_000, relaunch_backoff_ns=1_000_000_000)
    comms = dfccl.Communicator.for_devices([base, base + 1], backend="sim", daemon_options=opts)
    try:
        daemon = comms[0]._daemon
        xs = [np.full(64, r + 1, np.float32) for r in range(2)]
        w0 = comms[0].all_reduce(xs[0], tag="held")
        daemon._hold_for_stream_of(w0)
        assert daemon.stream_waits == 1
        launches = daemon.launches
        time.sleep(0.05)
        assert daemon.daemon_state[1] == "running" and daemon.launches == launches, daemon.daemon_state
        assert not w0._peek_done()
        w1 = comms[1].all_reduce(xs[1], tag="held")
        for w in (w0, w1):
            w.synchronize(timeout=10)
        assert (xs[0] == 3).all() and (xs[1] == 3).all()
        assert daemon.stream_waits == 0
        deadline = time.monotonic() + 10
        while daemon.daemon_state[1] != "exited":       # nothing holds it now
            assert time.monotonic() < deadline, daemon.daemon_state
            time.sleep(1e-3)
        # The control: not held, it leaves while its peer is absent.
        w0 = comms[0].all_reduce(xs[0], tag="free")
        while daemon.daemon_state[1] != "exited":
            assert time.monotonic() < deadline, daemon.daemon_state
            time.sleep(1e-3)
        assert not w0._peek_done()
        w1 = comms[1].all_reduce(xs[1], tag="free")
        for w in (w0, w1):
            w.synchronize(timeout=10)
        assert (xs[0] == 6).all() and (xs[1] == 6).all()
    finally:
        close_all(comms)


def test_daemon_leaves_soon_with_nothing_left_and_stays_while_work_waits():
    """With every block's list empty the daemon leaves after empty_quit_ns
    (a resident daemon holds its SMs, and a device-wide synchronisation
    waits for it); while a collective waits for an absent peer it stays for
    idle_quit_ns, also when that collective is on a block other than block
    0, the one that decides.  Here the idle quit is a minute: only the
    empty quit can make it leave."""
    base = sc.fresh_sim_devices(2)[0]
    opts = dfccl.DaemonOptions(blocks=4, idle_quit_ns=60 * 10**9, empty_quit_ns=2_000_000,
                               relaunch_backoff_ns=60 * 10**9)
    comms = dfccl.Communicator.for_devices([base, base + 1], backend="sim", daemon_options=opts)
    try:
        daemon = comms[0]._daemon
        xs = [np.full(64, r + 1, np.float32) for r in range(2)]
        for w in [c.all_reduce(x, tag="first") for c, x in zip(comms, xs)]:
            w.synchronize(timeout=10)
        assert _wait_for_state(daemon, "exited") < 5, "nothing left, yet the daemon stayed"
        assert (xs[0] == 3).all()
        # A collective of rank 0 alone, on block 3: the daemon stays for it.
        tag = next(t for t in (f"w{i}" for i in range(1000))
                   if first_block(tag_key(comms[0]._comm_key, t), comms[0]._block_offset, 4) == 3)
        w0 = comms[0].all_reduce(xs[0], tag=tag)
        _wait_for_state(daemon, "running")
        launches = daemon.launches
        time.sleep(0.3)                                  # 150 empty quits
        assert daemon.daemon_state[1] == "running" and daemon.launches == launches, daemon.daemon_state
        assert not w0._peek_done()
        w1 = comms[1].all_reduce(xs[1], tag=tag)
        for w in (w0, w1):
            w.synchronize(timeout=10)
        assert (xs[0] == 6).all() and (xs[1] == 6).all()
        assert _wait_for_state(daemon, "exited") < 5
    finally:
        close_all(comms)
