"""README.md's Python examples run as written on the simulator: the
in-process one as a script, the one-process-per-GPU one as ``train.py``
under ``python -m dfccl.launch --backend sim``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import dfccl

README = Path(__file__).resolve().parents[2] / "README.md"
TIMEOUT = 240


def _python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def _env() -> dict:
    package_root = os.path.dirname(os.path.dirname(dfccl.__file__))
    return dict(os.environ, PYTHONPATH=package_root, CUDA_VISIBLE_DEVICES="")


def test_readme_has_the_examples():
    blocks = _python_blocks()
    assert len(blocks) == 2 and sum("init_from_env" in b for b in blocks) == 1


@pytest.mark.parametrize("index", range(len(_python_blocks())))
def test_readme_example_runs(tmp_path, index):
    block = _python_blocks()[index]
    script = tmp_path / "train.py"
    script.write_text(block)
    if "init_from_env" in block:
        # As the README starts it, on simulated GPUs.
        command = [sys.executable, "-m", "dfccl.launch", "-n", "4", "--backend", "sim", str(script)]
    else:
        command = [sys.executable, str(script)]
    r = subprocess.run(command, capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=TIMEOUT)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
