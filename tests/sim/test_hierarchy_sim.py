"""Hierarchical all-reduce (dfccl.hierarchy) on the simulator: ranks in
separate processes on two "hosts" (DFCCL_HOST_ID), two or more on each:
exact results, in place and not, the ring where it does not apply, opposite
orders, a late peer, the parts' failures reaching every rank, and the
layouts that build no hierarchy."""

from __future__ import annotations

import numpy as np
import pytest

import dfccl
from dfccl.hierarchy import host_layout
from dfccl.options import DEFAULT_HIERARCHY_MIN_BYTES
from net_scenarios import (HIER_MIN_BYTES, TIMEOUT, check_remote_loss, hierarchical_all_reduces, needs_ucx,
                           run_ranks)


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
        # 4 cases + 2 opposite-order + the late one + 2 in order on one tag.
        assert got[r]["hierarchical"] == 9, got[r]


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
