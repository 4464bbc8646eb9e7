"""numpy references with dfccl's semantics (shared with the demo and the
benchmarks: dfccl.scenarios)."""

from dfccl.scenarios import DTYPES, KINDS, OPS, assert_close, random_input, tolerance
from dfccl.scenarios import reduce_reference as reduce

__all__ = ["DTYPES", "KINDS", "OPS", "assert_close", "random_input", "reduce", "tolerance"]
