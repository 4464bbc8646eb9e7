"""What Communicator.status() says of one pending collective
(flight.pending_state): this rank's side first, then the peers'."""

from __future__ import annotations

import pytest

from dfccl.flight import pending_state

BASE = dict(missing=[], waiting_for=None, own_published=True, taken=True, earlier_instance=None,
            stream_ordered=False, daemon="running")


def state(**kw):
    return pending_state(**dict(BASE, **kw))


def test_started_here():
    assert state() == "transferring"
    assert state(missing=[2]) == "waiting for ranks to join"
    assert state(waiting_for=1) == "every rank has joined; waiting for data"
    # Unknown (records not readable): the peers' side decides.
    assert state(own_published=None, missing=[1]) == "waiting for ranks to join"
    assert state(own_published=None, missing=None) == "transferring"


@pytest.mark.parametrize("daemon", ["exited", "leaving", "not launched"])
def test_not_started_daemon_not_running(daemon):
    assert state(own_published=False, missing=[1], daemon=daemon) == f"not started: this rank's daemon is {daemon}"
    assert state(own_published=False, taken=False, daemon=daemon) == \
        f"not started: this rank's daemon has not taken the submission up yet (the daemon is {daemon})"
    # A stream that has not reached the collective is the cause, not the daemon that left meanwhile.
    assert state(own_published=False, stream_ordered=True, stream_reached=False, daemon=daemon) == \
        "not started: taken by this rank's daemon, its stream has not reached it"


def test_not_started_here_in_order_of_cause():
    assert state(own_published=False, taken=False, earlier_instance=3, stream_ordered=True) == \
        "not started: this rank's daemon has not taken the submission up yet"
    assert state(own_published=False, earlier_instance=3, stream_ordered=True) == \
        "not started: instance 3 of its tag is still pending here and runs first"
    assert state(own_published=False, stream_ordered=True, stream_reached=False, missing=[1]) == \
        "not started: taken by this rank's daemon, its stream has not reached it"
    assert state(own_published=False, stream_ordered=True, stream_reached=None) == \
        "not started: taken by this rank's daemon; whether its stream has reached it is unknown"
    assert state(own_published=False, stream_ordered=True, stream_reached=True) == \
        "not started: taken by this rank's daemon, not run yet"
    assert state(own_published=False, daemon="quitting") == "not started: taken by this rank's daemon, not run yet"
