"""The ``dfccl`` command (also ``python -m dfccl``): ``demo``, ``bench``,
``info``, ``status`` and ``--version``.

Bad arguments and setup failures (no GPU for ``--backend cuda``, an unknown
device) end with one line, ``error: ...``, and exit code 2: no traceback.
A reader that stops early (``dfccl info | head``) ends the command quietly
with exit code 141 (128 + SIGPIPE, what a shell reports for a command that
SIGPIPE ended)."""

from __future__ import annotations

import argparse
import os
import select
import sys
import time
from typing import NoReturn

__all__ = ["main", "build_parser", "UsageError"]

EXIT_USAGE = 2
EXIT_BROKEN_PIPE = 141


class UsageError(Exception):
    """A bad command line or a setup the command cannot run on."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line on stderr, not usage + error."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def _device_list(text: str) -> list[int]:
    try:
        devices = [int(d) for d in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of device numbers") from None
    if any(d < 0 for d in devices):
        raise argparse.ArgumentTypeError(f"device numbers must be >= 0: {text!r}")
    return devices


def _size(text: str) -> int:
    from dfccl.bench import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _flag01(text: str) -> bool:
    if text not in ("0", "1"):
        raise argparse.ArgumentTypeError(f"expected 0 or 1, not {text!r}")
    return text == "1"


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is negative")
    return v


def build_parser() -> argparse.ArgumentParser:
    from dfccl import __version__
    from dfccl.bench import DTYPES, KINDS, OPS

    parser = _Parser(prog="dfccl", description="dfccl: deadlock-free collective communication")
    parser.add_argument("--version", action="version", version=f"dfccl {__version__}")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)

    demo = sub.add_parser("demo", help="run the deadlock scenarios on the visible GPUs (or the simulator)")
    demo.add_argument("--backend", choices=("cuda", "sim"), default=None, help="default: cuda if a GPU is visible")
    demo.add_argument("--devices", type=_device_list, default=None,
                      help="comma-separated device numbers, one rank each (default: all GPUs / 4 simulated)")
    demo.add_argument("--path", choices=("auto", "direct", "ring"), default="auto")
    demo.add_argument("--seed", type=int, default=None)

    bench = sub.add_parser("bench", help="collective latency and bandwidth against NCCL (like nccl-tests)",
                           description="Sweeps sizes from minbytes to maxbytes, checks every size against numpy "
                                       "and times dfccl (out of place and in place) and NCCL (in place), back to "
                                       "back or (-z 1) one collective waited for at a time, and each dfccl time "
                                       "over the GPU's floor (a resident kernel answering a doorbell, measured "
                                       "first).  With --report, prints result JSON files as Markdown tables "
                                       "instead.")
    bench.add_argument("kind_pos", nargs="?", metavar="KIND", default=None,
                       help=f"collective: {', '.join(KINDS)} or all (default all_reduce)")
    bench.add_argument("-k", "--kind", default=None, help="same as KIND")
    bench.add_argument("-b", "--minbytes", type=_size, default=_size("32M"), help="smallest size (default 32M)")
    bench.add_argument("-e", "--maxbytes", type=_size, default=_size("32M"), help="largest size (default 32M)")
    bench.add_argument("-f", "--stepfactor", type=_positive, default=2, help="size multiplier (default 2)")
    bench.add_argument("-n", "--iters", type=_positive, default=20, help="timed iterations (default 20)")
    bench.add_argument("-w", "--warmup_iters", type=_positive, default=5, help="warm-up iterations (default 5)")
    bench.add_argument("-c", "--check", type=_flag01, default=True, help="check results: 0 or 1 (default 1)")
    bench.add_argument("-z", "--blocking", type=_flag01, default=False,
                       help="1: time one collective waited for per iteration (median, p90 in the JSON); "
                            "0: back-to-back collectives (default 0)")
    bench.add_argument("-d", "--dtype", choices=DTYPES, default="float32")
    bench.add_argument("-o", "--op", choices=OPS, default="sum")
    bench.add_argument("-r", "--root", type=_positive, default=0, help="root of broadcast and reduce")
    bench.add_argument("--backend", choices=("cuda", "sim"), default=None, help="default: cuda if a GPU is visible")
    bench.add_argument("--devices", type=_device_list, default=None,
                       help="comma-separated device numbers, one rank each (default: all GPUs / 2 simulated)")
    bench.add_argument("--mode", "--procs", dest="mode", choices=("thread", "process"), default="thread",
                       help="thread: this process drives every GPU; process: one worker process per GPU")
    bench.add_argument("--path", choices=("auto", "direct", "ring"), default="auto", help="dfccl data path")
    bench.add_argument("--out", default=".", help="directory of the JSON and PNG results (default .)")
    bench.add_argument("--no-nccl", action="store_true", help="skip the NCCL baseline")
    bench.add_argument("--no-floor", action="store_true",
                       help="skip the hardware floor (a resident kernel answering a doorbell) above the table")
    bench.add_argument("--no-plot", action="store_true", help="skip the PNG plot")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    bench.add_argument("--seed", type=int, default=None, help="seed of the random inputs")
    bench.add_argument("--report", nargs="+", metavar="JSON", default=None,
                       help="print result JSON files as Markdown tables instead of running")

    sub.add_parser("info", help="versions, GPUs, peer access, kernel image and defaults")

    status = sub.add_parser("status", help="what the communicators of running processes are doing",
                            description="Reads the status files that processes using dfccl keep up to date "
                                        "(every second; DFCCL_STATUS=0 switches them off) and prints each "
                                        "communicator's pending collectives and whom they wait for.")
    status.add_argument("--pid", type=int, default=None, help="only this process")
    status.add_argument("--dir", default=None, help="status file directory (default: $DFCCL_STATUS_DIR or /dev/shm)")
    status.add_argument("--json", action="store_true", help="print the status files as JSON")
    return parser


def _run_demo(args: argparse.Namespace) -> int:
    from dfccl.demo import run_demo

    t0 = time.perf_counter()
    ok = run_demo(args.backend, args.devices, args.path, args.seed)
    print(f"total {time.perf_counter() - t0:.2f} s")
    return 0 if ok else 1


def _bench_config(args: argparse.Namespace):
    from dfccl import runtime
    from dfccl.bench import KINDS, BenchConfig

    if args.kind_pos is not None and args.kind is not None and args.kind_pos != args.kind:
        raise UsageError(f"two collectives given: {args.kind_pos!r} and {args.kind!r}")
    kind = args.kind or args.kind_pos or "all_reduce"
    kinds = list(KINDS) if kind == "all" else [k.strip() for k in kind.split(",")]
    backend = runtime.resolve_backend(args.backend)
    devices = args.devices
    if devices is None:
        devices = list(range(runtime.cuda_device_count())) if backend == "cuda" else [0, 1]
    if backend == "cuda":
        visible = runtime.cuda_device_count()
        missing = [d for d in devices if d >= visible]
        if missing:
            raise UsageError(f"cuda device {missing[0]} does not exist ({visible} visible)")
    cfg = BenchConfig(kinds=kinds, min_bytes=args.minbytes, max_bytes=args.maxbytes, step_factor=args.stepfactor,
                      iters=args.iters, warmup=args.warmup_iters, check=args.check, dtype=args.dtype, op=args.op,
                      root=args.root, backend=backend, devices=devices, mode=args.mode, path=args.path,
                      out=args.out, nccl=not args.no_nccl, plot=not args.no_plot, progress=not args.no_progress,
                      seed=args.seed, blocking=args.blocking, floor=not args.no_floor)
    try:
        cfg.validate()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return cfg


def _print_reports(paths: list[str]) -> int:
    import json

    from dfccl.bench import ReportError, format_markdown

    tables = []
    for path in paths:  # every file is read and checked before anything is printed
        try:
            with open(path) as f:
                doc = json.load(f)
        except OSError as exc:
            raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from None
        except ValueError as exc:
            raise UsageError(f"{path} is not JSON: {exc}") from None
        try:
            tables.append(format_markdown(doc))
        except ReportError as exc:
            raise UsageError(f"{path}: {exc}") from None
    print("\n".join(tables), end="")
    return 0


def _run_bench(args: argparse.Namespace) -> int:
    from dfccl.bench import run_bench

    if args.report is not None:
        return _print_reports(args.report)
    doc = run_bench(_bench_config(args))
    return 0 if doc["wrong_total"] == 0 else 1


def _run_info(args: argparse.Namespace) -> int:
    from dfccl.info import print_info

    print_info()
    return 0


def _run_status(args: argparse.Namespace) -> int:
    import json
    import os

    from dfccl import status_page
    from dfccl.flight import format_status
    from dfccl.liveness import collect_status, status_dir

    directory = args.dir or status_dir()
    if directory is None:
        raise UsageError("status files are switched off (DFCCL_STATUS=0); pass --dir")
    if not os.path.isdir(directory):
        raise UsageError(f"status directory {directory} does not exist")
    # Reading removes what processes that no longer exist left behind.
    docs = [d for d in collect_status(directory) if args.pid is None or d["pid"] == args.pid]
    status_page.sweep(directory)
    if args.json:
        print(json.dumps(docs, indent=2))
        return 0
    if not docs:
        print(f"no running process with dfccl communicators (status files in {directory})")
        return 0
    for doc in docs:
        age = time.time() - doc.get("time", time.time())
        print(f"process {doc['pid']} ({len(doc['communicators'])} communicators, status {age:.1f} s old)")
        for comm in doc["communicators"]:
            print("  " + format_status(comm).replace("\n", "\n  "))
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        try:
            return _main(argv)
        finally:
            sys.stdout.flush()   # a closed pipe shows here, not in the interpreter's last flush
    except BrokenPipeError:
        if not _stdout_closed():
            raise   # another pipe of the command: a real failure
        # What is still buffered goes nowhere, instead of failing again at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_BROKEN_PIPE


def _stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone (POLLERR)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _fd, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def _main(argv: list[str] | None) -> int:
    from dfccl.bench import WorkerError
    from dfccl.errors import BackendError, InvalidArgumentError

    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return 0
        run = {"demo": _run_demo, "bench": _run_bench, "info": _run_info, "status": _run_status}[args.command]
        return run(args)
    except (UsageError, BackendError, InvalidArgumentError) as exc:
        # One line: the first line of the message is the reason.
        print(f"error: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", file=sys.stderr)
        return EXIT_USAGE
    except WorkerError as exc:
        # A failure inside a worker process: its traceback is the useful part.
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
