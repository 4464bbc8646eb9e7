"""What dfccl's tests and benchmarks share, outside the installed package:
``scenarios`` (dfccl.scenarios and the tests' helpers around it),
``nccl_reference`` (the scenarios run through NCCL, to show where it hangs),
``forking`` (a forked child's outcome), ``profile`` (the daemon's block
profile between two readings) and ``cuda_graphs`` (CUDA streams and graphs
through cuda-python, for collectives captured in graphs).
tests/conftest.py and the benchmark scripts put support/ on the path."""

__all__ = ["scenarios", "nccl_reference", "forking", "profile", "cuda_graphs"]
