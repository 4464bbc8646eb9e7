"""A process that forks (a data-loader worker, a helper started with
os.fork) after using dfccl: the child owns none of its parent's daemons,
communicators or pending collectives.  Using one fails at once with a
ClosedError that says so, its exit handlers return at once and touch nothing
of the parent's, and the child can create communicators of its own."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

import dfccl
from dfccl_support import scenarios as sc
from dfccl_support.forking import outcomes, run_in_forked_child

DEV = 4200          # device ids of this module: 4200..4299
TIMEOUT = 30.0

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


def test_forked_child_cannot_use_the_parents_communicators_and_does_not_disturb_them():
    comms = dfccl.Communicator.for_devices([DEV, DEV + 1], backend="sim")
    try:
        x = np.full(64, 1.0, np.float32)
        pending = comms[0].all_reduce(x, tag="across the fork")   # rank 1 joins after the child is gone

        def child():
            out = outcomes({"submit": lambda: comms[0].all_reduce(np.ones(4, np.float32), tag="in the child"),
                            "pending": lambda: pending.synchronize(timeout=TIMEOUT),
                            "close": lambda: [c.close() for c in comms]})
            return {**out, "parent": os.getppid(), "done": pending.done()}

        out = run_in_forked_child(child)
        assert "error" not in out, out
        parent = out["parent"]
        assert out["submit"].startswith("ClosedError") and f"belongs to process {parent}, which forked this process" \
            in out["submit"] and "forked child cannot use" in out["submit"], out
        assert out["pending"].startswith("ClosedError") and f"belongs to process {parent}" in out["pending"], out
        assert out["pending_s"] < 1.0 and out["done"], out
        assert out["close"] is None and out["close_s"] < 1.0 and out["exit_s"] < 2.0, out
        # The parent's communicators were not touched: the collective pending
        # across the fork completes, and so do new ones.
        y = np.full(64, 2.0, np.float32)
        comms[1].all_reduce(y, tag="across the fork").synchronize(timeout=TIMEOUT)
        pending.synchronize(timeout=TIMEOUT)
        assert (x == 3).all() and (y == 3).all()
        zs = [np.full(16, r + 1, np.int32) for r in range(2)]
        for w in [c.all_reduce(z, tag="after") for c, z in zip(comms, zs)]:
            w.synchronize(timeout=TIMEOUT)
        assert (zs[0] == 3).all() and (zs[1] == 3).all()
    finally:
        sc.settle(comms)


def test_forked_child_creates_communicators_of_its_own():
    comms = dfccl.Communicator.for_devices([DEV + 2, DEV + 3], backend="sim")
    try:
        def child():
            mine = dfccl.Communicator.for_devices([DEV + 2, DEV + 3], backend="sim")
            try:
                assert all(c._daemon is not p._daemon for c, p in zip(mine, comms))
                zs = [np.full(8, r + 5, np.float32) for r in range(2)]
                for w in [c.all_reduce(z, tag="child") for c, z in zip(mine, zs)]:
                    w.synchronize(timeout=TIMEOUT)
                return {"sums": [float(z[0]) for z in zs]}
            finally:
                sc.settle(mine)

        out = run_in_forked_child(child)
        assert out.get("sums") == [11.0, 11.0], out
        assert out["exit_s"] < 2.0, out
        zs = [np.full(8, r + 1, np.float32) for r in range(2)]
        for w in [c.all_reduce(z, tag="parent") for c, z in zip(comms, zs)]:
            w.synchronize(timeout=TIMEOUT)
        assert (zs[0] == 3).all()
    finally:
        sc.settle(comms)


class _GpuBackendOfTheParent:
    """Stands for a CUDA backend the parent created (none exists without a
    GPU): the fork hook must forget it and record that CUDA was in use."""

    forgotten = False

    def forget_after_fork(self):
        _GpuBackendOfTheParent.forgotten = True


def test_forked_child_is_refused_cuda_after_the_parent_initialised_it(monkeypatch):
    from dfccl import runtime

    monkeypatch.setitem(runtime._devices, ("cuda", 99), _GpuBackendOfTheParent())

    def child():
        out = {"forgotten": _GpuBackendOfTheParent.forgotten, "left": [list(k) for k in runtime._devices]}
        try:
            runtime.get_device("cuda", 0)
        except dfccl.BackendError as exc:
            out["refused"] = str(exc)
        return out

    out = run_in_forked_child(child)
    assert out["forgotten"] and out["left"] == [], out
    assert f"forked by process {os.getpid()}" in out["refused"] and "'spawn'" in out["refused"], out
    assert not _GpuBackendOfTheParent.forgotten   # the parent's own is untouched
