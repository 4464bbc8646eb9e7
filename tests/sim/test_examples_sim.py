"""The examples/ scripts, run as a user runs them (torchrun, two processes)
on CPU tensors: dfccl on its simulator against gloo.  Same seed, same loss
curve; the pipeline checks itself against a one-process run; the
divergent-order example finishes."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("torch")

from example_runs import losses, run_example  # noqa: E402

pytestmark = pytest.mark.timeout(600)

CPU = {"CUDA_VISIBLE_DEVICES": ""}   # the simulator even where a GPU is visible


def _ok(script: str, *args: str) -> str:
    r = run_example(script, *args, env=CPU)
    assert r.returncode == 0, r.stdout[-4000:]
    return r.stdout


@pytest.mark.parametrize("hook", [False, True])
def test_ddp_example_matches_gloo(hook):
    want = losses(_ok("ddp_train.py", "--backend", "gloo", "--steps", "6"))
    got = losses(_ok("ddp_train.py", "--backend", "dfccl", "--steps", "6", *(["--hook"] if hook else [])))
    assert len(want) == len(got) == 6
    # Two ranks: each gradient is a + b in either order, the same bits.
    assert got == pytest.approx(want, rel=1e-6, abs=1e-7)


def test_fsdp2_example_trains_and_matches_gloo():
    want = losses(_ok("fsdp2_train.py", "--backend", "gloo", "--steps", "4"))
    got = losses(_ok("fsdp2_train.py", "--backend", "dfccl", "--steps", "4"))
    assert len(got) == 4 and all(math.isfinite(x) for x in got) and got[-1] < got[0]
    assert got == pytest.approx(want, rel=1e-5)


def test_pipeline_example_matches_one_process():
    out = _ok("pipeline_send_recv.py", "--backend", "dfccl", "--steps", "3")
    assert out.count("parameters match the single-process run") == 2, out[-2000:]


def test_divergent_groups_example_finishes():
    out = _ok("divergent_groups.py", "--backend", "dfccl", "--rounds", "5")
    assert "rounds of divergent-order collectives on 2 ranks finished" in out, out[-2000:]


def test_cupy_example_on_the_simulator():
    r = run_example("cupy_allreduce.py", nproc=0, env=CPU)
    assert r.returncode == 0, r.stdout[-2000:]
    assert "sim [0, 1]: both orders completed" in r.stdout
