"""The harness of the benchmark suite (benchmarks/*.py): one flag convention
and one record per run.

Flags every suite script takes (``parser``): ``--backend`` (cuda, sim;
default: cuda where a GPU is visible), ``--devices`` (comma-separated device
numbers), ``--iters``, ``--warmup``, ``--seed`` and ``--out`` (a folder).
Each run appends one JSON line to ``<out>/<suite name>.jsonl`` (``write``):
what ran (the script's name and arguments), where (host, backend, devices,
GPU names), with what (dfccl, Python, numpy, CUDA bindings and torch
versions), at which git revision of this repository, when, and the script's
results."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import subprocess
import sys

from dfccl.bench.runner import gpu_names, versions

__all__ = ["RESULTS", "parser", "device_list", "revision", "machine", "record", "write"]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: Where suite records go by default.
RESULTS = os.path.join(ROOT, "benchmarks", "results")


def device_list(text: str) -> list[int]:
    """``--devices``: comma-separated device numbers."""
    try:
        return [int(d) for d in text.split(",") if d.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"devices must be comma-separated integers, not {text!r}") from None


def parser(description: str, *, iters: int | None = None, warmup: int = 0, devices: str | None = None,
           backend: str | None = None, placement: bool = True) -> argparse.ArgumentParser:
    """An argument parser with the suite's common flags (and the script's
    defaults for them); the script adds its own.  ``placement=False``: the
    script places its ranks itself (no --backend, --devices); ``iters=None``:
    it does not count iterations (no --iters, --warmup)."""
    p = argparse.ArgumentParser(description=description)
    if placement:
        p.add_argument("--backend", choices=("cuda", "sim"), default=backend,
                       help="default: cuda if a GPU is visible")
        p.add_argument("--devices", type=device_list, default=device_list(devices) if devices else None,
                       help="comma-separated device numbers" + (f" (default {devices})" if devices else ""))
    if iters is not None:
        p.add_argument("--iters", type=int, default=iters, help=f"timed iterations (default {iters})")
        p.add_argument("--warmup", type=int, default=warmup, help=f"untimed iterations first (default {warmup})")
    p.add_argument("--seed", type=int, default=None, help="seed of the random inputs")
    p.add_argument("--out", default=RESULTS, help="folder of the JSON-lines records (default benchmarks/results)")
    return p


def revision() -> str | None:
    """This repository's git revision ("-dirty" with local changes), or None
    outside a git checkout."""
    try:
        rev = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return rev + ("-dirty" if dirty else "")


def machine(backend: str, devices: list[int]) -> dict:
    """Where a run ran."""
    return {"host": socket.gethostname(), "platform": platform.platform(), "backend": backend,
            "devices": list(devices), "gpus": gpu_names(backend, list(devices))}


def record(suite: str, args: argparse.Namespace, backend: str, devices: list[int], results) -> dict:
    """One run's record: what, where, with what, at which revision, when, and its results."""
    return {"suite": suite, "script": os.path.basename(sys.argv[0]), "args": vars(args),
            "time": datetime.datetime.now().isoformat(timespec="seconds"), "machine": machine(backend, devices),
            "versions": versions(), "revision": revision(), "results": results}


def write(out: str, rec: dict) -> str:
    """Appends ``rec`` as one line to ``<out>/<suite>.jsonl``; returns the path."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{rec['suite']}.jsonl")
    with open(path, "a") as f:
        f.write(json.dumps(rec, default=str) + "\n")
    return path
