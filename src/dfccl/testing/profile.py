"""The daemon's block profile between two readings (Context.daemon_profile),
for the benchmarks: which blocks ran collectives, and where their time went.

Channels are dealt to blocks per tag and per rank (dfccl_task_desc.first_block),
so the blocks that ran a benchmark's collectives are found from the readings,
not assumed."""

from __future__ import annotations

__all__ = ["busy_blocks", "profile_delta"]

_FIELDS = ("passes", "runs", "pull_ns", "pick_ns", "restore_ns", "run_ns", "save_ns", "idle_ns",
           # the step profile (zero unless the daemon was built with DFCCL_STEP_PROFILE=1)
           "ll_runs", "ll_credit_ns", "ll_push_ns", "ll_recv_ns", "ll_finish_ns", "complete_ns")


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
    for k in _FIELDS:
        total = sum(after[b][k] - before[b][k] for b in blocks) / per
        out[k[:-3] + "_us" if k.endswith("_ns") else k] = total / 1e3 if k.endswith("_ns") else total
    return out
