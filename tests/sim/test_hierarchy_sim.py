"""Hierarchical all-reduce (dfccl.hierarchy) on the simulator: ranks in
separate processes on two "hosts" (DFCCL_HOST_ID), two or more on each:
exact results, in place and not, the ring where it does not apply, opposite
orders, a late peer, the parts' failures reaching every rank, how a part's
failure is reported, and the layouts that build no hierarchy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import dfccl
from dfccl.hierarchy import host_layout
from dfccl.options import DEFAULT_HIERARCHY_MIN_BYTES
from net_scenarios import (HIER_MIN_BYTES, TIMEOUT, check_remote_loss, hierarchical_all_reduces,
                           hierarchical_blocks, needs_ucx, run_ranks)
from dfccl.bench import arrays


def test_host_layout():
    lay = host_layout(["a", "a", "b", "b"])
    assert (lay.host, lay.local, lay.per_host, lay.hosts) == ((0, 0, 1, 1), (0, 1, 0, 1), 2, 2)
    # Interleaved hosts: a rank's place counts its host's ranks in rank order.
    lay = host_layout(["x", "y", "x", "y", "x", "y"])
    assert (lay.host, lay.local, lay.per_host) == ((0, 1, 0, 1, 0, 1), (0, 0, 1, 1, 2, 2), 3)
    assert host_layout(["a", "a", "a"]) is None          # one host
    assert host_layout(["a", "b", "c"]) is None          # one rank per host
    assert host_layout(["a", "a", "b"]) is None          # unequal hosts


@needs_ucx
@pytest.mark.parametrize("nranks", [4, 6])
def test_hierarchical_all_reduce_exact_and_deadlock_free(nranks):
    got = run_ranks(hierarchical_all_reduces, nranks, per_host=nranks // 2, hierarchy_min_bytes=HIER_MIN_BYTES)
    for r in range(nranks):
        assert got[r]["checked"] == 10, got[r]
        # 4 cases + 2 opposite-order + the late one + 4 in order on one tag.
        assert got[r]["hierarchical"] == 11, got[r]


@needs_ucx
@pytest.mark.parametrize("nranks", [4, 6])
def test_hierarchical_reduce_scatter_and_all_gather_exact(nranks):
    got = run_ranks(hierarchical_blocks, nranks, per_host=nranks // 2, hierarchy_min_bytes=HIER_MIN_BYTES)
    for r in range(nranks):
        assert got[r]["checked"] == 20, got[r]
        # 4 of each kind + one each in opposite orders + one each in order
        # on one tag + a reduce-scatter on a stream.
        assert (got[r]["reduce_scatters"], got[r]["all_gathers"]) == (7, 6), got[r]


def test_blocks_take_the_hierarchy_only_where_hosts_are_contiguous():
    from dfccl.hierarchy import HierarchyInfo

    assert host_layout(["a", "a", "b", "b"]).contiguous
    assert host_layout(["a", "a", "a", "b", "b", "b"]).contiguous
    assert not host_layout(["x", "y", "x", "y"]).contiguous
    assert not host_layout(["a", "b", "b", "a"]).contiguous
    info = HierarchyInfo(hosts=2, per_host=2, min_bytes=1 << 20, all_reduces=0, blocks=True)
    # A reduce-scatter's or all-gather's block: n blocks must hold min_bytes.
    assert info.takes(1 << 16, 4, "reduce_scatter") and info.takes(1 << 16, 4, "all_gather")
    assert not info.takes((1 << 16) - 1, 4, "all_gather")
    assert info.takes((1 << 16) + 1, 4, "reduce_scatter")         # any block size
    assert info.takes(1 << 18, 4) and not info.takes((1 << 18) + 1, 4)   # an all-reduce: a count L divides
    from dataclasses import replace
    assert not replace(info, blocks=False).takes(1 << 20, 4, "reduce_scatter")
    with pytest.raises(ValueError, match="kind"):
        info.takes(1 << 20, 4, "broadcast")


def _no_hierarchy(comm, ctx) -> dict:
    return {"hierarchy": comm.hierarchy}


@needs_ucx
def test_no_hierarchy_where_it_does_not_apply():
    # One rank per host, and hierarchy_min_bytes=0 on a layout that has one.
    assert all(v["hierarchy"] is None for v in run_ranks(_no_hierarchy, 2).values())
    got = run_ranks(_no_hierarchy, 4, per_host=2, hierarchy_min_bytes=0)
    assert all(v["hierarchy"] is None for v in got.values())


def test_hierarchy_min_bytes_option():
    assert dfccl.CommOptions().resolved("sim").hierarchy_min_bytes == DEFAULT_HIERARCHY_MIN_BYTES
    assert dfccl.CommOptions(hierarchy_min_bytes=0).resolved("cuda").hierarchy_min_bytes == 0
    with pytest.raises(dfccl.InvalidArgumentError, match="hierarchy_min_bytes"):
        dfccl.CommOptions(hierarchy_min_bytes=-1)


@needs_ucx
@pytest.mark.parametrize("how", ["sigkill", "sigstop"])
def test_remote_peer_lost_in_hierarchical_all_reduce(how):
    """The last rank of four (two per host) dies or stops in a hierarchical
    all-reduce: every survivor fails (PeerAbortedError, or PeerLostError
    naming it), whichever part it was in."""
    got = check_remote_loss(how, "all_reduce", nranks=4, per_host=2, hierarchy_min_bytes=HIER_MIN_BYTES)
    assert set(got) == {0, 1, 2}, got


def _mismatched_ops(comm, ctx) -> dict:
    """Rank 0 sums where the others take the max: its host's reduce-scatter
    fails on signature, and the parts after it fail on every rank."""
    x = arrays.from_numpy(ctx.backend, comm.device, np.ones(3 * HIER_MIN_BYTES // 4, np.float32))
    work = comm.all_reduce(x, op="sum" if comm.rank == 0 else "max", tag="mm")
    named = (work.kind, work.tag, work.rank)
    try:
        work.synchronize(timeout=TIMEOUT)
    except dfccl.DfcclError as exc:
        return {"named": named, "after": (work.kind, work.tag, work.rank), "error": type(exc).__name__,
                "rank": exc.rank, "message": str(exc), "cause": str(exc.__cause__)}
    return {"named": named, "error": None}


@needs_ucx
def test_a_part_failure_is_reported_for_the_whole():
    got = run_ranks(_mismatched_ops, 4, per_host=2, hierarchy_min_bytes=HIER_MIN_BYTES)
    for r, info in got.items():
        assert info["error"] is not None, (r, info)
        # The Work is named as the call, before and after its error was built.
        assert info["named"] == info["after"] == ("all_reduce", "mm", r), (r, info)
        assert info["rank"] == r and info["message"].startswith(f"rank {r}: all_reduce tag 'mm'"), (r, info)
    for r in (0, 1):
        # Its own part's error names the part, in its child's numbers.
        assert "in its reduce-scatter within the host" in got[r]["message"], got[r]
        assert got[r]["cause"].startswith(f"rank {r}: reduce_scatter tag 'mm'"), got[r]
    # One that compared the signatures first says what differs (the other
    # may find its give-up mark first: PeerAbortedError).
    mismatched = [r for r in (0, 1) if got[r]["error"] == "MismatchError"]
    assert mismatched and all("different op" in got[r]["cause"] for r in mismatched), got


def _one_rank_below(comm, ctx) -> dict:
    """Rank 0 all-reduces fewer elements than the others, below the
    threshold: it takes the ring, they take the parts, and nobody
    completes.  Rank 1 gives up first (a timeout; then its abort fails the
    others' waits): waiting in its first part, it is told why it may be."""
    big = 3 * HIER_MIN_BYTES // 4
    x = arrays.from_numpy(ctx.backend, comm.device, np.ones(1000 if comm.rank == 0 else big, np.float32))
    work = comm.all_reduce(x, tag="sizes")
    try:
        work.synchronize(timeout=1.0 if comm.rank == 1 else 4.0)
        out = {"error": None}
    except dfccl.DfcclError as exc:
        out = {"error": type(exc).__name__, "message": str(exc)}
    comm.abort()
    return out


@needs_ucx
def test_ranks_that_disagree_on_the_size_are_told_why():
    got = run_ranks(_one_rank_below, 4, per_host=2, hierarchy_min_bytes=HIER_MIN_BYTES)
    assert all(info["error"] is not None for info in got.values()), got
    # Rank 1 waits for rank 0 in its host's reduce-scatter.
    assert got[1]["error"] == "CollectiveTimeoutError", got[1]
    assert "in its reduce-scatter within the host" in got[1]["message"], got[1]
    assert "waiting for rank 0 to join" in got[1]["message"], got[1]
    assert "running it on the ring instead" in got[1]["message"], got[1]
    assert "running it on the ring instead" not in got[0]["message"], got[0]


@needs_ucx
def test_benchmark_checks_its_batches(tmp_path):
    """benchmarks/bench_hierarchy.py on the simulator: each timed batch of
    in-place all-reduces ends at n^calls x its input on both sides (the
    script fails otherwise), and its record names both."""
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_hierarchy.py"
    proc = subprocess.run([sys.executable, str(script), "--sizes", "262144", "--iters", "3", "--warmup", "1",
                           "--repeats", "2", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    row = json.loads(proc.stdout.splitlines()[0])
    assert row["size"] == 262144 and row["hierarchical_runs"] > 0 and row["ring_over_hierarchy"] > 0, row
