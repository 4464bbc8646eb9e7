"""The examples/ scripts on GPUs, run as a user runs them (torchrun, one
process per rank).  The DDP example's loss curve over dfccl matches NCCL's
(two GPUs) or gloo's (one GPU shared through MPS: NCCL refuses two ranks on
one GPU); the pipeline checks itself against a one-process run; the
divergent-order example finishes under dfccl and, on two GPUs, hangs under
NCCL until its timeout reports it; the CuPy example runs in one process.

FSDP2 runs on two GPUs only: with two processes on one GPU its side streams
waiting for collectives hold every hardware queue the processes share
(docs/torch.md, "Known problems")."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from example_runs import losses, run_example  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]
processes = pytest.mark.gpu_processes


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _reference() -> str:
    return "nccl" if _gpus() >= 2 else "gloo"


def _ok(script: str, *args: str, nproc: int = 2, timeout: float = 300) -> str:
    r = run_example(script, *args, nproc=nproc, timeout=timeout)
    assert r.returncode == 0, r.stdout[-4000:]
    return r.stdout


@processes
@pytest.mark.parametrize("hook", [False, True])
def test_ddp_example_matches_the_reference(hook):
    steps = "30"
    want = losses(_ok("ddp_train.py", "--backend", _reference(), "--steps", steps))
    got = losses(_ok("ddp_train.py", "--backend", "dfccl", "--steps", steps, *(["--hook"] if hook else [])))
    assert len(want) == len(got) == int(steps)
    # Two ranks: a gradient is a + b in either order, the same bits; the
    # tolerance leaves room for kernels that differ run to run.
    assert got == pytest.approx(want, rel=1e-4)


@processes
def test_pipeline_example_matches_one_process():
    out = _ok("pipeline_send_recv.py", "--backend", "dfccl", "--steps", "3")
    assert out.count("parameters match the single-process run") == 2, out[-2000:]


@processes
def test_divergent_groups_example_finishes_under_dfccl():
    out = _ok("divergent_groups.py", "--backend", "dfccl", "--rounds", "10")
    assert "rounds of divergent-order collectives on 2 ranks finished" in out, out[-2000:]


@pytest.mark.multigpu
def test_divergent_groups_example_hangs_under_nccl():
    r = run_example("divergent_groups.py", "--backend", "nccl", "--rounds", "3", "--timeout", "15", timeout=240)
    assert r.returncode != 0 and "deadlocked under nccl" in r.stdout, r.stdout[-2000:]


@pytest.mark.multigpu
def test_fsdp2_example_trains():
    got = losses(_ok("fsdp2_train.py", "--backend", "dfccl", "--steps", "6"))
    assert len(got) == 6 and all(math.isfinite(x) for x in got) and got[-1] < got[0]


def test_cupy_example():
    pytest.importorskip("cupy")
    out = _ok("cupy_allreduce.py", nproc=0, timeout=120)
    assert "cuda [0, " in out and "both orders completed" in out, out[-2000:]
