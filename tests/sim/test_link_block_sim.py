"""The daemon with a link block (DaemonOptions.link_block): one more block
reads the host link, and the scheduler blocks only pull from device memory.
The same scenarios as without it, on the simulator: rank-divergent orders
complete, a small ring wraps with every collective run exactly once, the
daemon leaves once nothing is left and comes back, and an abort reaches the
blocks through the link block's copy of the abort flags."""

from __future__ import annotations

import time

import numpy as np
import pytest

import dfccl
from dfccl.errors import InvalidArgumentError
from dfccl.options import LINK_BLOCK_ENV, link_block
from dfccl_support import scenarios as sc

LINKED = dfccl.DaemonOptions(link_block=True)


@pytest.fixture
def rng(request):
    return np.random.default_rng(abs(hash(request.node.nodeid)) % (2**32))


def _comms(n: int, path: str, daemon_options: dfccl.DaemonOptions = LINKED, per_device: int = 1, **comm):
    base = sc.fresh_sim_devices(1)[0]
    devices = [base + r // per_device for r in range(n)]
    return dfccl.Communicator.for_devices(devices, backend="sim", options=dfccl.CommOptions(path=path, **comm),
                                          daemon_options=daemon_options)


def _close(comms):
    for c in comms:
        c.close()


def _wait_for_state(daemon, state: str, timeout: float = 10.0) -> None:
    """Until the daemon of the latest launch publishes ``state`` (an earlier
    launch's 'exited' may still be there while the new one starts)."""
    start = time.monotonic()
    while daemon.daemon_state != (daemon.epoch, state):
        assert time.monotonic() - start < timeout, daemon.daemon_state
        time.sleep(1e-3)


def test_option_environment_and_fit(monkeypatch):
    monkeypatch.delenv(LINK_BLOCK_ENV, raising=False)
    assert link_block(dfccl.DaemonOptions(), 132, 32) is True, "on by default on a GPU with an SM to spare"
    assert link_block(dfccl.DaemonOptions(), 32, 32) is False, "no SM to spare: off, not a launch that cannot run"
    assert link_block(dfccl.DaemonOptions(), None, 2) is False, "off by default in the simulator"
    assert link_block(dfccl.DaemonOptions(link_block=True), None, 2) is True
    assert link_block(dfccl.DaemonOptions(link_block=False), 132, 32) is False
    with pytest.raises(InvalidArgumentError, match="resident daemon blocks"):
        link_block(dfccl.DaemonOptions(link_block=True), 32, 32)
    monkeypatch.setenv(LINK_BLOCK_ENV, "1")
    assert link_block(dfccl.DaemonOptions(), None, 2) is True
    assert link_block(dfccl.DaemonOptions(link_block=False), None, 2) is False, "the option wins"
    monkeypatch.setenv(LINK_BLOCK_ENV, "0")
    assert link_block(dfccl.DaemonOptions(), 132, 32) is False
    monkeypatch.setenv(LINK_BLOCK_ENV, "yes")
    with pytest.raises(InvalidArgumentError, match=LINK_BLOCK_ENV):
        link_block(dfccl.DaemonOptions(), 132, 32)
    for bad in (1, "1"):
        with pytest.raises(InvalidArgumentError, match="link_block"):
            dfccl.DaemonOptions(link_block=bad)


@pytest.mark.parametrize("path", ["direct", "ring"])
@pytest.mark.parametrize("n", [2, 4])
def test_rank_divergent_orders_complete(n, path, rng):
    comms = _comms(n, path)
    try:
        assert comms[0]._daemon.link_block
        specs = sc.random_specs(rng, 12, nranks=n, max_bytes=256 << 10)
        orders = [list(rng.permutation(12)) for _ in range(n)]
        sc.run(comms, specs, orders, rng=rng, timeout=120)
    finally:
        _close(comms)


def test_ranks_sharing_a_daemon(rng):
    comms = _comms(4, "direct", per_device=2)
    try:
        specs = sc.random_specs(rng, 8, nranks=4, max_bytes=64 << 10)
        sc.run(comms, specs, [list(rng.permutation(8)) for _ in range(4)], rng=rng, timeout=120)
    finally:
        _close(comms)


def test_small_ring_wraps_and_every_collective_runs_once(rng):
    """8 slots, a ring of 16 entries reused many times over; the link block
    reads ahead past the tail and takes an entry only when it proves
    published, so none is run twice or lost."""
    opts = dfccl.DaemonOptions(blocks=4, max_outstanding=8, link_block=True)
    comms = _comms(2, "direct", opts, channels=4, bytes_per_channel=1024)
    try:
        for batch in range(40):
            insts = [sc.prepare(sc.Spec(("w", batch, i), "all_reduce", 16 if (batch + i) % 2 else 4096, "int32"),
                                comms, rng) for i in range(4)]
            works = [sc.submit(inst, c) for inst in insts for c in comms]
            for w in works:
                w.synchronize(timeout=30)
            for inst in insts:
                sc.verify(inst)
    finally:
        _close(comms)


def test_daemon_leaves_and_comes_back():
    """The link block leaves with the scheduler blocks (EXITED counts it), and
    the next submission launches the daemon again."""
    opts = dfccl.DaemonOptions(blocks=2, empty_quit_ns=2_000_000, link_block=True)
    comms = _comms(2, "direct", opts)
    try:
        daemon = comms[0]._daemon
        for round_ in range(3):
            xs = [np.full(32, r + round_, np.float32) for r in range(2)]
            for w in [c.all_reduce(x, tag="t") for c, x in zip(comms, xs)]:
                w.synchronize(timeout=10)
            assert (xs[0] == 1 + 2 * round_).all() and (xs[1] == xs[0]).all()
            _wait_for_state(daemon, "exited")
        assert daemon.launches >= 3
    finally:
        _close(comms)


def test_abort_reaches_a_waiting_collective():
    """Rank 0 waits for a peer that never submits; aborting the communicator
    fails it (the abort flags reach the blocks through the link block)."""
    comms = _comms(2, "direct")
    try:
        w = comms[0].all_reduce(np.ones(16, np.float32), tag="alone")
        time.sleep(0.05)
        comms[0].abort()
        with pytest.raises(dfccl.DfcclError):
            w.synchronize(timeout=10)
    finally:
        _close(comms)
