"""The daemon's block profile between two readings (Daemon.daemon_profile),
for the benchmarks: which blocks ran collectives, and where their time went.

Channels are dealt to blocks per tag and per rank (dfccl_task_desc.first_block),
so the blocks that ran a benchmark's collectives are found from the readings,
not assumed."""

from __future__ import annotations

__all__ = ["busy_blocks", "profile_delta"]

def busy_blocks(before: list[dict], after: list[dict]) -> list[int]:
    """The blocks that ran a task between the two readings."""
    return [b for b, (p0, p1) in enumerate(zip(before, after)) if p1["runs"] > p0["runs"]]


def profile_delta(before: list[dict], after: list[dict], per: float = 1.0) -> dict:
    """The busy blocks' counters between the two readings, summed over those
    blocks and divided by ``per`` (e.g. the collectives in between);
    nanoseconds become microseconds (``pull_us``, ...).  ``blocks`` lists
    the busy blocks."""
    blocks = busy_blocks(before, after)
    out: dict = {"blocks": blocks}
    for k in before[0]:    # every counter Daemon.daemon_profile reports
        total = sum(after[b][k] - before[b][k] for b in blocks) / per
        out[k[:-3] + "_us" if k.endswith("_ns") else k] = total / 1e3 if k.endswith("_ns") else total
    return out
