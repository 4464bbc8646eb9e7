"""The ``dfccl`` command: bench (both modes, back to back and blocking, on the
simulator), bench --report, info, --version, one-line errors for bad
arguments and a quiet end when the reader of its output goes away."""

from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest

from dfccl import bench
from dfccl.bench import harness, report

SWEEP = ["--backend", "sim", "-b", "8", "-e", "1M", "-f", "8", "-n", "2", "-w", "1", "--no-progress"]
SIZES = [8, 64, 512, 4096, 32768, 262144]


def dfccl_cmd(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dfccl", *args], capture_output=True, text=True, timeout=timeout)


def check_bench_output(proc: subprocess.CompletedProcess, out_dir, mode: str, kinds: list[str],
                       blocking: bool = False) -> dict:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    text = proc.stdout
    for col in ("out-of-place", "in-place", "algbw", "busbw", "#wrong", "redop", "root", "ratio"):
        assert col in text
    assert "NCCL: not available (no GPU/torch)" in text
    assert "# floor: n/a (simulator)" in text.splitlines()  # no GPU, no floor, no ratio
    assert "# Out of bounds values : 0 OK" in text
    timing = "# timing: blocking (-z 1)" if blocking else "# timing: back to back (-z 0)"
    assert text.count(timing) == len(kinds), text
    [path] = glob.glob(os.path.join(out_dir, "dfccl-bench-*.json"))
    assert path.endswith("-blocking.json") == blocking
    doc = json.load(open(path))
    assert doc["timing"]["blocking"] is blocking and doc["config"]["blocking"] is blocking
    assert doc["mode"] == mode and doc["backend"] == "sim" and doc["devices"] == [0, 1]
    assert doc["versions"]["dfccl"] == importlib.metadata.version("dfccl")
    assert doc["host"] and doc["date"] and len(doc["gpus"]) == 2
    assert doc["floor"] == {"status": "n/a (simulator)"}
    assert [r["kind"] for r in doc["rows"]] == [k for k in kinds for _ in SIZES]
    # all_gather / reduce_scatter sizes are whole per-rank buffers: the sweep's sizes survive for 2 ranks.
    assert [r["size"] for r in doc["rows"]] == SIZES * len(kinds)
    data_rows = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert len(data_rows) == len(doc["rows"])
    for row in doc["rows"]:
        for placement in ("out_of_place", "in_place"):
            assert row[placement]["wrong"] == 0, row
            assert row[placement]["time_us"] > 0 and row[placement]["busbw"] >= 0
            assert row[placement]["floor_ratio"] is None
            # Blocking: the median, with the 90th percentile beside it; back to back: one mean.
            if blocking:
                assert row[placement]["p90_us"] >= row[placement]["time_us"], row
            else:
                assert "p90_us" not in row[placement], row
        assert row["nccl"] is None and row["ratio"] is None
    pngs = glob.glob(os.path.join(out_dir, "dfccl-bench-*.png"))
    if importlib.util.find_spec("matplotlib") is not None:
        assert len(pngs) == 1 and open(pngs[0], "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    else:
        assert not pngs and "plot skipped" in text
    return doc


def test_bench_thread_mode(tmp_path):
    proc = dfccl_cmd("bench", "all", *SWEEP, "--devices", "0,1", "--out", str(tmp_path))
    check_bench_output(proc, tmp_path, "thread", list(bench.KINDS))


def test_bench_process_mode(tmp_path):
    proc = dfccl_cmd("bench", "-k", "all_reduce", *SWEEP, "--mode", "process", "--devices", "0,1",
                     "--out", str(tmp_path))
    doc = check_bench_output(proc, tmp_path, "process", ["all_reduce"])
    assert doc["dfccl"]["path"] == "staged"  # ranks in different processes: the direct path through the arenas


def test_bench_blocking_thread_mode(tmp_path):
    proc = dfccl_cmd("bench", "all", *SWEEP, "-z", "1", "--devices", "0,1", "--out", str(tmp_path))
    check_bench_output(proc, tmp_path, "thread", list(bench.KINDS), blocking=True)


def test_bench_blocking_process_mode(tmp_path):
    proc = dfccl_cmd("bench", "reduce_scatter", *SWEEP, "--blocking", "1", "--mode", "process", "--devices", "0,1",
                     "--out", str(tmp_path))
    check_bench_output(proc, tmp_path, "process", ["reduce_scatter"], blocking=True)


def test_blocking_timing_waits_for_every_collective(monkeypatch):
    """-z 1 waits after every submission and reports the median and p90 of
    the iterations; -z 0 submits back to back and waits once."""
    clock = types.SimpleNamespace(now=0.0)
    monkeypatch.setattr(harness, "time", types.SimpleNamespace(perf_counter=lambda: clock.now))
    log: list[str] = []
    durations = iter([0.0] * 2 + [1e-3 * i for i in range(1, 11)])  # 2 warm-up, then 1..10 ms

    def submit() -> None:
        log.append("submit")
        clock.now += next(durations)

    def finish() -> None:
        log.append("finish")

    timing = harness.measure(submit, finish, bench.BenchConfig(iters=10, warmup=2, blocking=True))
    assert log == ["submit", "finish"] * 12
    assert timing["time_us"] == pytest.approx(5500)  # median of 1..10 ms
    assert timing["p90_us"] == pytest.approx(9100)   # numpy's linear interpolation

    log.clear()
    durations = iter([1e-3] * 12)
    timing = harness.measure(submit, lambda: log.append("finish"), bench.BenchConfig(iters=10, warmup=2))
    assert log == ["submit"] * 2 + ["finish"] + ["submit"] * 10 + ["finish"]
    assert timing == {"time_us": pytest.approx(1000)}


def test_report_prints_markdown_tables(tmp_path):
    runs = {}
    for z in ("0", "1"):
        out = tmp_path / f"z{z}"
        proc = dfccl_cmd("bench", "all_reduce,broadcast", "--backend", "sim", "-b", "8", "-e", "4K", "-f", "8",
                         "-n", "3", "-w", "1", "-z", z, "--no-plot", "--no-progress", "--out", str(out))
        assert proc.returncode == 0, proc.stderr
        [runs[z]] = glob.glob(os.path.join(out, "dfccl-bench-*.json"))
    proc = dfccl_cmd("bench", "--report", runs["0"], runs["1"], timeout=60)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert text.count("## dfccl bench: 2 x simulated GPU, thread mode") == 2
    assert "back to back (-z 0)" in text and "blocking (-z 1)" in text
    assert text.count("### all_reduce") == 2 and text.count("### broadcast") == 2
    assert "NCCL: not available (no GPU/torch)" in text
    back_to_back, blocking = text.split("## dfccl bench:")[1:]
    for part, doc_path in ((back_to_back, runs["0"]), (blocking, runs["1"])):
        doc = json.load(open(doc_path))
        table_rows = [line for line in part.splitlines() if line.startswith("| ") and not line.startswith("| size")]
        assert len(table_rows) == len(doc["rows"]) == 2 * 4
        first = doc["rows"][0]
        cells = [c.strip() for c in table_rows[0].strip("|").split("|")]
        assert cells[:5] == ["8 B", "2", "float32", "sum", "-1"]
        assert cells[-1] == "0" and cells[-2] == "n/a"  # no wrong elements; no NCCL, no ratio
        assert cells[6] == "n/a" and "Floor: n/a (simulator)." in part.splitlines()  # no floor on the simulator
        if part is blocking:
            assert cells[5] == f"{first['out_of_place']['time_us']:.1f} ({first['out_of_place']['p90_us']:.1f})"
        else:
            assert cells[5] == f"{first['out_of_place']['time_us']:.1f}"


def test_bench_no_floor_is_recorded(tmp_path):
    proc = dfccl_cmd("bench", "broadcast", "--backend", "sim", "-b", "1K", "-e", "1K", "-n", "1", "-w", "0",
                     "--no-floor", "--no-plot", "--no-progress", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    [path] = glob.glob(os.path.join(tmp_path, "dfccl-bench-*.json"))
    doc = json.load(open(path))
    assert doc["config"]["floor"] is False and doc["floor"] == {"status": "n/a (simulator)"}
    assert "# floor: n/a (simulator)" in proc.stdout.splitlines()


def test_report_of_a_bad_file_is_one_line(tmp_path):
    not_json = tmp_path / "a.json"
    not_json.write_text("{not json")
    not_bench = tmp_path / "b.json"
    not_bench.write_text(json.dumps({"rows": []}))
    for path in (not_json, not_bench, tmp_path / "missing.json"):
        proc = dfccl_cmd("bench", "--report", str(path), timeout=60)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and str(path) in lines[0], proc.stderr
        assert proc.stdout == ""


def test_bench_unchecked_reports_na(tmp_path):
    proc = dfccl_cmd("bench", "broadcast", "--backend", "sim", "-b", "1K", "-e", "1K", "-n", "1", "-w", "0",
                     "-c", "0", "--no-plot", "--no-progress", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    [row] = [line for line in proc.stdout.splitlines() if line and not line.startswith("#")]
    assert row.split()[:5] == ["1024", "256", "float32", "none", "0"]
    assert "N/A" in row


@pytest.mark.parametrize("args", [
    ["demo", "--devices", "a"],
    ["demo", "--backend", "gpu"],
    ["bench", "--backend", "sim", "-b", "1X"],
    ["bench", "--backend", "sim", "nope"],
    ["bench", "--backend", "sim", "-c", "2"],
    ["bench", "--backend", "sim", "-z", "yes"],
    ["bench", "--backend", "sim", "-b", "1M", "-e", "1K"],
    ["bench", "--backend", "sim", "--devices", "0"],
    ["bench", "--backend", "sim", "--mode", "process", "--path", "direct"],
    ["bench", "--backend", "sim", "-d", "complex64"],
    ["nosuchcommand"],
])
def test_bad_arguments_are_one_line(args):
    proc = dfccl_cmd(*args, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr


def test_cuda_backend_without_gpu_is_one_line():
    from dfccl import runtime

    if runtime.cuda_device_count() > 0:
        pytest.skip("a GPU is visible")
    for args in (["bench", "--backend", "cuda"], ["demo", "--backend", "cuda"]):
        proc = dfccl_cmd(*args, timeout=60)
        assert proc.returncode == 2
        assert proc.stderr.strip().splitlines() == ["error: the cuda backend needs a visible GPU and the CUDA driver"]


def test_version_matches_metadata():
    proc = dfccl_cmd("--version", timeout=60)
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"dfccl {importlib.metadata.version('dfccl')}"
    import dfccl

    assert dfccl.__version__ == importlib.metadata.version("dfccl")


def test_info_without_traceback():
    proc = dfccl_cmd("info", timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    out = proc.stdout
    assert f"dfccl          {importlib.metadata.version('dfccl')}" in out
    assert "cuda-bindings" in out and "kernel image:" in out and "defaults (sim):" in out
    assert "daemon blocks per device: 2" in out


@pytest.mark.parametrize("args", [["info"], ["--version"], ["--help"], ["status"], ["bench", "--report", "R"]],
                         ids=lambda a: a[0])
def test_a_reader_that_stops_early_ends_the_command_quietly(tmp_path, args):
    # `dfccl info | head`: the reader is gone before the command writes.
    if args[0] == "bench":
        bench_doc = dfccl_cmd("bench", *SWEEP, "--no-nccl", "--no-plot", "--out", str(tmp_path))
        assert bench_doc.returncode == 0, bench_doc.stderr
        [path] = glob.glob(os.path.join(tmp_path, "dfccl-bench-*.json"))
        args = ["bench", "--report", path]
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run([sys.executable, "-m", "dfccl", *args], stdout=write_end, stderr=subprocess.PIPE,
                              text=True, timeout=120)
    finally:
        os.close(write_end)
    assert proc.stderr == "", proc.stderr
    # argparse's --help and --version drop what they cannot write and exit 0.
    assert proc.returncode == (0 if args[0].startswith("--") else 141)


# -- units -----------------------------------------------------------------------------------
def _plot_rows(kinds, nccl: bool) -> list[dict]:
    point = lambda s: {"time_us": 3.0 + s / 1e3, "busbw": s / 1e6, "wrong": 0}
    return [{"kind": k, "size": s, "out_of_place": point(s), "in_place": point(s), "nccl": point(s) if nccl else None}
            for k in kinds for s in (8, 4096, 1 << 20, 1 << 29)]


def test_plot_title_names_what_ran():
    args = dict(ranks=2, gpu="NVIDIA H200", mode="process", dtype="float32", blocking=False)
    assert bench.plot_title(_plot_rows(["all_reduce"], nccl=False), **args) == \
        "dfccl, 2 x NVIDIA H200 (process mode, float32, back to back)"
    some = _plot_rows(["all_reduce"], nccl=False)
    some[-1]["nccl"] = {"time_us": 9.0, "busbw": 1.0, "wrong": 0}   # NCCL ran for one size
    assert bench.plot_title(some, **dict(args, blocking=True)) == \
        "dfccl vs NCCL, 2 x NVIDIA H200 (process mode, float32, blocking: median of one collective waited for)"


@pytest.mark.parametrize("kinds", [["all_reduce"], list(bench.KINDS)], ids=["one", "all"])
def test_plot_title_clears_the_panels(kinds):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _plot_rows(kinds, nccl=True)
    title = bench.plot_title(rows, ranks=8, gpu="NVIDIA H200", mode="process", dtype="bfloat16", blocking=True)
    fig = report.plot_figure(plt, rows, title)
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        assert fig._suptitle.get_text() == title   # the figure's title (no public getter before 3.8)
        top = fig._suptitle.get_window_extent(renderer)
        assert fig.bbox.x0 <= top.x0 and top.x1 <= fig.bbox.x1 and top.y1 <= fig.bbox.y1
        boxes = [ax.get_tightbbox(renderer) for ax in fig.axes]
        assert not [ax.get_title() for ax, box in zip(fig.axes, boxes) if box.overlaps(top)]
        assert not [(i, j) for i in range(len(boxes)) for j in range(i) if boxes[i].overlaps(boxes[j])]
    finally:
        plt.close(fig)


def test_plot_written_with_the_floor(tmp_path):
    """The PNG ``dfccl bench`` writes when a floor was measured (the floor's
    line on every latency panel)."""
    pytest.importorskip("matplotlib")
    rows = _plot_rows(["all_reduce", "broadcast"], nccl=False)
    path = tmp_path / "bench.png"
    assert report.write_plot(str(path), rows, "dfccl, 2 x NVIDIA H200", floor_us=3.2)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_parse_and_format_size():
    assert [bench.parse_size(s) for s in ("8", "1K", "64k", "1M", "2G", "1MB", "1MiB", "1.5K")] == \
        [8, 1024, 65536, 1 << 20, 2 << 30, 1 << 20, 1 << 20, 1536]
    for bad in ("", "x", "1X", "0", "0.5"):
        with pytest.raises(ValueError):
            bench.parse_size(bad)
    assert [bench.format_size(n) for n in (8, 1024, 3 << 20, 1000)] == ["8", "1K", "3M", "1000"]


def test_bus_factors_follow_nccl_tests():
    assert bench.bus_factor("all_reduce", 4) == 1.5
    assert bench.bus_factor("all_gather", 4) == bench.bus_factor("reduce_scatter", 4) == 0.75
    assert bench.bus_factor("broadcast", 8) == bench.bus_factor("reduce", 8) == 1.0


def test_sweep_drops_sizes_that_round_alike():
    cfg = bench.BenchConfig(kinds=["all_gather"], min_bytes=1, max_bytes=64, step_factor=2, devices=[0, 1, 2, 3])
    cases = bench.case_sizes(cfg, "all_gather")
    # float32 on 4 ranks: below 16 bytes every size is one element per rank.
    assert [c.nbytes for c in cases] == [16, 32, 64]
    assert [c.count for c in cases] == [1, 2, 4]


@pytest.mark.parametrize("dtype", ["int8", "uint8", "int32", "uint64", "float16", "float32", "float64"])
@pytest.mark.parametrize("kind", bench.KINDS)
def test_poisoned_outputs_are_all_wrong(kind, dtype):
    """An output nobody writes must count every element wrong; the right
    answer none."""
    case = bench.Case.for_size(kind, 256, 2, dtype, "sum", 0)
    inputs = case.inputs(np.random.SeedSequence(7))
    assert all(np.any(x != 0) for x in inputs)
    want = case.expected(inputs, 0)
    _, recv = case.initial(inputs, 0, False, want)
    assert bench.count_wrong(recv, want, dtype, "sum", 2) == want.size
    assert bench.count_wrong(want.copy(), want, dtype, "sum", 2) == 0
    if kind == "all_gather":
        buf, _ = case.initial(inputs, 1, True, case.expected(inputs, 1))
        assert bench.count_wrong(buf, case.expected(inputs, 1), dtype, "sum", 2) == case.count  # rank 0's part


def test_inputs_are_the_same_in_every_process():
    case = bench.Case.for_size("all_reduce", 64, 2, "int32", "sum", 0)
    code = ("import numpy as np; from dfccl import bench; "
            "c = bench.Case.for_size('all_reduce', 64, 2, 'int32', 'sum', 0); "
            "print(c.inputs(bench.config.case_seed(5, 'all_reduce', c, 'oop'))[1].tolist())")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(other) == case.inputs(bench.config.case_seed(5, "all_reduce", case, "oop"))[1].tolist()


def test_submitter_waits_for_the_oldest_when_resources_run_out():
    """Back-to-back submissions beyond the daemon's slots or staging wait for
    the oldest pending collective instead of failing."""
    from dfccl.errors import ResourceError

    pending: list = []
    log: list[str] = []

    class FakeWork:
        def __init__(self, i: int):
            self.i = i

        def synchronize(self, timeout: float) -> None:
            log.append(f"wait {self.i}")
            pending.remove(self)

    class FakePlan:
        submitted = 0

        def __call__(self):
            if len(pending) >= 2:
                raise ResourceError("full")
            FakePlan.submitted += 1
            w = FakeWork(FakePlan.submitted)
            pending.append(w)
            return w

    sub = harness.Submitter([FakePlan()])
    for _ in range(4):
        sub.submit()
    assert log == ["wait 1", "wait 2"]
    sub.finish()
    assert log == ["wait 1", "wait 2", "wait 3", "wait 4"] and not pending

    # With nothing of ours pending, the error is real.
    pending.extend([FakeWork(-1), FakeWork(-2)])
    with pytest.raises(ResourceError):
        harness.Submitter([FakePlan()]).submit()


def test_kernel_resources_parses_cuobjdump(monkeypatch):
    """`dfccl info` reads registers, stack and shared memory of the daemon from
    ``cuobjdump -res-usage`` output (here, the output for an sm_90 image)."""
    import subprocess
    import types

    from dfccl import info

    out = ("Fatbin elf code:\n================\narch = sm_90\ncode version = [1,8]\n\nResource usage:\n"
           " Common:\n  GLOBAL:0\n Function dfccl_daemon:\n"
           "  REG:122 STACK:224 SHARED:1608 LOCAL:0 CONSTANT[2]:40 CONSTANT[0]:672 TEXTURE:0\n")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: types.SimpleNamespace(stdout=out))
    assert info._kernel_resources("cuobjdump", "daemon.fatbin") == {
        "sm_90": {"REG": 122, "STACK": 224, "SHARED": 1608, "LOCAL": 0}}
