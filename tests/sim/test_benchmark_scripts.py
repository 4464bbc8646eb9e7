"""The scripts of benchmarks/ that measure what ``dfccl bench`` does not, run
on the simulator: bench_latency.py (dfccl's latency breakdown and the
queue-depth sweep), host_timeline.py (a collective waited for, step by
step on the host) and bench_ddp.py (the DDP example against gloo)."""

from __future__ import annotations

import ast
import glob
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import dfccl

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
LATENCY = BENCHMARKS / "bench_latency.py"


def load_latency_module():
    spec = importlib.util.spec_from_file_location("bench_latency_under_test", LATENCY)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_latency_breakdown_on_the_simulator(tmp_path):
    proc = subprocess.run([sys.executable, str(LATENCY), "--backend", "sim", "--kinds", "all_reduce,reduce_scatter",
                           "--sizes", "8,4K", "--iters", "5", "--warmup", "1", "--depths", "1,4", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert "# Out of bounds values : 0 OK" in proc.stdout
    [line] = (tmp_path / "latency.jsonl").read_text().splitlines()
    rec = json.loads(line)
    assert rec["suite"] == "latency" and rec["machine"]["backend"] == "sim" and rec["machine"]["devices"] == [0, 1]
    assert rec["versions"]["dfccl"] == dfccl.__version__ and "revision" in rec and rec["args"]["iters"] == 5
    doc = rec["results"]
    assert doc["setup"]["ranks"] == 2 and doc["wrong_total"] == 0
    timed = [r for r in doc["rows"] if "dfccl" in r]
    sweeps = [r for r in doc["rows"] if "depth_sweep" in r]
    assert [(r["kind"], r["size"]) for r in timed] == [(k, s) for k in ("all_reduce", "reduce_scatter")
                                                       for s in (8, 4096)]
    for r in timed:
        d = r["dfccl"]
        assert r["wrong"] == 0
        assert 0 < d["us"] <= d["p90_us"]
        for key in ("queued_us", "running_us", "wall_us", "host_us", "max_wait_us"):
            assert d[key] >= 0, key
        assert d["host_us"] > 0 and d["wall_us"] > 0
        # Some block of rank 0's daemon ran every collective at least once.
        b = d["busy_blocks"]
        assert b["blocks"] and b["runs"] >= 1 and b["passes"] >= 1 and b["run_us"] > 0
        assert b["sms"] == [None] * len(b["blocks"])   # the simulator has no SMs
        # The step profile's fields are there (zero unless the daemon was
        # built with DFCCL_STEP_PROFILE=1); the move is part of FINISH.
        for key in ("ll_credit_us", "ll_push_us", "ll_publish_us", "ll_recv_us", "ll_finish_us", "ll_move_us",
                    "complete_us"):
            assert b[key] >= 0, key
        assert b["ll_move_us"] <= b["ll_finish_us"]
    assert [r["kind"] for r in sweeps] == ["all_reduce", "reduce_scatter"]
    for r in sweeps:
        assert r["wrong"] == 0
        assert [s["depth"] for s in r["depth_sweep"]] == [1, 4]
        assert all(s["us_per_collective"] > 0 for s in r["depth_sweep"])


def test_latency_check_catches_unwritten_outputs():
    """The check before timing uses fresh random inputs and poisoned outputs:
    outputs that nobody wrote count every element wrong."""
    from dfccl.bench import Case

    mod = load_latency_module()
    for kind in ("all_reduce", "all_gather", "reduce"):
        case = Case.for_size(kind, 256, 2, "float32", "sum", 0)
        bufs = mod.Buffers("sim", [0, 1], case)
        rng = np.random.default_rng(3)
        wants = bufs.fill(rng)
        checked = sum(w.size for w in wants if w is not None)
        assert bufs.wrong(wants) == checked > 0
        first = [s.copy() for s in bufs.sends]
        bufs.fill(rng)
        assert not np.array_equal(first[0], bufs.sends[0])  # fresh inputs every fill


def test_latency_is_dfccl_only():
    """NCCL's comparison is ``dfccl bench -z 1``: the script imports neither
    another benchmark script nor an NCCL binding."""
    tree = ast.parse(LATENCY.read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert not {m for m in imported if "nccl" in m or m.startswith(("bench_", "cupy", "torch"))}, imported


@pytest.mark.parametrize("args", [["--kinds", "nope"], ["--sizes", "1X"], ["--devices", "0"], ["--iters", "0"]])
def test_latency_bad_arguments_are_one_line(args, tmp_path):
    proc = subprocess.run([sys.executable, str(LATENCY), "--backend", "sim", *args, "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1].startswith("error: ") and "Traceback" not in proc.stderr


def test_host_timeline_on_the_simulator():
    script = BENCHMARKS / "probes" / "host_timeline.py"
    proc = subprocess.run([sys.executable, str(script), "--backend", "sim", "--device", "7300", "--bytes", "64",
                           "--iters", "20", "--warmup", "2"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = {line.split(":")[0].strip(): line for line in proc.stdout.splitlines() if ":" in line}
    for step in ("submitted -> taken", "taken -> rank 0 done", "retire both", "total"):
        assert step in lines, proc.stdout
    total = float(lines["total"].split(":")[1].split()[0])
    assert total > 0


def test_ddp_benchmark_on_cpu(tmp_path):
    pytest.importorskip("torch")
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "bench_ddp.py"), "--iters", "4", "--warmup", "1",
                           "--rounds", "1", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [line] = (tmp_path / "ddp.jsonl").read_text().splitlines()
    rec = json.loads(line)
    assert rec["suite"] == "ddp" and rec["args"]["iters"] == 4 and rec["machine"]["backend"] == "sim"
    doc = rec["results"]
    assert doc["reference"] == "gloo" and doc["ratio_dfccl_to_reference"] > 0
    assert len(doc["losses"]["dfccl"]) == 4 and doc["max_rel_loss_diff"] < 1e-6


def test_ddp_step_probe_on_cpu(tmp_path):
    """The probe's dfccl run (the simulator) gives gloo's loss and counts the
    process group's calls and the daemon's launches."""
    pytest.importorskip("torch")
    out = tmp_path / "probe.jsonl"
    for config in ("gloo", "dfccl,blocks=2,empty_us=1000"):
        proc = subprocess.run([sys.executable, str(BENCHMARKS / "probes" / "ddp_step_probe.py"), config, "--steps", "4",
                               "--warmup", "1", "--out", str(out)], capture_output=True, text=True, timeout=300,
                              env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
        assert proc.returncode == 0, proc.stdout + proc.stderr
    gloo, dfccl_run = [json.loads(line) for line in out.read_text().splitlines()]
    assert dfccl_run["loss_last"] == gloo["loss_last"]
    assert 1 <= dfccl_run["pg_calls_per_step"]["allreduce"] <= 2, dfccl_run
    assert dfccl_run["pg_call_host_us"]["allreduce"] > 0 and dfccl_run["daemon_launches"] >= 1


def test_ddp_ab_probe_on_cpu(tmp_path):
    """The in-process A/B of DDP over gloo and dfccl (the simulator) runs both
    models alike: same losses, a ratio for each step pair."""
    pytest.importorskip("torch")
    out = tmp_path / "ab.jsonl"
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "probes" / "ddp_ab_probe.py"), "--steps", "4", "--warmup", "1",
                           "--out", str(out)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(out.read_text())
    assert res["reference"] == "gloo" and res["steps"] == 4
    assert res["gloo_ms_median"] > 0 and res["dfccl_ms_median"] > 0 and res["median_pair_ratio"] > 0
    assert res["max_rel_loss_diff"] < 1e-5, res


def test_relaunch_gap_probe_on_the_simulator():
    """A gap longer than the empty quit (2 ms in the simulator) relaunches
    the daemon at every collective; back to back it stays."""
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "probes" / "relaunch_gap_probe.py"), "--backend", "sim",
                           "--iters", "10", "--warmup", "2", "--gaps-us", "0,8000"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    launches = {float(line.split()[1]): int(line.split()[-1]) for line in proc.stdout.splitlines()
                if line.startswith("gap")}
    assert launches[8000.0] >= 10 and launches[0.0] < 6, proc.stdout


def test_queue_depth_probe_on_the_simulator():
    """64 all-reduces of 64 KiB past a 1 MiB staging (most through reserved
    minimum FIFOs) drain, every result exact."""
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "probes" / "queue_depth_probe.py"), "--backend", "sim",
                           "--n", "64", "--count", "16384", "--staging-bytes", str(1 << 20)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "n=64 count=16384 path=ring" in proc.stdout and " 0 wrong" in proc.stdout, proc.stdout
