"""A peer process that dies (os._exit, SIGKILL, between or during
collectives) or stops (SIGSTOP) is reported on every survivor as
PeerLostError naming it, within the bound; no survivor hangs, the survivors'
other communicators keep working, and they close cleanly.  Simulator, one
rank per process (the scenarios: peer_loss_scenarios.py; the same on GPUs:
test_peer_loss_gpu.py)."""

from __future__ import annotations

import pytest

from peer_loss_scenarios import check_dead_peer_reported


@pytest.mark.parametrize("how,peer_timeout,bound", [
    ("exit_between", 10.0, 10.0),
    ("exit_during", 10.0, 10.0),
    ("sigkill", 10.0, 10.0),
    ("sigstop", 2.0, 9.0),       # alive but stopped: only the heartbeat tells
])
def test_dead_peer_is_reported_on_every_survivor(how, peer_timeout, bound):
    check_dead_peer_reported(how, peer_timeout, bound, "sim", "ring")
