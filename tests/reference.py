"""numpy references with dfccl's semantics (shared with the demo and the
benchmarks: dfccl.testing.scenarios)."""

from dfccl.testing.scenarios import DTYPES, KINDS, OPS, assert_close, random_input, tolerance
from dfccl.testing.scenarios import reduce_reference as reduce

__all__ = ["DTYPES", "KINDS", "OPS", "assert_close", "random_input", "reduce", "tolerance"]
