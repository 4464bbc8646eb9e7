"""The hardware floor in ``dfccl bench``'s output: which floor a row is
compared with, the ratio, the line above the table, the JSON form, the text
row and the Markdown report, with and without a floor.  No GPU: the floor
documents here are written by hand (tests/gpu/test_bench_floor_gpu.py
measures a real one)."""

from __future__ import annotations

import json

import pytest

from dfccl import bench
from dfccl.bench import report
from dfccl.bench.floor import (FLOOR_SIMULATOR, FLOOR_SKIPPED, DoorbellTiming, Floor, floor_doc, floor_for_timing,
                               floor_ratio, format_floor_line, format_ratio, measure_floor)

HOST = DoorbellTiming(median_us=2.5, min_us=2.25, max_us=3.0, reps_us=(2.5, 2.25, 3.0, 2.5, 2.75), answered=5100,
                      kernel_exit="stopped")
STREAM = DoorbellTiming(median_us=4.0, min_us=3.5, max_us=4.5, reps_us=(4.0, 3.5, 4.5, 4.0, 4.25), answered=5100,
                        kernel_exit="stopped", enqueue_us=1.75)
MEASURED = floor_doc(Floor(device=3, iters=1000, reps=5, host=HOST, stream=STREAM))


def test_floor_doc_is_json_with_both_doorbells():
    doc = json.loads(json.dumps(MEASURED))
    assert doc["status"] == "measured" and doc["device"] == 3 and doc["iters"] == 1000 and doc["reps"] == 5
    assert doc["host_doorbell"] == {"median_us": 2.5, "min_us": 2.25, "max_us": 3.0,
                                    "reps_us": [2.5, 2.25, 3.0, 2.5, 2.75], "answered": 5100,
                                    "kernel_exit": "stopped"}
    assert doc["stream_doorbell"]["enqueue_us"] == 1.75 and doc["stream_doorbell"]["median_us"] == 4.0


def test_each_timing_has_its_floor():
    assert floor_for_timing(MEASURED, blocking=True) == 2.5    # one collective waited for: host doorbell
    assert floor_for_timing(MEASURED, blocking=False) == 4.0   # back to back: stream doorbell
    for doc in (None, {}, {"status": FLOOR_SIMULATOR}, {"status": FLOOR_SKIPPED}, {"status": "failed (x)"}):
        assert floor_for_timing(doc, True) is None and floor_for_timing(doc, False) is None


def test_ratio_arithmetic():
    assert floor_ratio(10.0, 4.0) == 2.5
    assert floor_ratio(3.0, 4.0) == 0.75
    assert floor_ratio(10.0, None) is None
    assert floor_ratio(10.0, 0.0) is None
    assert [format_ratio(r) for r in (2.5, 0.754, 99.994, 1234.4, None)] == ["2.50", "0.75", "99.99", "1234", "n/a"]


def test_floor_line():
    assert format_floor_line(MEASURED) == ("floor on cuda:3 (resident kernel): host doorbell 2.50 us (2.25-3.00), "
                                           "stream doorbell 4.00 us (3.50-4.50); median (min-max) of 5 x 1000")
    assert format_floor_line({"status": FLOOR_SIMULATOR}) == "floor: n/a (simulator)"
    assert format_floor_line({"status": FLOOR_SKIPPED}) == "floor: skipped (--no-floor)"
    assert format_floor_line(None) == "floor: not measured"


def test_measure_floor_rejects_empty_runs():
    with pytest.raises(ValueError):
        measure_floor(0, iters=0)
    with pytest.raises(ValueError):
        measure_floor(0, reps=0)


def _row(floor_us: float | None) -> dict:
    case = bench.Case.for_size("all_reduce", 1024, 2, "float32", "sum", 0)
    measured = {"oop": {"time_us": 12.0, "wrong": 0}, "ip": {"time_us": 8.0, "wrong": 0}}
    return report.finish_row("all_reduce", case, measured, floor_us)


def test_rows_carry_the_ratio_to_their_floor():
    row = _row(4.0)
    assert row["out_of_place"]["floor_ratio"] == 3.0 and row["in_place"]["floor_ratio"] == 2.0
    assert row["nccl"] is None  # the ratio is dfccl's alone
    fields = bench.format_row(row).split()
    # size count type redop root | time /floor algbw busbw #wrong | the same in place | NCCL
    assert fields[5:7] == ["12.00", "3.00"] and fields[10:12] == ["8.00", "2.00"]
    bare = _row(None)
    assert bare["out_of_place"]["floor_ratio"] is None and bare["in_place"]["floor_ratio"] is None
    fields = bench.format_row(bare).split()
    assert fields[5:7] == ["12.00", "n/a"] and fields[10:12] == ["8.00", "n/a"]


def test_header_names_the_ratio_column():
    header = bench.format_table_header("all_reduce", "NCCL: disabled (--no-nccl)", bench.timing_line(False, 20))
    columns = header.splitlines()[-2].split()
    assert columns.count("/floor") == 2 and columns.index("/floor") == columns.index("time") + 1
    assert "/floor = time / stream doorbell floor" in header
    assert "/floor = time / host doorbell floor" in bench.timing_line(True, 20)


def _doc(floor: dict | None, blocking: bool) -> dict:
    doc = {"config": {"dtype": "float32", "op": "sum", "iters": 20, "warmup": 5}, "mode": "thread",
           "gpus": ["NVIDIA H200", "NVIDIA H200"], "timing": {"blocking": blocking},
           "rows": [_row(floor_for_timing(floor, blocking))]}
    if floor is not None:
        doc["floor"] = floor
    return doc


def _cells(markdown: str) -> list[str]:
    [line] = [ln for ln in markdown.splitlines() if ln.startswith("| 1 KiB")]
    return [c.strip() for c in line.strip("|").split("|")]


@pytest.mark.parametrize("blocking", [False, True])
def test_report_with_a_floor(blocking):
    text = bench.format_markdown(_doc(MEASURED, blocking))
    assert "Floor on cuda:3 (resident kernel): host doorbell 2.50 us (2.25-3.00), stream doorbell 4.00 us" in text
    which = "host" if blocking else "stream"
    assert f"/ floor: dfccl's time over the {which} doorbell floor" in text
    floor_us = 2.5 if blocking else 4.0
    cells = _cells(text)
    # size count type redop root | out of place, / floor, busbw | in place, / floor, busbw | NCCL ...
    assert cells[5:7] == ["12.0", f"{12.0 / floor_us:.2f}"] and cells[8:10] == ["8.0", f"{8.0 / floor_us:.2f}"]


def test_report_without_a_floor():
    older = _doc(None, False)  # a result from before the floor: no field, no ratio in its rows
    for form in ("out_of_place", "in_place"):
        del older["rows"][0][form]["floor_ratio"]
    for doc, line in ((older, "Floor: not measured."), (_doc(None, False), "Floor: not measured."),
                      (_doc({"status": FLOOR_SIMULATOR}, False), "Floor: n/a (simulator).")):
        text = bench.format_markdown(doc)
        assert line in text.splitlines()
        cells = _cells(text)
        assert cells[5:7] == ["12.0", "n/a"] and cells[8:10] == ["8.0", "n/a"]
