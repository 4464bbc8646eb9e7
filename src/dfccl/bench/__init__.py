"""``dfccl bench``: collective speed against NCCL, following nccl-tests.

For every collective and size: one run on fresh random inputs with poisoned
outputs, checked element by element against numpy (``#wrong``); then
``warmup`` runs, then the timed runs.  Out of place and in place, then NCCL on
the same GPUs in the same invocation.  Two timings, as nccl-tests' ``-z``:

- back to back (``blocking=False``, ``-z 0``): ``iters`` submissions timed on
  the host around the loop and the final synchronisation, divided by
  ``iters`` (throughput of a stream of collectives);
- blocking (``blocking=True``, ``-z 1``): every iteration submits on every
  rank and waits for completion on every rank; the median over ``iters``
  (and the 90th percentile, in the JSON) of one collective waited for (what a
  step that synchronises after each collective sees).

- size: bytes of the buffer (all_gather: the gathered output; reduce_scatter:
  the scattered input), as in nccl-tests; count: elements of that buffer;
- algbw = size / time (GB/s, 1e9 bytes); busbw = algbw x 2(n-1)/n for
  all_reduce, x (n-1)/n for all_gather and reduce_scatter, x 1 for broadcast
  and reduce;
- ``--mode thread``: this process drives every GPU (Communicator.for_devices);
  NCCL runs one Python thread per GPU, each with its own communicator
  (ncclCommInitRank through CuPy);
- ``--mode process``: one worker process per GPU (multiprocessing spawn),
  sharing a dfccl UniqueId; NCCL through torch.distributed in the same
  workers.  Each rank times its own loop between two barriers; the reported
  time is the maximum over ranks.

NCCL is timed in place, the one form torch.distributed offers for all five
collectives; ``ratio`` = NCCL time / dfccl in-place time (above 1: dfccl
faster).

Before the table, on the first device of the run, the hardware floor
(dfccl.bench.floor: a resident kernel answering a doorbell, without dfccl);
every dfccl time is also given over it (``/floor``): the host doorbell for
``-z 1``, the stream doorbell for back to back.

The parts: ``config`` (what runs), ``harness`` (memory and the timed
loops), ``baselines`` (NCCL through CuPy and torch), ``floor`` (the hardware
floor), ``report`` (table, JSON, Markdown, plot), ``runner`` (the run), and
``arrays`` (device buffers without torch or CuPy).
"""

from dfccl.bench.config import (DTYPES, KINDS, OPS, BenchConfig, Case, bus_factor, case_sizes, count_wrong,
                                format_size, parse_size)
from dfccl.bench.report import (ReportError, format_markdown, format_row, format_table_header, plot_title,
                                timing_line)
from dfccl.bench.runner import WorkerError, run_bench

__all__ = ["KINDS", "OPS", "DTYPES", "BenchConfig", "Case", "ReportError", "WorkerError", "parse_size", "format_size",
           "bus_factor", "count_wrong", "case_sizes", "run_bench", "format_table_header", "format_row",
           "format_markdown", "timing_line", "plot_title"]
