"""Tools for dfccl's tests, benchmarks and demo, installed with the package
but not part of its API: ``scenarios`` (random collectives, inputs,
references, tolerances, drivers of rank-divergent orders), ``arrays`` (buffers
on the simulator or a GPU without torch or CuPy) and ``nccl_reference`` (the
same scenarios run through NCCL, to show where it hangs) and ``profile`` (the
daemon's block profile between two readings)."""

__all__ = ["arrays", "scenarios", "nccl_reference", "profile"]
