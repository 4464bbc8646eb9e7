"""The hardware floor of ``dfccl bench`` on a real GPU: both doorbells give
sane times, every kernel answers each doorbell once and leaves through its
stop word, a kernel nobody rings leaves by itself, and ``dfccl bench`` prints
the floor above its table and each dfccl time over it."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time

import pytest

from dfccl.bench import floor as bench_floor

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


def test_floor_is_measured_and_its_kernels_leave():
    iters, reps, warmup = 500, 3, 50
    floor = bench_floor.measure_floor(0, iters=iters, reps=reps, warmup=warmup)
    assert floor.device == 0 and floor.iters == iters and floor.reps == reps
    for timing in (floor.host, floor.stream):
        assert len(timing.reps_us) == reps
        assert 0 < timing.min_us <= timing.median_us <= timing.max_us < 100, timing
        # One answer per doorbell, warm-up included, and out through the stop word.
        assert timing.answered == warmup + iters * reps and timing.kernel_exit == "stopped", timing
    assert floor.host.enqueue_us is None and floor.stream.enqueue_us > 0
    doc = json.loads(json.dumps(bench_floor.floor_doc(floor)))
    assert bench_floor.floor_for_timing(doc, True) == floor.host.median_us
    assert bench_floor.floor_for_timing(doc, False) == floor.stream.median_us


@pytest.mark.parametrize("system", [True, False], ids=["host", "device"])
def test_kernel_without_a_doorbell_times_out(system):
    """Never rung and never stopped, the kernel leaves after its idle
    timeout and says so."""
    from cuda.bindings import driver

    from dfccl.runtime import driver_ok

    mod = bench_floor._module(0)
    driver_ok(driver.cuCtxPushCurrent(mod.primary_context), "cuCtxPushCurrent")
    kernel = bench_floor._Resident(0, system, idle_timeout_s=0.05, timeout_s=5.0)
    try:
        kernel.start()
        t0 = time.perf_counter()
        assert kernel.await_exit(5.0) and time.perf_counter() - t0 < 2.0
        assert kernel.state() == "timed out" and kernel.answered() == 0
    finally:
        kernel.close()
        driver_ok(driver.cuCtxPopCurrent(), "cuCtxPopCurrent")


def _bench(tmp_path, *args: str) -> tuple[str, dict]:
    proc = subprocess.run([sys.executable, "-m", "dfccl", "bench", "all_reduce", "-b", "8", "-e", "64K", "-f", "64",
                           "-n", "50", "-w", "5", "--devices", "0,0", "--no-nccl", "--no-plot", "--no-progress",
                           "--out", str(tmp_path), *args], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [path] = glob.glob(os.path.join(tmp_path, "dfccl-bench-*.json"))
    return proc.stdout, json.load(open(path))


@pytest.mark.parametrize("blocking", ["0", "1"])
def test_bench_prints_the_floor_and_the_ratios(tmp_path, blocking):
    text, doc = _bench(tmp_path, "-z", blocking)
    floor = doc["floor"]
    assert floor["status"] == "measured" and floor["device"] == 0, floor
    assert f"# {bench_floor.format_floor_line(floor)}" in text.splitlines()
    floor_us = bench_floor.floor_for_timing(floor, blocking == "1")
    assert 0 < floor_us < 100
    assert len(doc["rows"]) == 3
    for row in doc["rows"]:
        for form in ("out_of_place", "in_place"):
            assert row[form]["floor_ratio"] == pytest.approx(row[form]["time_us"] / floor_us), row


def test_bench_no_floor(tmp_path):
    text, doc = _bench(tmp_path, "--no-floor")
    assert doc["floor"] == {"status": "skipped (--no-floor)"}
    assert "# floor: skipped (--no-floor)" in text.splitlines()
    assert all(row[f]["floor_ratio"] is None for row in doc["rows"] for f in ("out_of_place", "in_place"))
