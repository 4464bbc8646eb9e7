"""Running the examples/ scripts as a user would (torchrun, or plain python),
for the example tests on the simulator and on GPUs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

__all__ = ["EXAMPLES", "run_example", "losses"]

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run_example(script: str, *args: str, nproc: int = 2, env: dict | None = None,
                timeout: float = 300) -> subprocess.CompletedProcess:
    """Runs examples/``script`` with ``args``: under torchrun with ``nproc``
    processes on this host, or with python when ``nproc`` is 0.  stdout and
    stderr come back together in ``.stdout``."""
    cmd = [sys.executable]
    if nproc:
        cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd += [str(EXAMPLES / script), *args]
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env,
                          timeout=timeout, cwd=EXAMPLES.parent)


def losses(output: str) -> list[float]:
    """The per-step losses rank 0 printed ("[backend] step N ... loss X")."""
    return [float(m.group(1)) for m in re.finditer(r"^\[\w+\] step +\d+ .* loss (\S+)$", output, re.M)]
