"""Ranks on "different hosts" on a GPU: two processes (under MPS on one GPU)
with different DFCCL_HOST_IDs reach each other only through the network
proxy over UCX (TCP on loopback), their arenas in host shared memory.  The
simulator's network scenarios (tests/net_scenarios.py): every collective
and dtype bit-identical to the ring on one host, opposite orders and a
queue on one tag, LL's lines carried by the proxy, send / recv and
all-to-all exact to the byte, hierarchical all-reduces (four processes,
two per host), and a remote rank killed or stopped is PeerLostError."""

from __future__ import annotations

import pytest

from net_scenarios import (HIER_MIN_BYTES, check_remote_loss, divergent, exchange, hierarchical_all_reduces,
                           hierarchical_blocks,
                           ll_divergent, needs_ucx, run_ranks, split_children, sweep, sweep_specs)

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_processes, pytest.mark.timeout(300), needs_ucx]

#: Host memory per rank: its arena and a mirror of each remote peer's.
OPTIONS = {"staging_bytes": 64 << 20}


def _across_hosts(got: dict, nranks: int) -> None:
    for r, info in got.items():
        assert info["path"] == "ring", info
        assert info["transports"] == tuple("self" if p == r else "ucx" for p in range(nranks)), info


def test_every_collective_bit_identical_to_one_host_gpu():
    got = run_ranks(sweep, 2, backend="cuda", **OPTIONS)
    _across_hosts(got, 2)
    assert all(info["checked"] == len(sweep_specs(2)) for info in got.values()), got
    assert all(info["ll"] > 0 for info in got.values()), got


def test_divergent_orders_complete_gpu():
    got = run_ranks(divergent, 2, backend="cuda", **OPTIONS)
    _across_hosts(got, 2)
    assert all(info["checked"] == 60 for info in got.values()), got


def test_ll_across_hosts_divergent_orders_gpu():
    got = run_ranks(ll_divergent, 2, backend="cuda", **OPTIONS)
    _across_hosts(got, 2)
    assert all(info["checked"] == 63 and info["ll"] == 61 for info in got.values()), got


def test_point_to_point_and_all_to_all_exact_gpu():
    got = run_ranks(exchange, 2, backend="cuda", **OPTIONS)
    _across_hosts(got, 2)
    assert all(info["checked"] == 20 for info in got.values()), got


def test_split_across_and_within_hosts_gpu():
    """Four processes, two per host id: children spanning hosts take the
    network (host arenas), children within a host the local paths (device
    arenas through CUDA IPC)."""
    got = run_ranks(split_children, 4, per_host=2, backend="cuda", **OPTIONS)
    for r, info in got.items():
        across, within = info["children"]
        assert across["transports"] == tuple("self" if p == r // 2 else "ucx" for p in range(2)), info
        assert across["path"] == "ring"
        assert "ucx" not in within["transports"] and within["path"] != "ring", info


@pytest.mark.parametrize("how, op", [("sigkill", "all_reduce"), ("sigstop", "all_reduce"), ("sigkill", "ll_all_reduce")])
def test_remote_peer_lost_gpu(how, op):
    check_remote_loss(how, op, backend="cuda", nranks=2, **OPTIONS)


def test_hierarchical_all_reduce_gpu():
    """Four processes, two per host id: all-reduces above hierarchy_min_bytes
    run as three parts (within the host over CUDA IPC, across over UCX),
    exact, in opposite orders and with a late peer."""
    got = run_ranks(hierarchical_all_reduces, 4, per_host=2, backend="cuda", hierarchy_min_bytes=HIER_MIN_BYTES,
                    **OPTIONS)
    assert all(info["checked"] == 10 and info["hierarchical"] == 11 for info in got.values()), got


def test_hierarchical_reduce_scatter_and_all_gather_gpu():
    """Four processes, two per host id: reduce-scatters and all-gathers
    whose blocks hold hierarchy_min_bytes run hierarchically, exact, in
    place and not, in opposite orders and in one tag's order with the
    other kinds (net_scenarios.hierarchical_blocks)."""
    got = run_ranks(hierarchical_blocks, 4, per_host=2, backend="cuda", hierarchy_min_bytes=HIER_MIN_BYTES,
                    **OPTIONS)
    assert all(info["checked"] == 19 and (info["reduce_scatters"], info["all_gathers"]) == (6, 6)
               for info in got.values()), got


@pytest.mark.parametrize("how", ["sigkill", "sigstop"])
def test_remote_peer_lost_in_hierarchical_all_reduce_gpu(how):
    got = check_remote_loss(how, "all_reduce", backend="cuda", nranks=4, per_host=2,
                            hierarchy_min_bytes=HIER_MIN_BYTES, **OPTIONS)
    assert set(got) == {0, 1, 2}, got
