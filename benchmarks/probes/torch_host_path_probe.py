"""Host time of a torch all_reduce as DDP's reducer issues it
(``pg.allreduce([t])`` then ``get_future()``), one process (world size 1):
dfccl's compiled backend, dfccl's Python backend and torch's own backend
(gloo on CPU, NCCL on GPU).  Medians of 2,000 calls in microseconds; each
call's collective is waited for outside the timed region.

    python benchmarks/torch_host_path_probe.py            # CPU: gloo vs dfccl (simulator)
    python benchmarks/torch_host_path_probe.py --cuda     # GPU 0: NCCL vs dfccl
    python benchmarks/torch_host_path_probe.py --captured # and dfccl's calls under graph capture

With ``--captured`` (CPU only), dfccl's ``pg.allreduce([t])`` is also timed
while a simulated stream captures (``dfccl.torch.cpu_stream``,
``SimStream.begin_capture``: the simulator's ``torch.cuda.graph``), in
graphs of 32 calls each destroyed before the next (a captured collective
holds a completion slot until then); for the compiled backend, so is its
Python side's ``allreduce`` under capture (what the compiled backend handed
a captured call to before it captured through the C API).

Each backend runs in its own process (dfccl.torch picks its implementation
on import, DFCCL_TORCH_IMPL).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import statistics
import subprocess
import sys
import time

ELEMENTS = 1 << 16
CAPTURED_PER_GRAPH = 32


def _captured_rows(pg, t, n: int) -> dict[str, float]:
    """Median host time of a dfccl all-reduce issued while a simulated
    stream captures, through the backend and (compiled) its Python side."""
    import dfccl.torch as dt
    from dfccl import runtime

    comm = dt.communicator()
    stream = runtime.get_device("sim", comm.device).create_stream()
    backend = dt.backend_of(None, "cpu")

    def median_us(call) -> float:
        out: list[float] = []
        with dt.cpu_stream(stream):
            while len(out) < n + 100:
                stream.begin_capture()
                try:
                    for _ in range(CAPTURED_PER_GRAPH):
                        s = time.perf_counter()
                        w = call()
                        e = time.perf_counter()
                        w.wait()                 # a captured stream wait, outside the timed region
                        out.append(e - s)
                finally:
                    graph = stream.end_capture()
                graph.close()
                comm._daemon.captured            # gives back what the graph's collectives held
        return statistics.median(out[100:]) * 1e6

    rows = {"pg.allreduce under capture": median_us(lambda: pg.allreduce([t]))}
    if not isinstance(backend, dt.ProcessGroupDfccl):
        side = backend.group
        rows["its Python side's allreduce under capture"] = median_us(lambda: side.allreduce([t]))
    stream.close()
    return rows


def _measure(backend: str, cuda: bool, n: int, captured: bool = False) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    if backend == "dfccl":
        import dfccl.torch  # noqa: F401  (registers the backend)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    pg = dist.group.WORLD
    t = torch.randn(ELEMENTS, device=device)

    def median_us(call) -> float:
        out = []
        for i in range(n + 100):
            s = time.perf_counter()
            w = call()
            e = time.perf_counter()
            (w.wait() if hasattr(w, "wait") else None)
            if i >= 100:
                out.append(e - s)
        if cuda:
            torch.cuda.synchronize()
        return statistics.median(out) * 1e6

    def reducer_call():
        w = pg.allreduce([t])
        w.get_future()
        return w

    rows = {
        "pg.allreduce": median_us(lambda: pg.allreduce([t])),
        "pg.allreduce + get_future (DDP's reducer)": median_us(reducer_call),
        "dist.all_reduce(async_op=True)": median_us(lambda: dist.all_reduce(t, async_op=True)),
    }
    if captured and backend == "dfccl" and not cuda:
        rows.update(_captured_rows(pg, t, n))
    dist.destroy_process_group()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cuda", action="store_true", help="CUDA tensors on GPU 0 (NCCL as the reference)")
    ap.add_argument("-n", type=int, default=2000, help="calls per row")
    ap.add_argument("--captured", action="store_true", help="also dfccl's calls under graph capture (CPU only)")
    ap.add_argument("--one", help=argparse.SUPPRESS)   # internal: measure one configuration, print JSON
    args = ap.parse_args()
    if args.one:
        faulthandler.dump_traceback_later(600, exit=True)   # a hang prints where it stopped
        backend = args.one.split(":")[0]
        print(json.dumps(_measure(backend, args.cuda, args.n, args.captured)))
        return
    reference = "nccl" if args.cuda else "gloo"
    configs = {reference: (reference, {}),
               "dfccl compiled": ("dfccl", {"DFCCL_TORCH_IMPL": "compiled"}),
               "dfccl Python": ("dfccl", {"DFCCL_TORCH_IMPL": "python"})}
    results = {}
    for name, (backend, env) in configs.items():
        cmd = [sys.executable, __file__, "--one", backend, "-n", str(args.n)] + (["--cuda"] if args.cuda else []) \
            + (["--captured"] if args.captured else [])
        env = dict(os.environ, DFCCL_TORCH_BACKEND="cuda" if args.cuda else "sim", **env)
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
        if out.returncode != 0:
            raise SystemExit(f"{name} failed:\n{out.stdout}{out.stderr}")
        results[name] = json.loads(out.stdout.strip().splitlines()[-1])
    names = list(results)
    rows = list(dict.fromkeys(row for n in names for row in results[n]))
    print(f"{'host time, median us':>44}" + "".join(f"{n:>16}" for n in names))
    for row in rows:
        print(f"{row:>44}" + "".join(f"{results[n][row]:16.1f}" if row in results[n] else f"{'-':>16}"
                                      for n in names), flush=True)


if __name__ == "__main__":
    main()
