"""Peer loss on GPUs, one rank per process (CUDA IPC between the processes):
a peer killed during a running all-reduce, or that exits between
collectives, is reported on every survivor as PeerLostError within the
bound, and the survivors close cleanly.  The scenarios of
tests/peer_loss_scenarios.py, on every path a multi-process communicator
takes (staged, LL, ring)."""

from __future__ import annotations

import pytest

from peer_loss_scenarios import check_dead_peer_reported

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_processes, pytest.mark.timeout(240)]


@pytest.mark.parametrize("path", ["auto", "ring"])
@pytest.mark.parametrize("how", ["exit_during", "sigkill"])
def test_dead_peer_is_reported_on_every_survivor_gpu(how, path):
    check_dead_peer_reported(how, 10.0, 10.0, "cuda", path)


def test_stopped_peer_is_reported_gpu():
    check_dead_peer_reported("sigstop", 2.0, 9.0, "cuda", "auto")
