"""GPU tests (marker ``gpu``) skip cleanly where no CUDA GPU is visible; the
``multigpu`` marker additionally needs two GPUs."""

import pytest


def _gpus() -> int:
    try:
        from dfccl import runtime
        return runtime.cuda_device_count()
    except Exception:
        return 0


def pytest_collection_modifyitems(config, items):
    n = _gpus()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (none visible)")
    skip_multi = pytest.mark.skip(reason=f"needs 2 CUDA GPUs ({n} visible)")
    for item in items:
        if "gpu" in item.keywords and n == 0:
            item.add_marker(skip_gpu)
        elif "multigpu" in item.keywords and n < 2:
            item.add_marker(skip_multi)
