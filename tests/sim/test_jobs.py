"""One process per GPU the way jobs run: init_from_env (torchrun, Open MPI,
Slurm variables), ``python -m dfccl.launch``, Communicator.split with
overlapping TP/DP groups, and user-buffer registration across processes.
Simulator in CI; the ``gpu`` tests put 2-4 processes on one GPU."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import dfccl
from dfccl_support import scenarios as sc
from dfccl.environment import job_from_env

TESTS = Path(__file__).resolve().parent.parent   # tests/: the rank scripts live there
ROOT = TESTS.parent
TIMEOUT = 60


def launch(n: int, scenario: str, *extra: str, timeout: float = 240) -> tuple[int, str, list[dict]]:
    # The ranks import dfccl from where this process did (any install), and
    # print a traceback if they crash.
    package_root = os.path.dirname(os.path.dirname(dfccl.__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([package_root, str(TESTS)]), PYTHONFAULTHANDLER="1")
    proc = subprocess.run([sys.executable, "-m", "dfccl.launch", "-n", str(n), *extra,
                           str(TESTS / "launch_target.py"), scenario],
                          env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in proc.stdout.splitlines() if "RESULT " in line]
    return proc.returncode, out, sorted(results, key=lambda r: r["rank"])


# -- environment ---------------------------------------------------------------------
def test_torchrun_variables():
    job = job_from_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "node7",
                        "MASTER_PORT": "29500"})
    assert (job.launcher, job.rank, job.world_size, job.local_rank) == ("torchrun", 3, 8, 1)
    assert (job.root_host, job.root_port) == ("node7", 29501) and len(job.secret) == 32


def test_openmpi_and_slurm_variables_with_root_addr():
    job = job_from_env({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
                        "OMPI_COMM_WORLD_LOCAL_RANK": "0", "DFCCL_ROOT_ADDR": "10.0.0.1:4000"})
    assert (job.launcher, job.rank, job.world_size, job.local_rank, job.root_host, job.root_port) == \
        ("openmpi", 2, 4, 0, "10.0.0.1", 4000)
    job = job_from_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "6", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "77",
                        "DFCCL_ROOT_ADDR": "[fe80::1]:5000", "DFCCL_SECRET": "ab" * 32, "DFCCL_DEVICE": "3"})
    assert (job.launcher, job.rank, job.local_rank, job.root_host, job.root_port, job.device) == \
        ("slurm", 5, 1, "fe80::1", 5000, 3)
    assert job.secret == bytes.fromhex("ab" * 32)


@pytest.mark.parametrize("env, match", [
    ({}, "no launcher variables found; set RANK and WORLD_SIZE"),
    ({"RANK": "0"}, "RANK is set but WORLD_SIZE is not"),
    ({"RANK": "4", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "outside 0..3"),
    ({"RANK": "x", "WORLD_SIZE": "4"}, "RANK='x' is not an integer"),
    ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "LOCAL_RANK is not set"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"}, "DFCCL_ROOT_ADDR=host:port, or MASTER_ADDR"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h"}, "neither MASTER_PORT nor"),
    ({"RANK": "0", "WORLD_SIZE": "1", "DFCCL_ROOT_ADDR": "h"}, "names no port"),
    ({"RANK": "0", "WORLD_SIZE": "1", "DFCCL_ROOT_ADDR": "h:1", "DFCCL_SECRET": "zz"}, "hexadecimal"),
])
def test_environment_errors_name_the_variables(env, match):
    with pytest.raises(dfccl.InvalidArgumentError, match=match):
        job_from_env(env)


# -- launcher --------------------------------------------------------------------------
def test_launch_all_reduce_with_rank_prefixes():
    rc, out, results = launch(3, "all_reduce", "--backend", "sim")
    assert rc == 0, out
    assert [r["rank"] for r in results] == [0, 1, 2] and all(r["path"] == "staged" for r in results)
    for r in range(3):
        assert f"[{r}] up: rank {r} of 3 on sim:{r}" in out


def test_launch_devices_round_robin():
    rc, out, results = launch(4, "all_reduce", "--backend", "sim", "--devices", "5,6")
    assert rc == 0, out
    assert [r["device"] for r in results] == [5, 6, 5, 6]


def test_launch_stops_the_rest_when_one_fails():
    start = time.monotonic()
    rc, out, _ = launch(3, "fail", "--grace", "2")
    assert rc == 3, out
    assert "[1] rank 1 fails now" in out and "rank 1 exited with status 3" in out
    assert time.monotonic() - start < 30, "the sleeping ranks were not stopped"


def _rank_env(**extra: str) -> dict:
    # The ranks import dfccl from where this process did (any install), and
    # print a traceback if they crash.
    package_root = os.path.dirname(os.path.dirname(dfccl.__file__))
    return dict(os.environ, PYTHONPATH=os.pathsep.join([package_root, str(TESTS)]), PYTHONFAULTHANDLER="1",
                **extra)


def _start_launcher(tmp_path: Path, n: int, grace: float, scenario: str, env: dict, *, pids: bool = True):
    """The launcher with its output in a file (read without blocking), and,
    with ``pids``, the rank pids once every rank printed ``pid N``."""
    log = tmp_path / "launch.log"
    proc = subprocess.Popen([sys.executable, "-m", "dfccl.launch", "-n", str(n), "--grace", str(grace),
                             str(TESTS / "launch_target.py"), scenario], env=env,
                            stdout=log.open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    found: dict[int, int] = {}
    while pids and time.monotonic() < deadline and proc.poll() is None:
        for line in log.read_text().splitlines():
            words = line.split()
            if words[1:2] == ["pid"]:   # "[rank] pid N ..."
                found[int(words[0].strip("[]"))] = int(words[2])
        if len(found) == n:
            break
        time.sleep(0.1)
    return proc, log, [found[r] for r in sorted(found)]


def _stopped(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:][:1] == b"T"


def _end(proc: subprocess.Popen, pids: list[int]) -> None:
    """Kills what a failed test left running: the launcher and its ranks."""
    for pid in [proc.pid] + pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()


def test_launch_forwards_sigterm(tmp_path):
    proc, log, pids = _start_launcher(tmp_path, 2, 2, "fail", _rank_env(RANK_THAT_FAILS="none"), pids=False)
    try:
        time.sleep(3)
        assert proc.poll() is None, log.read_text()
        proc.terminate()
        proc.wait(timeout=30)
        # No rank failed on its own: the status is the one SIGTERM gave them.
        assert proc.returncode == 128 + signal.SIGTERM, log.read_text()
    finally:
        _end(proc, [])


@pytest.mark.parametrize("how, signum", [("stop", signal.SIGTERM), ("ignore", signal.SIGINT)])
def test_launch_kills_a_rank_that_outlives_its_grace(tmp_path, how, signum):
    grace = 1.0
    mark = tmp_path / "stopping"
    proc, log, pids = _start_launcher(tmp_path, 3, grace, "stuck", _rank_env(STUCK_HOW=how, STUCK_MARK=str(mark)))
    try:
        assert len(pids) == 3 and proc.poll() is None, log.read_text()
        # Rank 1 ignores the signals once it made the mark, and stops right after.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (mark.exists() and (how != "stop" or _stopped(pids[1]))):
            time.sleep(0.05)
        t0 = time.monotonic()
        proc.send_signal(signum)
        try:
            proc.wait(timeout=grace + 10)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the launcher still runs {grace + 10} s after {signum.name}:\n{log.read_text()}")
        assert time.monotonic() - t0 < grace + 10
        out = log.read_text()
        assert f"killing rank 1 (pid {pids[1]}) with SIGKILL" in out, out
        assert f"after {signum.name}" in out and f"the launcher got {signum.name}" in out, out
        assert ("it is stopped" in out) == (how == "stop"), out
        assert "killing rank 0" not in out and "killing rank 2" not in out, out   # they obeyed the signal
        assert proc.returncode == 128 + signum, out
    finally:
        _end(proc, pids)


def test_launch_kills_a_stopped_rank_when_another_fails(tmp_path):
    grace = 1.0
    env = _rank_env(STUCK_OTHERS="fail", STUCK_MARK=str(tmp_path / "stopping"))
    proc, log, pids = _start_launcher(tmp_path, 3, grace, "stuck", env)
    try:
        assert len(pids) == 3, log.read_text()
        try:
            proc.wait(timeout=grace + 10)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the launcher still runs after a failed rank and its grace:\n{log.read_text()}")
        out = log.read_text()
        assert proc.returncode == 3, out
        assert "rank 0 exited with status 3; stopping the other ranks" in out, out
        assert f"killing rank 1 (pid {pids[1]}) with SIGKILL" in out, out
        assert "the ranks were stopped because rank 0 exited with status 3" in out, out
    finally:
        _end(proc, pids)


# -- split ------------------------------------------------------------------------------
def test_split_tp_dp_in_one_process():
    comms = dfccl.Communicator.for_devices([60, 61, 62, 63], backend="sim")
    tp = dfccl.Communicator.split_all(comms, [r // 2 for r in range(4)])
    dp = dfccl.Communicator.split_all(comms, [r % 2 for r in range(4)], keys=[-r for r in range(4)])
    odd = dfccl.Communicator.split_all(comms, [None, 7, -1, 7])
    try:
        assert [(c.rank, c.world_size) for c in tp] == [(0, 2), (1, 2), (0, 2), (1, 2)]
        assert [(c.rank, c.world_size) for c in dp] == [(1, 2), (1, 2), (0, 2), (0, 2)]   # ordered by key
        assert odd[0] is None and odd[2] is None and (odd[1].rank, odd[3].rank) == (0, 1)
        rounds = 10
        tp_x = [[np.full(500 + i, r + 1 + i, np.float32) for i in range(rounds)] for r in range(4)]
        dp_x = [[np.full(33, 10 * r + i, np.int64) for i in range(rounds)] for r in range(4)]
        works = []
        # Even ranks: all TP then all DP; odd ranks: all DP, in reverse, then TP.
        for r in range(4):
            t = [tp[r].all_reduce(tp_x[r][i], tag=("tp", i)) for i in (range(rounds) if r % 2 == 0 else [])]
            d = [dp[r].all_reduce(dp_x[r][i], op="max", tag=("dp", i)) for i in reversed(range(rounds))]
            if r % 2:
                t = [tp[r].all_reduce(tp_x[r][i], tag=("tp", i)) for i in range(rounds)]
            works += t + d
        for w in works:
            w.synchronize(timeout=TIMEOUT)
        for r in range(4):
            g = [2 * (r // 2), 2 * (r // 2) + 1]
            for i in range(rounds):
                assert (tp_x[r][i] == sum(p + 1 + i for p in g)).all()
                assert (dp_x[r][i] == 10 * (r % 2 + 2) + i).all()
        y = [np.full(4, r, np.int32) for r in (1, 3)]
        ws = [odd[1].all_reduce(y[0]), odd[3].all_reduce(y[1])]
        for w in ws:
            w.synchronize(timeout=TIMEOUT)
        assert all((v == 4).all() for v in y)
    finally:
        sc.settle([c for c in tp + dp + odd if c is not None])
        sc.settle(comms)


def test_split_argument_errors():
    comms = dfccl.Communicator.for_devices([64, 65], backend="sim")
    try:
        with pytest.raises(dfccl.InvalidArgumentError, match="color must be an int or None"):
            comms[0].split("a")
        with pytest.raises(dfccl.InvalidArgumentError, match="key must be an int or None"):
            comms[0].split(0, key=1.5)
        with pytest.raises(dfccl.InvalidArgumentError, match="2 communicators, 1 colors"):
            dfccl.Communicator.split_all(comms, [0])
        with pytest.raises(dfccl.StartupTimeoutError, match="ranks \\[1\\] of this process have not called split"):
            comms[0].split(0, timeout=0.3)
    finally:
        sc.settle(comms)


def test_split_tp_dp_across_processes():
    rc, out, results = launch(4, "tp_dp", "--backend", "sim")
    assert rc == 0, out
    assert [r["tp"] for r in results] == [[0, 2], [1, 2], [0, 2], [1, 2]]
    assert [r["dp"] for r in results] == [[0, 2], [0, 2], [1, 2], [1, 2]]
    assert [r["nobody"] for r in results] == [[2, 3], [1, 3], [0, 3], None]
    assert all(r["path"] == "staged" for r in results)


# -- fork ------------------------------------------------------------------------------
def test_forked_child_exits_without_touching_the_job():
    rc, out, results = launch(2, "fork", "--backend", "sim")
    assert rc == 0, out
    assert len(results) == 2, out
    assert results[0]["child_exit_s"] < 3.0, results   # it waited 10 s for a daemon it does not have


def test_a_device_fault_reaches_ranks_in_other_processes():
    rc, out, results = launch(3, "device_fault", "--backend", "sim")
    assert rc == 0, out
    assert results[0]["error"] == "BackendError", results
    for r in results[1:]:
        # A rank that submits after it learnt of the loss is refused at once
        # ("the communicator lost rank 0"); one that waited is failed ("rank 0 is lost").
        assert r["error"] == "PeerLostError" and r["origin"] == 0, r
        assert "rank 0 is lost" in r["message"] or "the communicator lost rank 0" in r["message"], r
        assert r["seconds"] < 3.0, r   # before rank 0's process exits
    # The first to see rank 0's status page says why; one that learnt it from
    # that peer's daemon first may say only that a peer found it lost.
    assert any("its device failed under its daemon" in r["message"] for r in results[1:]), results


# -- registration ----------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 3])
def test_registered_buffers_across_processes(n):
    rc, out, results = launch(n, "register", "--backend", "sim")
    assert rc == 0, out
    for r in results:
        assert r["used"] == [True, True, True, False, True, False, True], r


def test_register_in_one_process_needs_no_mapping():
    comms = dfccl.Communicator.for_devices([66, 67], backend="sim")
    try:
        x = np.ones(10, np.float32)
        with comms[0].register(x) as h:
            assert not h.active and comms[0].path == "direct"
        assert h.closed
        with pytest.raises(dfccl.InvalidArgumentError, match="empty"):
            comms[0].register(np.ones(0, np.float32))
        with pytest.raises(dfccl.InvalidArgumentError, match="RegistrationHandle"):
            comms[0].deregister(x)
    finally:
        sc.settle(comms)


# -- GPU: 4 processes sharing one GPU ------------------------------------------------------
@pytest.mark.gpu
def test_split_tp_dp_four_processes_on_one_gpu():
    rc, out, results = launch(4, "tp_dp", "--backend", "cuda", "--devices", "0")
    assert rc == 0, out
    assert all(r["path"] == "staged" for r in results)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [2, 4])
def test_registered_buffers_processes_on_one_gpu(n):
    rc, out, results = launch(n, "register", "--backend", "cuda", "--devices", "0")
    assert rc == 0, out
    for r in results:
        assert r["used"] == [True, True, True, False, True, False, True], r


@pytest.mark.gpu
def test_launch_all_reduce_on_gpu():
    rc, out, results = launch(2, "all_reduce", "--backend", "cuda")
    assert rc == 0, out
