"""The host half of the preemption policy (the device half is
preemption_window() in cuda/daemon/schedule.cuh).

The device preempts a run that makes no progress for one window; the oldest
pending collective gets a longer, growing window, and a collective whose gang
has formed a sticky one.  The host sets the *base* of those windows from the
peer skew it observes: every completed collective reports the longest wait
that ended with its peer arriving (max_wait_ns).  Every ``period_ns`` (with at
least 8 completions seen) the base moves halfway (geometrically) towards twice
the 90th percentile of those waits, within [min_base, max_base]:

- peers that arrive a few microseconds late -> short windows, so a collective
  whose peers are absent gives the daemon back quickly;
- peers that keep arriving just before the window closes -> the percentile
  sits near the base and the base grows, so runs overlap and gangs form.

Correctness never depends on these numbers (see schedule.cuh); they trade
switching overhead against time spent waiting for absent peers."""

from __future__ import annotations

import math

__all__ = ["WindowPolicy", "default_policy"]

NS = 1
US = 1000 * NS
MS = 1000 * US


class WindowPolicy:
    #: Completions a period needs before the base window moves.
    min_completions = 8

    def __init__(self, *, base_window_ns: int, max_window_ns: int, idle_quit_ns: int, relaunch_backoff_ns: int,
                 min_base_ns: int, max_base_ns: int, adaptive: bool = True, period_ns: int = 20 * MS,
                 empty_quit_ns: int | None = None):
        self.base_window_ns = base_window_ns
        self.max_window_ns = max_window_ns
        self.idle_quit_ns = idle_quit_ns
        self.empty_quit_ns = idle_quit_ns if empty_quit_ns is None else min(empty_quit_ns, idle_quit_ns)
        self.relaunch_backoff_ns = relaunch_backoff_ns
        self.min_base_ns = min_base_ns
        self.max_base_ns = max_base_ns
        self.adaptive = adaptive
        self.period_ns = period_ns
        self.history: list[tuple[int, float]] = []  # (new base, preemptions per completion)

    def adapt(self, completions: int, preemptions: int, waits: list[int]) -> int | None:
        """One period's observations (the daemon gathers them at
        retirement: how many collectives completed, their preemptions, the
        longest successful wait of each, up to 4,096): returns a new base
        window to publish, or None.  Called once per ``period_ns`` with at
        least ``min_completions`` completions."""
        if not self.adaptive or completions < self.min_completions or not waits:
            return None
        waits = sorted(waits)
        p90 = waits[int(0.9 * (len(waits) - 1))]
        rate = preemptions / completions
        target = min(self.max_base_ns, max(self.min_base_ns, 2 * p90))
        base = int(math.sqrt(self.base_window_ns * target))
        base = min(self.max_base_ns, max(self.min_base_ns, base))
        if base == self.base_window_ns:
            return None
        self.base_window_ns = base
        self.history.append((base, rate))
        del self.history[:-64]
        return base


INFINITE_NS = 1 << 62

#: With nothing left to run, a GPU daemon leaves after this long: a daemon
#: kept resident holds its SMs' register files from other kernels, and a
#: device-wide synchronisation (torch.cuda.synchronize), cuMemFree or a
#: kernel's first launch waits until it leaves.  A relaunch costs the next
#: collective 25-29 us on an H200 (docs/performance-log.md, section 19); 50 us
#: keeps a loop of collectives waited for one at a time (the next submitted
#: within microseconds) on one launch.
EMPTY_QUIT_GPU_NS = 50 * US


def default_policy(backend: str, options) -> WindowPolicy:
    """Defaults per backend.  Idle quit: while work waits (peers absent,
    streams not there yet) the daemon stays idle_quit_ns; with nothing left
    to run, empty_quit_ns.  GPU: a peer flag round trip is ~2.5 us
    (measured on 2 x H200: docs/gpu.md), so a 20 us base tolerates jitter without holding
    the SMs long for an absent peer.  Simulator: host threads share few cores
    and are descheduled for milliseconds, so its windows are longer."""
    gpu = backend == "cuda"
    if not options.preemption:
        return WindowPolicy(base_window_ns=INFINITE_NS, max_window_ns=INFINITE_NS, idle_quit_ns=INFINITE_NS,
                            relaunch_backoff_ns=100 * US, min_base_ns=INFINITE_NS, max_base_ns=INFINITE_NS,
                            adaptive=False, empty_quit_ns=options.empty_quit_ns)
    base = options.base_window_ns or (20 * US if gpu else 200 * US)
    return WindowPolicy(
        base_window_ns=base,
        max_window_ns=options.max_window_ns or (2 * MS if gpu else 50 * MS),
        idle_quit_ns=options.idle_quit_ns or (5 * MS if gpu else 20 * MS),
        empty_quit_ns=options.empty_quit_ns or (EMPTY_QUIT_GPU_NS if gpu else 2 * MS),
        relaunch_backoff_ns=options.relaunch_backoff_ns or (200 * US if gpu else 1 * MS),
        min_base_ns=min(base, 5 * US if gpu else 50 * US),
        max_base_ns=max(base, 1 * MS if gpu else 20 * MS),
        adaptive=options.adaptive,
    )
