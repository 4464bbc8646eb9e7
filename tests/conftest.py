"""GPU tests (marker ``gpu``) skip cleanly where no CUDA GPU is visible; the
``multigpu`` marker additionally needs two GPUs, and ``gpu_processes`` needs
ranks in separate processes to run side by side: two GPUs, or one GPU shared
by its processes through MPS (``DFCCL_TEST_MPS=1`` says an MPS server runs;
without it the GPU time-slices between the processes, milliseconds per
collective).  A test marked ``no_mps`` provokes a GPU fault: under MPS the
fault reaches every client of the GPU (the test process's own
communicators too), so it is skipped there.

Every process the tests start keeps its status files and status pages in
one directory of the session ($DFCCL_STATUS_DIR); at the end, none may be
left but the test process's own (removed when it exits).

The helpers the tests and benchmarks share (``dfccl_support``, in support/)
are not part of the installed package: they go on the path here, and on
that of every process the tests start."""

import os
import sys

import pytest

SUPPORT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support")
sys.path.insert(0, SUPPORT)
os.environ["PYTHONPATH"] = os.pathsep.join([SUPPORT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                       if p and p != SUPPORT])


def _gpus() -> int:
    try:
        from dfccl import runtime
        return runtime.cuda_device_count()
    except Exception:
        return 0


def _mps() -> bool:
    return os.environ.get("DFCCL_TEST_MPS", "") not in ("", "0")


def pytest_collection_modifyitems(config, items):
    n = _gpus()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (none visible)")
    skip_multi = pytest.mark.skip(reason=f"needs 2 CUDA GPUs ({n} visible)")
    skip_processes = pytest.mark.skip(reason=f"needs 2 CUDA GPUs or one under MPS (DFCCL_TEST_MPS=1); {n} visible")
    skip_under_mps = pytest.mark.skip(reason="provokes a GPU fault, which MPS delivers to every client (DFCCL_TEST_MPS=1)")
    for item in items:
        if "gpu" in item.keywords and n == 0:
            item.add_marker(skip_gpu)
        elif "multigpu" in item.keywords and n < 2:
            item.add_marker(skip_multi)
        elif "gpu_processes" in item.keywords and n < 2 and not _mps():
            item.add_marker(skip_processes)
        elif "no_mps" in item.keywords and _mps():
            item.add_marker(skip_under_mps)


@pytest.fixture(scope="session", autouse=True)
def status_files_left(tmp_path_factory):
    directory = tmp_path_factory.mktemp("status")
    before = os.environ.get("DFCCL_STATUS_DIR")
    os.environ["DFCCL_STATUS_DIR"] = str(directory)   # inherited by every process the tests start
    yield directory
    if before is None:
        os.environ.pop("DFCCL_STATUS_DIR", None)
    else:
        os.environ["DFCCL_STATUS_DIR"] = before
    from dfccl import liveness, status_page

    # Processes killed on purpose leave theirs: what dfccl removes of them
    # (the next process's monitor, `dfccl status`) must be all there is.
    liveness.collect_status(str(directory))
    status_page.sweep(str(directory))
    mine = (f"dfccl-status-{os.getuid()}-{os.getpid()}.", f"dfccl-rank-{os.getuid()}-{os.getpid()}-")
    left = sorted(n for n in os.listdir(directory) if not n.startswith(mine))
    assert not left, f"status files of processes that still run, or that dfccl cannot tell are gone: {left}"
