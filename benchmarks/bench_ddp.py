"""The DDP example's step time and loss curve over dfccl against a reference
backend, one process per rank (torchrun), same seed.

    python benchmarks/bench_ddp.py [--iters 200] [--reference nccl|gloo] [--hook]

The reference is NCCL where every rank has its own GPU, gloo where ranks share
one (NCCL refuses two ranks on one GPU; two processes on one GPU need MPS to
run side by side).  Reports the median step time after ``--warmup`` steps and
dfccl's ratio to the reference (the DDP target is at most 1.03), and the
largest relative difference between the two loss curves.  Backends alternate
``--rounds`` times so that a drift of the machine shows in both.  ``--iters``
is the number of steps.  Flags and the record (one JSON line appended to
<out>/ddp.jsonl) are the suite's (support/dfccl_support/suite.py).
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
EXAMPLE = HERE.parent / "examples" / "ddp_train.py"
# The benchmarks' shared helpers (dfccl_support) live in support/, beside the package.
sys.path.insert(0, str(HERE.parent / "support"))

from dfccl_support import suite  # noqa: E402
STEP = re.compile(r"^\[(\w+)\] step +(\d+) +([\d.]+) ms +loss (\S+)$", re.M)


def run(backend: str, args) -> tuple[list[float], list[float]]:
    """(step times in ms, losses) of one torchrun of the example."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           str(EXAMPLE), "--backend", backend, "--steps", str(args.iters)]
    if args.hook and backend == "dfccl":
        cmd.append("--hook")
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=args.timeout,
                       env=dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1"))
    rows = STEP.findall(r.stdout)
    if r.returncode != 0 and len(rows) == args.iters and backend != "dfccl":
        # The reference's own exit failed after every step ran (gloo can abort
        # in its teardown): its figures are whole; say so rather than drop them.
        print(f"warning: reference {backend} exited {r.returncode} after all {args.iters} steps", file=sys.stderr)
    elif r.returncode != 0 or len(rows) != args.iters:
        raise SystemExit(f"{backend}: exit {r.returncode}, {len(rows)} of {args.iters} steps\n{r.stdout[-3000:]}")
    return [float(ms) for _, _, ms, _ in rows], [float(loss) for _, _, _, loss in rows]


def main() -> None:
    p = suite.parser(__doc__.splitlines()[0], iters=200, warmup=20, placement=False)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--reference", choices=("nccl", "gloo"), default=None, help="default: nccl if every rank has a GPU")
    p.add_argument("--hook", action="store_true", help="dfccl with its tagged all-reduce DDP hook")
    p.add_argument("--timeout", type=float, default=600)
    args = p.parse_args()
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    reference = args.reference or ("nccl" if gpus >= args.nproc else "gloo")
    runs: dict[str, list] = {"dfccl": [], reference: []}
    for _ in range(args.rounds):
        for backend in (reference, "dfccl"):
            runs[backend].append(run(backend, args))
    medians = {b: [statistics.median(ms[args.warmup:]) for ms, _ in rs] for b, rs in runs.items()}
    curve = {b: rs[0][1] for b, rs in runs.items()}
    rel = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(curve["dfccl"], curve[reference]))
    ratio = statistics.median(medians["dfccl"]) / statistics.median(medians[reference])
    print(f"DDP example, {args.nproc} processes, {gpus} GPU(s), {args.iters} steps (median after {args.warmup}), "
          f"{args.rounds} rounds each")
    print(f"{'backend':>8} {'step ms per round':>30}")
    for b, m in medians.items():
        print(f"{b:>8} {'  '.join(f'{x:8.2f}' for x in m):>30}")
    print(f"dfccl / {reference} step time: {ratio:.3f}; largest relative loss difference: {rel:.2e}")
    results = {"gpus": gpus, "nproc": args.nproc, "hook": args.hook, "reference": reference,
               "median_step_ms": medians, "ratio_dfccl_to_reference": ratio, "max_rel_loss_diff": rel,
               "losses": curve}
    path = suite.write(args.out, suite.record("ddp", args, "cuda" if gpus else "sim", list(range(gpus)), results))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
