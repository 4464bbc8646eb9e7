"""Every constant and layout formula Python sees is the C headers' own: a
small C++ program compiled against cuda/include/dfccl prints the headers'
values, and each must equal dfccl._native.layout's (and the enums built on
it).  A constant added to the module without a line here fails the test."""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sysconfig

import pytest

from dfccl._native import layout
from dfccl.types import DataType, ReduceOp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
INCLUDE = os.path.join(ROOT, "cuda", "include")

# Python name -> the C expression it must equal.
CONSTANTS = {
    "STATUS_OK": "DFCCL_STATUS_OK", "STATUS_MISMATCH": "DFCCL_STATUS_MISMATCH",
    "STATUS_PEER_ABORTED": "DFCCL_STATUS_PEER_ABORTED", "STATUS_ABORTED": "DFCCL_STATUS_ABORTED",
    "STATUS_BAD_TASK": "DFCCL_STATUS_BAD_TASK", "STATUS_PEER_LOST": "DFCCL_STATUS_PEER_LOST",
    "NUM_KINDS": "DFCCL_NUM_KINDS", "NUM_DTYPES": "DFCCL_NUM_DTYPES", "NUM_OPS": "DFCCL_NUM_OPS",
    "NUM_PATHS": "DFCCL_NUM_PATHS",
    "ARENA_STATUS_BYTES": "DFCCL_ARENA_STATUS_BYTES", "RANK_LIVE": "DFCCL_RANK_LIVE",
    "RANK_ABORTED": "DFCCL_RANK_ABORTED", "RANK_CLOSED": "DFCCL_RANK_CLOSED", "RANK_FAILED": "DFCCL_RANK_FAILED",
    "KIND_ALL_REDUCE": "DFCCL_ALL_REDUCE", "KIND_ALL_GATHER": "DFCCL_ALL_GATHER",
    "KIND_REDUCE_SCATTER": "DFCCL_REDUCE_SCATTER", "KIND_BROADCAST": "DFCCL_BROADCAST", "KIND_REDUCE": "DFCCL_REDUCE",
    "KIND_SEND": "DFCCL_SEND", "KIND_RECV": "DFCCL_RECV", "KIND_ALL_TO_ALL": "DFCCL_ALL_TO_ALL",
    "PATH_DIRECT": "DFCCL_PATH_DIRECT", "PATH_RING": "DFCCL_PATH_RING",
    "TASK_ONE_SHOT": "DFCCL_TASK_ONE_SHOT", "TASK_STAGED": "DFCCL_TASK_STAGED", "TASK_LL": "DFCCL_TASK_LL",
    "TASK_SEND_REGISTERED": "DFCCL_TASK_SEND_REGISTERED",
    "MAX_CHANNELS": "DFCCL_MAX_CHANNELS", "MAX_RANKS": "DFCCL_MAX_RANKS", "PEER_CACHE": "DFCCL_PEER_CACHE",
    "RECORD_HEADER_BYTES": "DFCCL_RECORD_HEADER_BYTES", "RECORD_BYTES": "DFCCL_RECORD_BYTES",
    "OWNER_BUCKET_BYTES": "DFCCL_OWNER_BUCKET_BYTES",
    "FIFO_OFFSET_MASK": "DFCCL_FIFO_OFFSET_MASK", "FIFO_UNIT_SHIFT": "DFCCL_FIFO_UNIT_SHIFT",
    "FIFO_UNIT_BYTES": "DFCCL_FIFO_UNIT_BYTES", "FIFO_UNIT_MAX": "DFCCL_FIFO_UNIT_MAX",
    "FIFO_SLOTS_SHIFT": "DFCCL_FIFO_SLOTS_SHIFT", "FIFO_SLOTS_MAX": "DFCCL_FIFO_SLOTS_MAX",
    "CHAN_INSTANCE_OFFSET": "offsetof(dfccl_chan_state, instance)", "CHAN_STATE_BYTES": "sizeof(dfccl_chan_state)",
    "LINK_AHEAD_MAX": "DFCCL_LINK_AHEAD_MAX",
    "REG_SLOTS": "DFCCL_REG_SLOTS", "REG_SLOT_SHIFT": "DFCCL_REG_SLOT_SHIFT", "REG_BIT": "DFCCL_REG_BIT",
    "STAGE_ALIGN": "DFCCL_STAGE_ALIGN", "LL_HEADER_LINES": "DFCCL_LL_HEADER_LINES",
    "LL_LINE_BYTES": "DFCCL_LL_LINE_BYTES", "LL_LINE_PAYLOAD": "DFCCL_LL_LINE_PAYLOAD",
    "LL_MAX_RANKS": "DFCCL_LL_MAX_RANKS", "LL_DEFAULT_MAX_BYTES": "DFCCL_LL_DEFAULT_MAX_BYTES",
    **{f"DTYPE_{d.name}": f"DFCCL_{d.name}" for d in DataType},
    **{f"OP_{o.name}": f"DFCCL_{o.name}" for o in ReduceOp},
}

# Inputs for the formulas: capacities, rank counts, channel counts, LL sizes.
_CAPACITIES = (1, 7, 64, 8192)
_RANKS = (1, 2, 3, 8, 64)
_CHANNELS = (1, 5, 32)
_LL_BYTES = (0, 8, 16, 1000, 4096, 65536)


def _formula_cases():
    cases = {}
    for d in DataType:
        cases[f"dtype_size({d.name})"] = (layout.dtype_size(d), f"dfccl_dtype_size(DFCCL_{d.name})")
    for cap, n, ll in itertools.product(_CAPACITIES, _RANKS, _LL_BYTES):
        cases[f"ll_region_bytes({cap},{n},{ll})"] = (layout.ll_region_bytes(cap, n, ll),
                                                    f"dfccl_ll_region_bytes({cap}u, {n}u, {ll}ull)")
    for ll in _LL_BYTES:
        # The function through Python against the macro constant expressions use.
        cases[f"ll_area_bytes({ll})"] = (layout.ll_area_bytes(ll), f"DFCCL_LL_AREA_BYTES({ll}ull)")
    for n, c in itertools.product(_RANKS, _CHANNELS):
        cases[f"a2a_words({n},{c})"] = (layout.a2a_words(n, c), f"dfccl_a2a_words({n}u, {c}u)")
        cases[f"a2a_copy_offset({n},{c})"] = (layout.a2a_copy_offset(n, c), f"dfccl_a2a_copy_offset({n}u, {c}u)")
    for key, cap in ((0, 1), (12345, 64), (2**64 - 1, 8192)):
        cases[f"home_bucket({key},{cap})"] = (layout.home_bucket(key, cap), f"dfccl_home_bucket({key}ull, {cap}u)")
        cases[f"mix64({key})"] = (layout.mix64(key), f"dfccl_mix64({key}ull)")
    return cases


def _compiler() -> str | None:
    for cxx in ((sysconfig.get_config_var("CXX") or "").split()[:1] + ["c++", "g++", "clang++"]):
        if cxx and shutil.which(cxx):
            return cxx
    return None


@pytest.fixture(scope="module")
def header_values(tmp_path_factory) -> dict[str, int]:
    """What the headers say, for every expression the tests compare."""
    cxx = _compiler()
    if cxx is None:
        pytest.skip("no C++ compiler to read the headers with")
    exprs = dict(CONSTANTS)
    exprs.update({name: c for name, (_, c) in _formula_cases().items()})
    lines = "\n".join(f'  std::printf("%s=%llu\\n", "{name}", (unsigned long long)({expr}));'
                      for name, expr in exprs.items())
    src = ("#include <cstddef>\n#include <cstdio>\n#include \"dfccl/abi.h\"\n#include \"dfccl/hash.h\"\n"
           f"#include \"dfccl/layout.h\"\nint main() {{\n{lines}\n  return 0;\n}}\n")
    work = tmp_path_factory.mktemp("layout")
    (work / "probe.cpp").write_text(src)
    exe = work / "probe"
    subprocess.run([cxx, "-std=c++17", "-I", INCLUDE, str(work / "probe.cpp"), "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    return {k: int(v) for k, v in (line.split("=", 1) for line in out.splitlines())}


def test_every_constant_has_a_header_counterpart():
    public = {name for name, value in vars(layout).items()
              if name.isupper() and not name.startswith("_") and isinstance(value, int)}
    assert public == set(CONSTANTS), (f"without a C expression here: {sorted(public - set(CONSTANTS))}; "
                                      f"gone from the module: {sorted(set(CONSTANTS) - public)}")


def test_constants_equal_the_headers(header_values):
    wrong = {name: (getattr(layout, name), header_values[name]) for name in CONSTANTS
             if getattr(layout, name) != header_values[name]}
    assert not wrong, f"Python vs header: {wrong}"


def test_formulas_equal_the_headers(header_values):
    wrong = {name: (py, header_values[name]) for name, (py, _) in _formula_cases().items()
             if py != header_values[name]}
    assert not wrong, f"Python vs header: {wrong}"


def test_enums_and_item_sizes_are_the_headers(header_values):
    for d in DataType:
        assert int(d) == header_values[f"DTYPE_{d.name}"]
        assert d.itemsize == header_values[f"dtype_size({d.name})"]
    for o in ReduceOp:
        assert int(o) == header_values[f"OP_{o.name}"]
    assert len(DataType) == header_values["NUM_DTYPES"] and len(ReduceOp) == header_values["NUM_OPS"]
