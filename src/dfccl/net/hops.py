"""Where a collective's time goes across hosts: the network proxies' hop
trace.

With ``DFCCL_NET_TRACE=DIR`` in its environment, every rank whose
communicator spans hosts keeps the first messages its proxy sent and
applied (a timestamp, the peer, the sender's sequence number, the kind, the
bytes and a put's word) and writes them to ``DIR`` when it closes.
``python -m dfccl.net.hops DIR`` then reads every rank's file and prints:

* **hops**: from the moment one proxy took a message off its daemon's
  queue and sent it to the moment the peer's proxy applied it (a slice and
  its word, a word alone, a published record, a status), per kind.  Only
  between ranks of one machine (the clocks of two hosts are not one
  clock), i.e. "hosts" told apart by ``DFCCL_HOST_ID``;
* **turnarounds**, on each rank's own clock: from a slice applied to the
  credit for it sent (the receiving daemon saw the slice, moved it and
  posted the credit; its proxy took the entry), and from an instance's last
  credit applied to the next instance's first slice sent (the sending
  daemon completed one instance, published the next, met its peers and
  moved the first slice);
* each sender's period: from one instance's first slice to the next's.

A ring's words are ``(instance << 32) | count`` (the daemon's
``tagged_count``), which is how a credit is matched to its slice.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import numpy as np

from dfccl.net.hop_trace import TRACE_ENV, load_traces

__all__ = ["summarize", "main"]


def _what(codes: dict, kind: int, length: int) -> str:
    if kind == codes["put"]:
        return "slice" if length else "word"
    names = {codes[n]: n for n in ("record", "status", "share")}
    return names.get(kind, f"kind {kind}")


def _stats(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    v = sorted(values)
    return {"n": len(v), "median_us": statistics.median(v), "p10_us": v[len(v) // 10],
            "p90_us": v[min(len(v) - 1, (9 * len(v)) // 10)]}


def summarize(traces: list[dict]) -> dict:
    """Of one communicator's traces: hops between ranks of one machine, each
    rank's turnarounds and periods (microseconds; median, p10, p90 and how
    many)."""
    by_rank = {t["rank"]: t for t in traces}
    applied = {}  # (receiver, sender, seq) -> t_ns
    for t in traces:
        ev, c = t["events"], t["codes"]
        for e in ev[ev["what"] == c["applied"]]:
            applied[(t["rank"], int(e["peer"]), int(e["seq"]))] = int(e["t_ns"])
    hops: dict[str, list[float]] = {}
    for t in traces:
        ev, c = t["events"], t["codes"]
        for e in ev[ev["what"] == c["sent"]]:
            other = by_rank.get(int(e["peer"]))
            got = applied.get((int(e["peer"]), t["rank"], int(e["seq"])))
            if other is None or other["machine"] != t["machine"] or got is None:
                continue
            hops.setdefault(_what(c, int(e["kind"]), int(e["len"])), []).append((got - int(e["t_ns"])) / 1e3)
    receive, boundary, period = [], [], []
    for t in traces:
        ev, c = t["events"], t["codes"]
        ev = ev[np.argsort(ev["t_ns"], kind="stable")]
        puts = ev[ev["kind"] == c["put"]]
        credits_sent: dict[tuple[int, int], list[int]] = {}     # (peer, word) -> times
        credits_got: dict[tuple[int, int], list[int]] = {}      # (peer, instance) -> times
        for e in puts[puts["len"] == 0]:
            peer, word, when = int(e["peer"]), int(e["word"]), int(e["t_ns"])
            if e["what"] == c["sent"]:
                credits_sent.setdefault((peer, word), []).append(when)
            else:
                credits_got.setdefault((peer, word >> 32), []).append(when)
        last_first: dict[int, tuple[int, int]] = {}  # peer -> (instance, time) of the last first slice
        for e in puts[puts["len"] > 0]:
            peer, word, when = int(e["peer"]), int(e["word"]), int(e["t_ns"])
            if e["what"] == c["applied"]:
                # A slice applied -> the credit with the same word, to the same peer.
                later = [t_ns for t_ns in credits_sent.get((peer, word), ()) if t_ns >= when]
                if later:
                    receive.append((later[0] - when) / 1e3)
            elif word & 0xFFFFFFFF == 1:
                # An instance's first slice out -> back to the last credit
                # of the instance before it, from the same peer.
                inst = word >> 32
                before = [t_ns for t_ns in credits_got.get((peer, inst - 1), ()) if t_ns <= when]
                if before:
                    boundary.append((when - before[-1]) / 1e3)
                prev = last_first.get(peer)
                if prev is not None and prev[0] == inst - 1:
                    period.append((when - prev[1]) / 1e3)
                last_first[peer] = (inst, when)
    return {"hops": {k: _stats(v) for k, v in sorted(hops.items())},
            "slice_to_credit": _stats(receive), "last_credit_to_next_slice": _stats(boundary),
            "instance_period": _stats(period), "ranks": sorted(by_rank)}


def _line(name: str, s: dict) -> str:
    if not s["n"]:
        return f"  {name:<28} -"
    return f"  {name:<28} {s['median_us']:9.1f} {s['p10_us']:9.1f} {s['p90_us']:9.1f} {s['n']:>7}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dfccl.net.hops", description=__doc__.split("\n\n")[0])
    p.add_argument("directory", help=f"where the ranks wrote their traces (${TRACE_ENV})")
    a = p.parse_args(argv)
    comms = load_traces(a.directory)
    if not comms:
        print(f"no traces in {a.directory} (run the ranks with {TRACE_ENV}={a.directory})", file=sys.stderr)
        return 1
    for comm, traces in comms.items():
        s = summarize(traces)
        print(f"communicator {comm}, ranks {s['ranks']}; us: median, p10, p90, count")
        print("hops (one proxy sent -> the other applied; ranks of one machine only)")
        for name, st in s["hops"].items():
            print(_line(name, st))
        print("turnarounds (each rank's own clock)")
        print(_line("slice applied -> its credit", s["slice_to_credit"]))
        print(_line("last credit -> next slice", s["last_credit_to_next_slice"]))
        print(_line("instance period (sender)", s["instance_period"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
