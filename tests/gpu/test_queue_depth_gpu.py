"""Any queue depth without ResourceError on a GPU (marker ``gpu``; design
decision 40): two ranks of one process on one device queue 1,000
all-reduces of 8 MiB on distinct tags and 1,000 on one tag, then 10,000 of
4 KiB each way, before any wait, on the ring (reserved minimum FIFOs) and
the direct path.  Two processes on one GPU: tests/sim/test_multiprocess.py
(test_deep_queues_two_processes_on_one_gpu)."""

from __future__ import annotations

import numpy as np
import pytest

import dfccl
from dfccl.bench import arrays

pytestmark = pytest.mark.gpu
TIMEOUT = 120


@pytest.mark.parametrize("path", ["ring", "direct"])
def test_deep_queues_two_ranks_on_one_gpu(path):
    # Both ranks' collectives on one daemon: 40,000 outstanding at most.
    comms = dfccl.Communicator.for_devices([0, 0], backend="cuda",
                                           options=dfccl.CommOptions(path=path, max_tags=16384),
                                           daemon_options=dfccl.DaemonOptions(max_outstanding=65536))
    try:
        for n, count in ((1000, 2 << 20), (10_000, 1024)):
            bufs = [[arrays.from_numpy("cuda", 0, np.full(count, r + 1 + i % 7, np.float32)) for i in range(2 * n)]
                    for r in range(2)]
            works = [c.all_reduce(bufs[r][i], tag=("deep", count, i) if i < n else ("deep", count))
                     for r, c in enumerate(comms) for i in range(2 * n)]
            if path == "ring" and count == 2 << 20:
                pool = comms[0]._endpoint.staging
                assert pool.free_blocks < pool.blocks - n // 2, "most tags loop through reserved FIFOs"
            for w in works:
                w.synchronize(timeout=TIMEOUT)
            for r in range(2):
                for i, b in enumerate(bufs[r]):
                    assert (arrays.to_numpy(b) == 3 + 2 * (i % 7)).all(), (path, count, r, i)
            del bufs, works
    finally:
        for c in comms:
            c.close()
