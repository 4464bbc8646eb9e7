"""Markdown tables from bench_collectives.py's JSON results.

    python benchmarks/report.py benchmarks/results/<file>.json [...] > out.md
"""

from __future__ import annotations

import json
import sys


def fmt_size(n: int) -> str:
    for unit, m in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= m and n % m == 0:
            return f"{n // m} {unit}iB"
    return f"{n} B"


def table(data: dict) -> str:
    m = data["machine"]
    out = [f"Machine: {m['gpus']} GPUs (sm_{m['cc']}, {m['sm_count']} SMs), NCCL {m['nccl_version']}, "
           f"dfccl path {m['dfccl_path']}, {m['dfccl_channels']} channels, {m['date']}.", ""]
    kinds = []
    for row in data["rows"]:
        if row["kind"] not in kinds:
            kinds.append(row["kind"])
    for kind in kinds:
        out += [f"### {kind} (float32, sum)", "",
                "| size | dfccl us | NCCL us | NCCL/dfccl | dfccl busbw GB/s | NCCL busbw GB/s | in-place NCCL/dfccl |",
                "|---:|---:|---:|---:|---:|---:|---:|"]
        for r in data["rows"]:
            if r["kind"] != kind:
                continue
            out.append(f"| {fmt_size(r['size'])} | {r['dfccl_oop_us']:.1f} | {r['nccl_oop_us']:.1f} | "
                       f"{r['ratio_oop']:.2f} | {r['dfccl_busbw']:.1f} | {r['nccl_busbw']:.1f} | {r['ratio_ip']:.2f} |")
        out.append("")
    return "\n".join(out)


def main(paths: list[str]) -> int:
    for p in paths:
        with open(p) as f:
            print(table(json.load(f)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
