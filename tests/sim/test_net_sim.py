"""Ranks on "different hosts" (DFCCL_HOST_ID) in separate processes on the
simulator: every peer is reached through the network proxy over UCX (TCP on
loopback), never through shared memory.  Every ring collective and dtype
from one element to a few MiB, bit-identical to the same collective on one
host, and one of 256 MiB; send / recv and all-to-all of every dtype, exact
to the byte, between ranks of one host and of two; rank-divergent orders
mixing them with collectives, and a peer that comes late; split() into
children across and within hosts; a remote rank killed or stopped is
PeerLostError within peer_timeout."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import time
import traceback

import numpy as np
import pytest

import dfccl
from dfccl.scenarios import DTYPES, SENTINEL
from net_scenarios import (TIMEOUT, UCX_ENV, all_to_all_checked, check_remote_loss, divergent, exchange,
                           ll_divergent, needs_ucx, payload, run_ranks, same_bytes, send_recv_every_pair,
                           split_children, start_all_to_all, storage, sweep, sweep_specs, takes_ll)

# -- point to point, all-to-all, split, large sizes (one function per scenario) ------

#: Every dtype dfccl moves (bfloat16 held as uint16 on the host side).
P2P_DTYPES = DTYPES + ("bfloat16",)


def _p2p_counts(d: int, dtype: str) -> list[int]:
    """Message sizes of dtype number ``d``: none, one, a few slices, a few MiB for every third."""
    return [0, 1, 4099] + ([(3 << 20) // storage(dtype).itemsize + 5] if d % 3 == 0 else [])


#: Checks per rank of the p2p sweep: per dtype and size a send / recv to
#: every peer and an even all-to-all, and one uneven all-to-all per dtype.
P2P_CHECKS = sum(2 * len(_p2p_counts(d, dtype)) + 1 for d, dtype in enumerate(P2P_DTYPES))


def _p2p_sweep(comm, ctx) -> dict:
    n, checked = comm.world_size, 0
    for d, dtype in enumerate(P2P_DTYPES):
        for j, count in enumerate(_p2p_counts(d, dtype)):
            send_recv_every_pair(comm, "sim", count, dtype, 100 * d + j)
            checked += 1
            all_to_all_checked(comm, "sim", [[count] * n] * n, dtype, 5000 + 100 * d + j)
            checked += 1
        # Uneven splits, zeros among them.
        counts = [[(a * 7 + b * 3 + d) % 5 * 1000 + (a == b) * 3 for b in range(n)] for a in range(n)]
        all_to_all_checked(comm, "sim", counts, dtype, 9000 + d)
        checked += 1
    return {"checked": checked}


def _p2p_divergent(comm, ctx) -> dict:
    """Ten operations (collectives, tagged send / recv rings, all-to-alls) in
    opposite orders on even and odd ranks; then, between ranks 0 and 1 on
    different hosts, a recv and an all-to-all whose other half is posted
    only after a collective issued behind them completed."""
    from dfccl_support import scenarios as sc
    n, r = comm.world_size, comm.rank
    nxt, prv = (r + 1) % n, (r - 1) % n
    ops, checks, keep = [], [], []
    for i in range(10):
        if i % 3 == 0:
            inst = sc.RankInstance(sc.Spec(("c", i), ("all_reduce", "all_gather", "broadcast", "reduce")[i % 4],
                                           1000 + 97 * i, "float32", "sum", root=i % n), comm, 300 + i)
            ops.append([inst.submit])
            checks.append(inst.verify)
        elif i % 3 == 1:
            x = payload(r, nxt, 5000 + i, "int32", i)
            y = np.full(5000 + i, SENTINEL, np.int32)
            keep += [x, y]
            ops.append([lambda x=x, i=i: comm.send(x, nxt, tag=("p", i)),
                        lambda y=y, i=i: comm.recv(y, prv, tag=("p", i))])
            checks.append(lambda y=y, i=i: same_bytes(y, payload(prv, r, 5000 + i, "int32", i), f"ring {i}"))
        else:
            counts = [[3000 + 10 * i + a + b for b in range(n)] for a in range(n)]
            holder = {}

            def submit(counts=counts, i=i, holder=holder):
                work, holder["check"] = start_all_to_all(comm, "sim", counts, "float64", 700 + i, tag=("a", i))
                return work
            ops.append([submit])
            checks.append(lambda holder=holder: holder["check"]())
    if r % 2:
        ops = [list(reversed(o)) for o in reversed(ops)]
    works = [f() for o in ops for f in o]
    for w in works:
        w.synchronize(timeout=TIMEOUT)
    for c in checks:
        c()
    checked = len(checks)
    # The late halves: rank 1 posts first and must not hold up what follows.
    late_preempted = 0
    x = payload(0, 1, 70000, "float32", 1)
    y = np.full(70000, SENTINEL, np.float32)
    after = sc.RankInstance(sc.Spec("after", "all_reduce", 4096, "float32"), comm, 900)
    a2a_counts = [[2000 + a + b for b in range(n)] for a in range(n)]
    after2 = sc.RankInstance(sc.Spec("after2", "all_reduce", 4096, "int64"), comm, 901)
    if r == 0:
        # Longer than the simulator's largest window (50 ms): rank 1's recv
        # waits past one window however its blocks' lists look.
        time.sleep(0.1)
        after.submit().synchronize(timeout=TIMEOUT)
        comm.send(x, 1, tag="late").synchronize(timeout=TIMEOUT)
        after2.submit().synchronize(timeout=TIMEOUT)
        a2a, a2a_check = start_all_to_all(comm, "sim", a2a_counts, "uint8", 3, tag="late-a2a")
        a2a.synchronize(timeout=TIMEOUT)
    else:
        late = comm.recv(y, 0, tag="late") if r == 1 else None
        after.submit().synchronize(timeout=TIMEOUT)
        a2a, a2a_check = start_all_to_all(comm, "sim", a2a_counts, "uint8", 3, tag="late-a2a")
        after2.submit().synchronize(timeout=TIMEOUT)
        a2a.synchronize(timeout=TIMEOUT)
        late_preempted = a2a.stats["preemptions"]
        if late is not None:
            late.synchronize(timeout=TIMEOUT)
            same_bytes(y, payload(0, 1, 70000, "float32", 1), "late recv")
            late_preempted = min(late_preempted, late.stats["preemptions"])
    a2a_check()
    after.verify()
    after2.verify()
    checked += 3
    return {"checked": checked, "expected": 13, "late_preempted": late_preempted}


def _p2p_mismatch(comm, ctx) -> dict:
    r = comm.rank
    x = np.ones(10 if r == 0 else 12, np.float32)
    work = comm.send(x, 1) if r == 0 else comm.recv(x, 0)
    with pytest.raises(dfccl.MismatchError):
        work.synchronize(timeout=TIMEOUT)
    # Rank 0 sends 3 elements to rank 1, which expects 5.
    send_splits, recv_splits = ([2, 3], [2, 4]) if r == 0 else ([4, 1], [5, 1])
    s = np.ones(sum(send_splits), np.int32)
    d = np.full(sum(recv_splits), SENTINEL, np.int32)
    with pytest.raises(dfccl.MismatchError):
        comm.all_to_all_single(s, d, send_splits=send_splits, recv_splits=recv_splits).synchronize(timeout=TIMEOUT)
    from dfccl_support import scenarios as sc
    ok = sc.RankInstance(sc.Spec("ok", "all_reduce", 999, "float32"), comm, 5)
    ok.submit().synchronize(timeout=TIMEOUT)
    ok.verify()
    return {"checked": 3}


def _large(comm, ctx) -> dict:
    """256 MiB broadcast (exact: the root's bytes) and a 64 MiB all_reduce
    (the same sum as the ring on one host, checked against numpy's)."""
    from dfccl_support import scenarios as sc
    count = 256 << 20
    # A multiplicative hash of the index: every byte varies, cheap to make twice.
    pattern = lambda: (np.arange(count // 8, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)).view(np.uint8)  # noqa: E731
    buf = pattern() if comm.rank == 0 else np.zeros(count, np.uint8)
    comm.broadcast(buf, root=0, tag="256MiB").synchronize(timeout=300)
    same_bytes(buf, pattern(), "broadcast 256 MiB")
    del buf
    inst = sc.RankInstance(sc.Spec("64MiB", "all_reduce", 16 << 20, "int32"), comm, 64)
    inst.submit().synchronize(timeout=300)
    inst.verify()
    return {"checked": 2}


def _inline_sizes(comm, ctx) -> dict:
    """LL collectives of pieces of 8 B, 1 KiB and 4 KiB (8,224 bytes of
    lines), ring broadcasts and all-reduces of one slice of 8 KiB and a bit
    more and of larger ones, in opposite orders on the two ranks."""
    from dfccl_support import scenarios as sc

    specs = [sc.Spec(("ll", kind, piece), kind, piece // 4, "float32", "sum", root=piece % ctx.nranks)
             for kind in ("all_reduce", "all_gather", "reduce_scatter", "broadcast") for piece in (8, 1024, 4096)]
    specs += [sc.Spec(("ring", kind, n), kind, n, "int32", "max", root=n % ctx.nranks)
              for kind in ("broadcast", "all_reduce") for n in (2048, 2049, 40000, 300000)]
    insts = [sc.RankInstance(s, comm, 40 + i) for i, s in enumerate(specs)]
    works = [i.submit() for i in (insts if ctx.rank % 2 == 0 else insts[::-1])]
    for w in works:
        w.synchronize(timeout=TIMEOUT)
    for i in insts:
        i.verify()
    return {"checked": len(insts), "ll": sum(takes_ll(comm, i.spec) for i in insts)}


@needs_ucx
def test_every_collective_bit_identical_to_one_host():
    got = run_ranks(sweep, 3)
    for r, info in got.items():
        assert info["path"] == "ring"
        assert info["transports"] == tuple("self" if p == r else "ucx" for p in range(3))
        assert info["checked"] == len(sweep_specs())
        assert info["ll"] > 0, "the smallest symmetric collectives take LL across hosts"


@needs_ucx
@pytest.mark.parametrize("inline", [None, "4096", "0"])
def test_messages_with_and_without_bytes_inline(inline, monkeypatch):
    """LL lines of pieces up to 4 KiB, small ring slices and the ring's
    larger ones, in opposite orders: with the proxy's inline limit (every
    LL piece's lines inline), with a lower one (a 4 KiB piece's lines and
    an 8 KiB slice apart, smaller ones inline) and with every message's
    bytes apart from its header ($DFCCL_NET_INLINE_BYTES=0)."""
    if inline is None:
        monkeypatch.delenv("DFCCL_NET_INLINE_BYTES", raising=False)
    else:
        monkeypatch.setenv("DFCCL_NET_INLINE_BYTES", inline)
    got = run_ranks(_inline_sizes, 2, ll_max_bytes=4096, max_tags=256)
    assert all(info["checked"] == 20 and info["ll"] == 12 for info in got.values()), got


def test_inline_bytes_setting(monkeypatch):
    """$DFCCL_NET_INLINE_BYTES within 0..the proxy's capacity is taken;
    anything else is refused by name, and `dfccl info` says which."""
    import io

    from dfccl._native import layout
    from dfccl.info import print_info
    from dfccl.net import NetUnavailableError
    from dfccl.net.link import INLINE_BYTES_ENV, inline_bytes

    monkeypatch.delenv(INLINE_BYTES_ENV, raising=False)
    try:
        capacity, source = inline_bytes()
    except NetUnavailableError as exc:
        pytest.skip(f"no network proxy here: {exc}")
    # The lines of the largest LL piece a communicator picks by itself fit.
    assert source == "dfccl" and capacity == layout.ll_area_bytes(layout.LL_DEFAULT_MAX_BYTES)
    monkeypatch.setenv(INLINE_BYTES_ENV, "1024")
    assert inline_bytes() == (1024, "environment")
    out = io.StringIO()
    print_info(out)
    assert "bytes a message carries in its header: 1024 (environment)" in out.getvalue(), out.getvalue()
    for bad in ("-1", "lots", str(capacity + 1)):
        monkeypatch.setenv(INLINE_BYTES_ENV, bad)
        with pytest.raises(dfccl.InvalidArgumentError, match=INLINE_BYTES_ENV):
            inline_bytes()


@needs_ucx
@pytest.mark.parametrize("nranks", [2, 4])
def test_divergent_orders_complete(nranks):
    got = run_ranks(divergent, nranks)
    assert all(info["checked"] == 60 for info in got.values())


@needs_ucx
@pytest.mark.parametrize("nranks, per_host", [(2, 1), (3, 1), (4, 2)])
def test_ll_across_hosts_divergent_orders(nranks, per_host):
    """LL's lines carried by the proxy: small symmetric collectives and
    broadcasts in opposite orders with a ring one, and 50 back to back on
    one tag; with two ranks per host, each rank stores into its local
    peer's arena and its remote peers' mirrors in the same push."""
    got = run_ranks(ll_divergent, nranks, per_host=per_host)
    assert all(info["checked"] == 63 for info in got.values()), got
    # Every small one up to 3 ranks; with 4 the simulator's LL region
    # leaves smaller pieces (ll_max_bytes), still the queue of 50 at least.
    assert all(info["ll"] == 61 if nranks <= 3 else info["ll"] > 50 for info in got.values()), got


@needs_ucx
def test_point_to_point_and_all_to_all_exact_across_hosts():
    """Two hosts of two ranks: every pair, local and remote, every dtype."""
    got = run_ranks(_p2p_sweep, 4, per_host=2)
    for r, info in got.items():
        assert info["transports"] == tuple("self" if p == r else "host" if p // 2 == r // 2 else "ucx"
                                           for p in range(4))
        assert info["checked"] == P2P_CHECKS, info


@needs_ucx
@pytest.mark.parametrize("nranks", [2, 3])
def test_point_to_point_and_all_to_all_divergent_with_collectives(nranks):
    """Sends, recvs and all-to-alls mixed with collectives in opposite orders
    on even and odd ranks, and a peer that posts its half only after its
    partner's collective completed: the waiting half is preempted."""
    got = run_ranks(_p2p_divergent, nranks)
    assert all(info["checked"] == info["expected"] for info in got.values()), got
    assert got[1]["late_preempted"] > 0, got[1]


@needs_ucx
def test_mismatches_across_hosts_fail_both_ranks():
    """A send / recv of different counts and all-to-all splits that disagree
    are MismatchError on both ranks, then the communicator goes on."""
    got = run_ranks(_p2p_mismatch, 2)
    assert all(info["checked"] == 3 for info in got.values()), got


@needs_ucx
def test_split_across_and_within_hosts():
    """Children spanning hosts take the network; children within a host the
    local paths; collectives, send / recv and all-to-all run in both."""
    got = run_ranks(split_children, 4, per_host=2)
    for r, info in got.items():
        across, within = info["children"]
        assert across["transports"] == tuple("self" if p == r // 2 else "ucx" for p in range(2)), info
        assert across["path"] == "ring"
        assert "ucx" not in within["transports"] and within["path"] != "ring", info


def _channels_taken(comm, ctx) -> dict:
    """Channels a 1 MiB all-reduce and a 4 MiB broadcast took (Work.stats)."""
    x = np.ones(1 << 18, np.float32)
    w = comm.all_reduce(x, tag="1MiB")
    w.synchronize(timeout=TIMEOUT)
    y = np.full(1 << 20, ctx.rank + 1, np.float32)
    b = comm.broadcast(y, root=0, tag="4MiB")
    b.synchronize(timeout=TIMEOUT)
    assert (x == 2).all() and (y == 1).all()
    return {"channels": (w.stats["channels"], b.stats["channels"])}


@needs_ucx
@pytest.mark.parametrize("options, channels", [({}, (2, 2)), ({"bytes_per_channel": 1 << 20}, (2, 2)),
                                               ({"bytes_per_channel": 1 << 20, "two_channel_bytes": 0}, (1, 2)),
                                               ({"bytes_per_channel": 4 << 20, "two_channel_bytes": 0}, (1, 1)),
                                               ({"channels": 1}, (1, 1))])
def test_a_spanning_communicator_plans_network_sized_messages(options, channels):
    """Across hosts one channel moves 512 KiB (messages of 128 KiB and
    more), not the 256 KiB of one host, and from 256 KiB a collective
    takes two; sizes the user set are kept."""
    got = run_ranks(_channels_taken, 2, **options)
    assert all(info["channels"] == channels for info in got.values()), got


def _traced_broadcasts(comm, ctx) -> dict:
    """Broadcasts queued back to back on two tags: 6 of 4 KiB (one slice
    each) and 3 of 1 MiB (four 256 KiB slices each: one channel per MiB,
    set by the test with the two-channel floor off)."""
    for size, n in ((4096, 6), (1 << 20, 3)):
        x = np.full(size // 4, ctx.rank + 1, np.float32)
        works = [comm.broadcast(x, root=0, tag=("traced", size)) for _ in range(n)]
        for w in works:
            w.synchronize(timeout=TIMEOUT)
        assert (x == 1).all()
    return {}


@needs_ucx
def test_hop_trace(tmp_path, monkeypatch, capsys):
    """With DFCCL_NET_TRACE each rank's proxy writes what it sent and applied
    when the rank closes; dfccl.net.hops matches every slice with its hop
    and its credit, and each instance with the one before it."""
    from dfccl.net import hops
    from dfccl.net.hop_trace import TRACE_ENV, load_traces

    monkeypatch.setenv(TRACE_ENV, str(tmp_path))
    run_ranks(_traced_broadcasts, 2, bytes_per_channel=1 << 20, two_channel_bytes=0)
    comms = load_traces(str(tmp_path))
    assert len(comms) == 1, comms
    traces = next(iter(comms.values()))
    assert sorted(t["rank"] for t in traces) == [0, 1]
    got = hops.summarize(traces)
    slices = 6 + 3 * 4
    assert got["hops"]["slice"]["n"] == slices, got
    assert got["hops"]["word"]["n"] >= slices and got["hops"]["record"]["n"] > 0, got
    assert got["slice_to_credit"]["n"] == slices, got
    assert got["instance_period"]["n"] == 5 + 2 and got["last_credit_to_next_slice"]["n"] == 5 + 2, got
    assert all(st["median_us"] > 0 for st in got["hops"].values()), got
    # The sender's turnaround split by the records it sent and met: each
    # instance after a tag's first, and the receiver's side of each.
    assert got["last_credit_to_own_record"]["n"] == 5 + 2, got
    assert got["peer_record_to_next_slice"]["n"] == 6 + 3, got
    assert got["credit_out_to_own_record"]["n"] == 5 + 2, got
    assert got["slice_spacing"]["n"] == 3 * 3, got     # slices 2-4 of each 1 MiB broadcast
    # The proxies' long calls into UCX: each over the threshold and of a
    # known call, a share of each rank's time, and the slices rank 0 sent
    # checked against them.
    calls = {r["rank"]: r for r in got["calls"]}
    assert sorted(calls) == [0, 1] and all(0 <= r["share"] < 1 for r in calls.values()), got
    assert calls[0]["slices"] == slices and calls[1]["slices"] == 0, got
    assert 0 <= calls[0]["held"] <= slices, got
    busy = [e for t in traces for e in t["events"][t["events"]["what"] == t["codes"]["busy"]]]
    assert all(e["len"] > 20000 for e in busy), busy
    assert len(busy) == sum(got[key]["n"] for key, _ in hops.PROXY_CALLS), got
    # A trace from a proxy that does not record its calls still reads.
    older = [dict(t, codes={k: v for k, v in t["codes"].items() if k != "busy"}) for t in traces]
    assert all(r["share"] is None for r in hops.summarize(older)["calls"])
    assert hops.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "slice applied -> its credit" in out and "rank 0: " in out and f"of {slices} slices sent" in out


def _lanes_of(traces: list, kind: str) -> set:
    """The lanes that carried messages of ``kind`` in a hop trace (the
    lane is above a trace's 48-bit sequence numbers)."""
    out = set()
    for t in traces:
        ev = t["events"]
        sent = ev[(ev["what"] == t["codes"]["sent"]) & (ev["kind"] == t["codes"][kind])]
        out |= {int(seq) >> 48 for seq in sent["seq"]}
    return out


@needs_ucx
@pytest.mark.parametrize("scenario, nranks", [(divergent, 3), (ll_divergent, 2)])
def test_two_lanes_carry_every_channel(scenario, nranks, tmp_path, monkeypatch):
    """With $DFCCL_NET_LANES=2 each rank's proxy runs two threads, each
    with its own connection to every peer, and the daemon blocks' queues
    alternate between them: tags in opposite orders and a queue of 50 on
    one tag complete, every result checked, with slices on both lanes;
    the hop trace matches every slice with its hop across lanes."""
    from dfccl.net import hops
    from dfccl.net.hop_trace import TRACE_ENV, load_traces

    monkeypatch.setenv("DFCCL_NET_LANES", "2")
    monkeypatch.setenv(TRACE_ENV, str(tmp_path))
    got = run_ranks(scenario, nranks)
    assert all(info["checked"] > 0 for info in got.values()), got
    (traces,) = load_traces(str(tmp_path)).values()
    kind = "put" if scenario is divergent else "lines"
    assert _lanes_of(traces, kind) == {0, 1}, "both lanes carry the daemon's messages"
    assert _lanes_of(traces, "status") == {0, 1}, "every lane pushes the rank's status"
    if scenario is divergent:
        summary = hops.summarize(traces)
        sent = sum(int(((t["events"]["what"] == t["codes"]["sent"]) & (t["events"]["kind"] == t["codes"]["put"])
                        & (t["events"]["len"] > 0)).sum()) for t in traces)
        assert summary["hops"]["slice"]["n"] == sent, summary


@needs_ucx
def test_one_lane_carries_every_channel(monkeypatch):
    """One lane (the default is two) carries every block's queue: tags in
    opposite orders and a deep queue on one tag complete, checked."""
    monkeypatch.setenv("DFCCL_NET_LANES", "1")
    got = run_ranks(divergent, 3)
    assert all(info["checked"] > 0 for info in got.values()), got


def _nothing(comm, ctx) -> dict:
    return {}


def _crash_rank_1(comm, ctx) -> dict:
    if ctx.rank == 1:
        os._exit(3)
    return {}


@needs_ucx
def test_a_rank_that_crashes_fails_the_launcher_at_once():
    """A rank process that ends without reporting (a crash) fails run_ranks
    with its exit code within seconds, not after the launcher's limit."""
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"ended without a result .*1: 3"):
        run_ranks(_crash_rank_1, 2)
    assert time.monotonic() - start < 120


@needs_ucx
def test_ranks_with_different_lane_counts_are_refused():
    """Lane l of one rank talks to lane l of the other, so every rank must
    run the same number: a communicator whose ranks differ fails on every
    rank, naming the setting."""
    got = run_ranks(_nothing, 2, rank_env={0: {"DFCCL_NET_LANES": "1"}, 1: {"DFCCL_NET_LANES": "2"}}, errors=True)
    for rank, error in got.items():
        assert error is not None and "DFCCL_NET_LANES must be equal on every rank" in error, (rank, error)


def test_lanes_setting(monkeypatch):
    """$DFCCL_NET_LANES within 1..the proxy's most is taken, two lanes
    without it; anything else is refused by name, and `dfccl info` says
    which."""
    import io

    from dfccl.info import print_info
    from dfccl.net import NetUnavailableError
    from dfccl.net.link import DEFAULT_LANES, LANES_ENV, lanes

    monkeypatch.delenv(LANES_ENV, raising=False)
    try:
        assert lanes() == (DEFAULT_LANES, "dfccl") == (2, "dfccl")
    except NetUnavailableError as exc:
        pytest.skip(f"no network proxy here: {exc}")
    monkeypatch.setenv(LANES_ENV, "3")
    assert lanes() == (3, "environment")
    out = io.StringIO()
    print_info(out)
    assert "proxy lanes (threads and connections per peer): 3 (environment)" in out.getvalue(), out.getvalue()
    # The most is the proxy's own (its C constant), not a copy here.
    from dfccl.net._build import load
    from dfccl.net.link import _declare
    most = int(_declare(load()).dfccl_net_max_lanes())
    monkeypatch.setenv(LANES_ENV, str(most))
    assert lanes() == (most, "environment")
    for bad in ("0", "many", str(most + 1)):
        monkeypatch.setenv(LANES_ENV, bad)
        with pytest.raises(dfccl.InvalidArgumentError, match=LANES_ENV):
            lanes()


@needs_ucx
def test_largest_sizes_bit_identical():
    """256 MiB broadcast and 64 MiB all_reduce across two hosts (the sweep
    stops at a few MiB)."""
    got = run_ranks(_large, 2)
    assert all(info["checked"] == 2 for info in got.values()), got


def _stalls(pid_file: str, rank: int, results) -> None:
    """Rank 1 writes its pid, then never reports (a rank stuck in a
    collective, say)."""
    if rank == 1:
        with open(pid_file, "w") as f:
            f.write(str(os.getpid()))
        time.sleep(3600)
    results.put((rank, "ok", {}))


def test_two_rank_launcher_kills_a_rank_that_stalls(tmp_path):
    """bench_net.run_ranks names the rank that did not report in time
    and kills it, instead of waiting for it at exit."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                    "benchmarks"))
    import bench_net

    pid_file = str(tmp_path / "stalled.pid")
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] did not report within 5 s"):
        bench_net.run_ranks(_stalls, lambda r: (pid_file, r), timeout=5)
    with open(pid_file) as f:
        pid = int(f.read())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)     # killed and reaped


@needs_ucx
def test_bench_net_script(tmp_path):
    """benchmarks/bench_net.py runs both sides (the all-reduce checked) and
    writes its record; --option takes a CommOptions field of any type."""
    import json

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "bench_net.py"), "--iters", "2",
                           "--warmup", "1", "--sizes", "65536", "--perftest-iters", "20", "--repeats", "2",
                           "--option", "protocol=simple", "--option", "channels=1", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    rec = json.loads((tmp_path / "net.jsonl").read_text().splitlines()[-1])
    assert len(rec["results"]["runs"]) == 2
    row = rec["results"]["summary"][0]
    assert row["size"] == 65536 and row["broadcast_mib_s"][0] > 0 and row["ucx_perftest_mib_s"][0] > 0, row
    assert row["broadcast_vs_perftest"] > 0 and row["broadcast_vs_perftest_same"] > 0, row
    assert row["broadcast_us"][0] > 0 and row["all_reduce_us"][0] > 0, row
    assert rec["args"]["option"] == ["protocol=simple", "channels=1"], rec["args"]


@needs_ucx
def test_net_geometry_probe(tmp_path):
    """benchmarks/probes/net_geometry_probe.py measures each geometry it is
    given (the broadcast checked against rank 0's data) and ucx_perftest."""
    import json

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "probes", "net_geometry_probe.py"),
                           "--sizes", "65536", "--iters", "1,2", "--warmup", "1", "--rounds", "1", "--perftest-iters", "20",
                           "--perftest-runs", "1", "--config", "default", "--config", "max_slice_bytes=16384"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    measured = {(row["config"], row["iters"]): row["broadcast_mib_s"] for row in rows if "config" in row}
    assert set(measured) == {(c, n) for c in ("default", "max_slice_bytes=16384") for n in (1, 2)}, rows
    assert min(measured.values()) > 0, rows
    assert any(row.get("ucx_perftest_mib_s", 0) > 0 for row in rows), rows


@needs_ucx
def test_net_geometry_probe_alternates_images_with_the_hop_split(tmp_path):
    """--image runs each round of each image in a pair of processes of its
    own (the installed image twice here: the simulator loads no image),
    --trace keeps every run's hop trace and prints the split per image; a
    missing image and a trace over several sizes are refused."""
    import json

    probe = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                         "benchmarks", "probes", "net_geometry_probe.py")
    common = [sys.executable, probe, "--iters", "4", "--warmup", "1", "--rounds", "2", "--perftest-iters", "20",
              "--perftest-runs", "1"]
    done = subprocess.run(common + ["--sizes", "4096", "--image", "installed", "--image", "installed",
                                    "--trace", str(tmp_path / "hops")], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{") and '"config"' in line]
    assert sorted((r["config"], r["round"]) for r in rows) == [("installed default", 0), ("installed default", 0),
                                                               ("installed default", 1), ("installed default", 1)]
    assert len(os.listdir(tmp_path / "hops" / "image0")) == 2 * 2     # two runs of two ranks
    [slice_row] = [line for line in done.stdout.splitlines() if line.startswith("slice hop")]
    assert slice_row.count("( 2)") == 2, done.stdout                  # both images, both runs matched
    [held_row] = [line for line in done.stdout.splitlines() if line.startswith("slices held by a long call")]
    assert held_row.count("( 2)") == 2, done.stdout
    for bad in (["--sizes", "4096", "--image", str(tmp_path / "none.fatbin")],
                ["--sizes", "4096,8192", "--trace", str(tmp_path / "x")]):
        refused = subprocess.run(common + bad, capture_output=True, text=True, timeout=120)
        assert refused.returncode == 2 and ("no such file" in refused.stderr or "one size" in refused.stderr), \
            refused.stderr


def _torch_worker(rank: int, nranks: int, store_path: str, results) -> None:
    try:
        os.environ.update(UCX_ENV)
        os.environ.update({"DFCCL_HOST_ID": f"host-{rank}", "DFCCL_TORCH_BACKEND": "sim"})
        from datetime import timedelta

        import torch.distributed as dist

        import dfccl.torch as dt
        from torch_scenarios import _all_to_all, _point_to_point

        dist.init_process_group("dfccl", store=dist.FileStore(store_path, nranks), rank=rank, world_size=nranks,
                                timeout=timedelta(seconds=TIMEOUT))
        try:
            transports = dt.communicator().transports
            _point_to_point(rank, nranks)   # blocking, isend / irecv, tags, batch_isend_irecv
            _all_to_all(rank, nranks)       # all_to_all_single even and uneven, all_to_all of lists
        finally:
            dist.destroy_process_group()
        results.put((rank, "ok", {"transports": transports}))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


@needs_ucx
def test_torch_point_to_point_and_all_to_all_across_hosts(tmp_path):
    """torch.distributed's p2p (batch_isend_irecv included) and all-to-alls
    on three hosts, through dfccl.torch's scenarios of one host."""
    pytest.importorskip("torch.distributed")
    nranks = 3
    mp_context = mp.get_context("spawn")
    results = mp_context.Queue()
    procs = [mp_context.Process(target=_torch_worker, args=(r, nranks, str(tmp_path / "store"), results))
             for r in range(nranks)]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            rank, what, info = results.get(timeout=600)
            assert what == "ok", f"rank {rank}:\n{info}"
            assert info["transports"] == tuple("self" if p == rank else "ucx" for p in range(nranks)), info
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def test_transports_of_one_process(monkeypatch):
    """Without UCX: ranks of one host id never take the network."""
    monkeypatch.setenv("DFCCL_HOST_ID", "node-a")
    comms = dfccl.Communicator.for_devices([0, 0], backend="sim")
    try:
        assert [c.transports for c in comms] == [("self", "local"), ("local", "self")]
        assert comms[0]._endpoint.describe()["host_id"] == "node-a"
    finally:
        for c in comms:
            c.close()


# -- peer loss -------------------------------------------------------------------

@needs_ucx
@pytest.mark.parametrize("how, op", [("sigkill", "all_reduce"), ("sigstop", "all_reduce"), ("sigkill", "recv"),
                                     ("sigkill", "all_to_all"), ("sigkill", "ll_all_reduce"),
                                     ("sigstop", "ll_all_reduce")])
def test_remote_peer_lost_within_peer_timeout(how, op):
    """A killed rank's connection drops (seen at once); a stopped one stops
    its heartbeat (seen within peer_timeout).  Survivors waiting in a
    collective, a recv from it or an all-to-all with it all see it."""
    check_remote_loss(how, op)


@needs_ucx
@pytest.mark.parametrize("how", ["sigkill", "sigstop"])
def test_remote_peer_lost_with_one_lane(how, monkeypatch):
    """With one lane (the default is two) a killed rank's only connection
    drops and a stopped one's heartbeat stops; survivors see it within
    peer_timeout."""
    monkeypatch.setenv("DFCCL_NET_LANES", "1")
    check_remote_loss(how, "all_reduce")


@needs_ucx
def test_exchange_scenario_of_the_gpu_tests():
    """The send / recv and all-to-all scenario tests/gpu/test_net_gpu.py
    runs in device memory, here on the simulator."""
    got = run_ranks(exchange, 2)
    assert all(info["checked"] == 20 for info in got.values()), got


@needs_ucx
def test_proxy_ucx_settings(monkeypatch):
    """The proxy's own UCX settings (large TCP segments) apply where
    UCX_<name> is unset, and the environment's value wins where it is set;
    `dfccl info` shows which is which."""
    import io

    from dfccl.info import print_info
    from dfccl.net.link import ucx_settings

    for name, _, _ in ucx_settings():
        monkeypatch.delenv(f"UCX_{name}", raising=False)
    mine = ucx_settings()
    assert {n for n, _, _ in mine} >= {"TCP_TX_SEG_SIZE", "TCP_RX_SEG_SIZE"}, mine
    assert all(source == "dfccl" for _, _, source in mine), mine
    monkeypatch.setenv("UCX_TCP_TX_SEG_SIZE", "8k")
    got = {n: (v, s) for n, v, s in ucx_settings()}
    assert got["TCP_TX_SEG_SIZE"] == ("8k", "environment") and got["TCP_RX_SEG_SIZE"] == ("256k", "dfccl"), got
    out = io.StringIO()
    print_info(out)
    text = out.getvalue()
    assert "TCP_TX_SEG_SIZE=8k (environment)" in text and "TCP_RX_SEG_SIZE=256k (dfccl)" in text, text
