"""Mechanics of the NCCL reference harness (dfccl_support.nccl_reference), checked on
CPU with torch's gloo backend: completion, hang detection with the whole
process tree killed, wrong-result detection, error reporting and the
"unavailable" answer for NCCL without GPUs.

Gloo behaves like NCCL where it matters here: it matches collectives by their
position within a group (so inconsistent_order_one_group mixes A with B) and a
rank that blocks on a collective its peer has not issued waits forever
(device_sync).  Unlike NCCL on a GPU, gloo runs each group's collectives on
that group's own threads, so the two-group scenarios complete.

The installed module is loaded from its file so that these tests need neither the
compiled dfccl extensions nor a GPU; they need torch (CPU build is enough) and
skip without it."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

# The module's file, loaded by path: it never imports the dfccl package.
_PATH = Path(__file__).resolve().parents[2] / "support" / "dfccl_support" / "nccl_reference.py"
_spec = importlib.util.spec_from_file_location("_nccl_reference_under_test", _PATH)
nr = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = nr
_spec.loader.exec_module(nr)

if not nr.available("gloo"):
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

TIMEOUT = 4.0          # scenario phase; gloo finishes these in well under a second
SETUP_TIMEOUT = 30.0   # torch import and rendezvous of the rank processes
COUNT = 4096


def run(name: str, **kw) -> tuple[nr.Verdict, float]:
    kw.setdefault("backend", "gloo")
    kw.setdefault("timeout", TIMEOUT)
    kw.setdefault("setup_timeout", SETUP_TIMEOUT)
    kw.setdefault("count", COUNT)
    t0 = time.monotonic()
    v = nr.run_nccl_scenario(name, **kw)
    return v, time.monotonic() - t0


def assert_no_children_left(v: nr.Verdict) -> None:
    """Every rank process was reaped: no /proc entry, not even a zombie."""
    assert v.per_rank, "no rank was launched"
    for r in v.per_rank:
        assert r["returncode"] is not None, f"rank {r['rank']} was not reaped"
        assert not os.path.exists(f"/proc/{r['pid']}"), f"rank {r['rank']} (pid {r['pid']}) is still alive"


def test_completes_with_correct_sums():
    v, _ = run("wait_between")
    assert v.outcome == "completed", v.detail
    assert [r["rank"] for r in v.per_rank] == [0, 1]
    assert all(r["finished"] and r["returncode"] == 0 for r in v.per_rank)
    assert all(r["results"] == {s: {"ok": True, "wrong": 0, "first_bad": None} for s in ("A", "B")}
               for r in v.per_rank)
    # Rank 0 waits for A before it issues B; rank 1 issues B first.
    assert v.per_rank[0]["submitted"] == ["A", "B"] and v.per_rank[0]["synchronized"] == [["A"], ["B"]]
    assert v.per_rank[1]["submitted"] == ["B", "A"] and v.per_rank[1]["synchronized"] == [["B", "A"]]
    # NVLink multicast stays off in every rank, whatever the caller's environment.
    assert all(r["env"] == nr.FORCED_ENV for r in v.per_rank)
    assert_no_children_left(v)


def test_two_groups_complete_on_gloo():
    """Each gloo group has its own worker threads, so opposite orders on two
    groups do not block each other (unlike NCCL kernels that cannot both run)."""
    v, _ = run("inconsistent_order_two_groups", env={"NCCL_NVLS_ENABLE": "1"})
    assert v.outcome == "completed", v.detail
    assert all(r["env"] == nr.FORCED_ENV for r in v.per_rank), "the caller's env must not re-enable NVLS"
    assert_no_children_left(v)


def test_hang_is_detected_and_every_rank_killed():
    v, wall = run("device_sync", timeout=3.0)
    assert v.outcome == "hung", v.detail
    assert v.seconds == pytest.approx(3.0, abs=0.5)
    assert wall < v.setup_seconds + 3.0 + 5.0
    # Each rank blocked on its own first collective, which its peer never issued.
    assert [r["submitted"] for r in v.per_rank] == [["A"], ["B"]]
    assert [r["waiting_for"] for r in v.per_rank] == [["A"], ["B"]]
    assert all(not r["finished"] and r["error"] is None for r in v.per_rank)
    assert "blocked waiting for A" in v.detail and "blocked waiting for B" in v.detail
    assert_no_children_left(v)


def test_wrong_result_when_one_group_pairs_a_with_b():
    v, _ = run("inconsistent_order_one_group")
    assert v.outcome == "wrong_result", v.detail
    # Position 1 pairs rank 0's A (1) with rank 1's B (200): 201 instead of 1 + 2.
    assert "rank 0 step A" in v.detail and "got 201.0, want 3.0" in v.detail
    r0 = v.per_rank[0]["results"]
    assert r0["A"]["ok"] is False and r0["A"]["wrong"] == COUNT and r0["A"]["first_bad"]["index"] == 0
    assert_no_children_left(v)


def test_three_ranks():
    v, _ = run("device_sync", world_size=3, timeout=2.0)
    assert v.outcome == "hung", v.detail
    assert [r["waiting_for"] for r in v.per_rank] == [["A"], ["B"], ["A"]]
    assert_no_children_left(v)


def test_rank_failure_is_an_error_with_its_message():
    # A setup deadline far beyond the ranks' start-up (torch's import, on a
    # loaded machine tens of seconds): a failed rank must end the run at
    # once, well before that deadline.
    v, wall = run("wait_between", env={"GLOO_SOCKET_IFNAME": "dfccl-no-such-if0"}, setup_timeout=4 * SETUP_TIMEOUT)
    assert v.outcome == "error", v.detail
    assert "dfccl-no-such-if0" in v.detail
    assert wall < 2 * SETUP_TIMEOUT, f"the run took {wall:.1f} s: it waited for its deadline"
    assert_no_children_left(v)


def test_nccl_unavailable_without_gpus():
    if nr.available("nccl"):
        pytest.skip("NCCL and two GPUs are available here")
    t0 = time.monotonic()
    v = nr.run_nccl_scenario("device_sync", backend="nccl", timeout=1.0)
    assert v.outcome == "unavailable" and v.per_rank == []
    assert time.monotonic() - t0 < 5.0  # the availability probe is cached from the check above


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="unknown scenario"):
        nr.run_nccl_scenario("no_such_scenario", backend="gloo")
    with pytest.raises(ValueError):
        nr.run_nccl_scenario("device_sync", backend="mpi")
    with pytest.raises(ValueError):
        nr.run_nccl_scenario("device_sync", backend="gloo", world_size=1)


def test_cli_prints_one_line_per_verdict(capsys):
    assert nr.main(["--backend", "gloo", "--timeout", "4", "--count", "64",
                    "inconsistent_order_one_group", "wait_between"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    assert lines[0].split()[:2] == ["inconsistent_order_one_group", "wrong_result"]
    assert lines[1].split()[:2] == ["wait_between", "completed"]


def test_importable_as_package_module():
    try:
        mod = importlib.import_module("dfccl_support.nccl_reference")
    except ImportError as exc:  # dfccl's compiled extensions are not built here
        pytest.skip(f"dfccl is not importable: {exc}")
    assert mod.SCENARIOS == nr.SCENARIOS and callable(mod.run_nccl_scenario)


# -- the stream-ordered reference (CuPy) ----------------------------------------------------------
def test_stream_order_reference_without_cupy_is_an_error():
    """Without CuPy the reference says so (outcome "error", the import error
    in the detail) instead of hanging or claiming a verdict."""
    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("CuPy is installed")
    assert not nr.cupy_nccl_available(2)
    v = nr.stream_order_reference(timeout=1.0, setup_timeout=60.0)
    assert set(v) == {"outcome", "seconds", "detail"}
    assert v["outcome"] == "error" and "cupy" in v["detail"], v
    with pytest.raises(ValueError):
        nr.stream_order_reference(timeout=0)


def test_stuck_child_is_killed_with_what_it_started_and_its_output_kept():
    """The reference's subprocess: past the deadline its whole process group
    is killed (a grandchild included) and what it printed is still read."""
    code = ("import subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
            "print('OUTCOME hung 1.0', child.pid, flush=True)\n"
            "time.sleep(600)\n")
    t0 = time.monotonic()
    out, err, returned = nr._run_child(code, [], 3.0)
    assert not returned and time.monotonic() - t0 < 30
    words = out.split()
    assert words[:3] == ["OUTCOME", "hung", "1.0"], (out, err)
    grandchild = int(words[3])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{grandchild}/stat") as f:
                if f.read().split(")")[-1].split()[0] == "Z":
                    break  # killed, waiting for init to reap it
        except FileNotFoundError:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"grandchild {grandchild} outlived the kill")
