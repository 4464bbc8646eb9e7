"""Host time of the pieces of a torch all_reduce over dfccl, one process
(world size 1) on GPU 0: torch's stream lookup, the tensor's dfccl view,
dfccl's own submit and stream wait, the torch Work and future, and the
whole calls (``pg.allreduce``, ``get_future``, ``dist.all_reduce``).
Medians of 2,000 calls in microseconds.  Compare with
``ddp_step_probe.py nccl``'s and NCCL's ``dist.all_reduce``.

    python benchmarks/torch_host_path_probe.py
"""

from __future__ import annotations

import faulthandler
import statistics
import time

import torch
import torch.distributed as dist

import dfccl.torch as dt


def median_us(fn, n: int = 2000) -> float:
    for _ in range(100):
        fn()
    out = []
    for _ in range(n):
        s = time.perf_counter()
        fn()
        out.append(time.perf_counter() - s)
    torch.cuda.synchronize()
    return statistics.median(out) * 1e6


def main() -> None:
    faulthandler.dump_traceback_later(300, exit=True)   # a hang prints where it stopped
    if not torch.cuda.is_available():
        raise SystemExit("needs a GPU visible to torch")
    torch.cuda.set_device(0)
    dist.init_process_group("dfccl", store=dist.HashStore(), rank=0, world_size=1)
    pg = dist.group.WORLD
    comm = pg.communicator()
    t = torch.randn(1 << 18, device="cuda")
    stream = torch.cuda.current_stream()
    buf = dt._buffer(t, "probe")

    def cuda_future():
        f = torch.futures.Future(devices=[torch.device("cuda", 0)])
        f.set_result([t])

    def fresh(fn, n: int = 1500) -> float:
        """fn(w) for a fresh pg.allreduce work w, made outside the timer."""
        out = []
        for i in range(n + 50):
            w = pg.allreduce([t])
            s = time.perf_counter()
            fn(w)
            e = time.perf_counter()
            if i >= 50:
                out.append(e - s)
        torch.cuda.synchronize()
        return statistics.median(out) * 1e6

    rows = {
        "torch.cuda.current_stream": median_us(lambda: torch.cuda.current_stream(0)),
        "dfccl view of the tensor (_buffer)": median_us(lambda: dt._buffer(t, "probe")),
        "Communicator.all_reduce(stream)": median_us(lambda: comm.all_reduce(buf, stream=stream)),
        "  + Work.wait(stream)": median_us(lambda: comm.all_reduce(buf, stream=stream).wait(stream)),
        "DfcclWork()": median_us(lambda: dt.DfcclWork([], [t], cuda=True, device=0)),
        "CUDA Future + set_result": median_us(cuda_future),
        "pg.allreduce": median_us(lambda: pg.allreduce([t])),
        "pg.allreduce + get_future": median_us(lambda: pg.allreduce([t]).get_future()),
        "dist.all_reduce(async_op) + get_future": median_us(lambda: dist.all_reduce(t, async_op=True).get_future()),
        "get_future of a fresh work": fresh(lambda w: w.get_future()),
        "wait() of a fresh work": fresh(lambda w: w.wait()),
    }
    for name, us in rows.items():
        print(f"{name:>42}: {us:7.1f} us", flush=True)
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    main()
