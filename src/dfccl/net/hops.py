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
* each sender's period: from one instance's first slice to the next's,
  and within an instance, from one slice sent to the next (what spaces
  them: the daemon's moves, the FIFO's credits);
* the sender's turnaround split by the records (a record names the
  instance it publishes): from the last credit applied to its own record of
  the next instance sent (complete, pick the next, publish), and from the
  peer's record of that instance applied to its first slice sent (meet the
  peer, move the slice); and on the receiver, from an instance's last
  credit sent to its own record of the next one sent;
* the proxy's own calls into UCX that took longer than its threshold (20
  us; the trace names it), passes of the worker and sends (while one runs,
  the proxy takes nothing off its daemon's queues and applies nothing): how
  long, what share of the time, and how many slices went out within 5 us of
  one's end (held back by it).

A ring's words are ``(instance << 32) | count`` (the daemon's
``tagged_count``), which is how a credit is matched to its slice.
"""

from __future__ import annotations

import argparse
import bisect
import statistics
import sys

import numpy as np

from dfccl.net.hop_trace import TRACE_ENV, load_traces

__all__ = ["TURNAROUNDS", "RECORD_SPLIT", "PROXY_CALLS", "summarize", "main"]


def _what(codes: dict, kind: int, length: int) -> str:
    if kind == codes["put"]:
        return "slice" if length else "word"
    names = {codes[n]: n for n in ("record", "status", "share", "lines") if n in codes}
    return names.get(kind, f"kind {kind}")


def _stats(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    v = sorted(values)
    return {"n": len(v), "median_us": statistics.median(v), "p10_us": v[len(v) // 10],
            "p90_us": v[min(len(v) - 1, (9 * len(v)) // 10)]}


def _first_at_or_after(times, t: int) -> int | None:
    """The first of the ascending ``times`` at or after ``t``."""
    i = bisect.bisect_left(times, t)
    return times[i] if i < len(times) else None


def _last_at_or_before(times, t: int) -> int | None:
    """The last of the ascending ``times`` at or before ``t``."""
    i = bisect.bisect_right(times, t)
    return times[i - 1] if i else None


#: What summarize() reports besides the hops (its keys) and how main()
#: names them, in the order it prints them: the turnarounds, then the
#: sender's and the receiver's split by the records.
TURNAROUNDS = (("slice_to_credit", "slice applied -> its credit"),
               ("last_credit_to_next_slice", "last credit -> next slice"),
               ("instance_period", "instance period (sender)"),
               ("slice_spacing", "slice -> next slice (sender)"))
RECORD_SPLIT = (("last_credit_to_own_record", "sender: last credit -> own record"),
                ("peer_record_to_next_slice", "sender: peer's record -> slice"),
                ("credit_out_to_own_record", "receiver: last credit -> record"))


#: The proxy's long calls into UCX (over the trace's ``long_call_ns``) by
#: the trace's code for the call: the key summarize() gives them and how
#: main() names them.
PROXY_CALLS = (("worker_pass", "proxy: long worker pass"),
               ("send_call", "proxy: long send call"))

#: A slice sent this soon after a long call ended was held back by it.
HELD_BY_CALL_NS = 5000


def _hops(traces: list[dict]) -> dict[str, list[float]]:
    """Per kind, from one proxy's send to the peer's apply (ranks of one
    machine only), us."""
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
    return hops


def _credits(puts: np.ndarray, c: dict):
    """A rank's credits (words alone), in time order: those it sent by (peer,
    word), those it got by (peer, instance), and the (instance, time) of
    each instance's last credit sent."""
    sent: dict[tuple[int, int], list[int]] = {}
    got: dict[tuple[int, int], list[int]] = {}
    last_out: list[tuple[int, int]] = []
    latest: dict[int, tuple[int, int]] = {}  # peer -> (instance, time) of the latest credit sent
    for e in puts[puts["len"] == 0]:
        peer, word, when = int(e["peer"]), int(e["word"]), int(e["t_ns"])
        if e["what"] == c["sent"]:
            sent.setdefault((peer, word), []).append(when)
            if peer in latest and latest[peer][0] != word >> 32:
                last_out.append(latest[peer])
            latest[peer] = (word >> 32, when)
        else:
            got.setdefault((peer, word >> 32), []).append(when)
    return sent, got, last_out + list(latest.values())


def _records(ev: np.ndarray, c: dict):
    """A rank's records by the instance they publish, in time order: its own
    (sent) and each peer's (applied, by (peer, instance)).  Several tags may
    share an instance number, so a record is matched as the first at or
    after the event it follows."""
    own: dict[int, list[int]] = {}
    peers: dict[tuple[int, int], list[int]] = {}
    for e in ev[ev["kind"] == c["record"]]:
        inst, when = int(e["word"]), int(e["t_ns"])
        if e["what"] == c["sent"]:
            own.setdefault(inst, []).append(when)
        else:
            peers.setdefault((int(e["peer"]), inst), []).append(when)
    return own, peers


def _turnarounds(t: dict, out: dict[str, list[float]]) -> None:
    """One rank's turnarounds, on its own clock, appended to ``out`` (us)."""
    c = t["codes"]
    ev = t["events"][np.argsort(t["events"]["t_ns"], kind="stable")]
    puts = ev[ev["kind"] == c["put"]]
    credits_sent, credits_got, last_credits_out = _credits(puts, c)
    own_record, peer_record = _records(ev, c)
    for inst, when in last_credits_out:
        rec = _first_at_or_after(own_record.get(inst + 1, ()), when)
        if rec is not None:
            out["credit_out_to_own_record"].append((rec - when) / 1e3)
    last_sent: dict[int, tuple[int, int]] = {}   # peer -> (word, time) of the last slice sent
    last_first: dict[int, tuple[int, int]] = {}  # peer -> (instance, time) of the last first slice
    for e in puts[puts["len"] > 0]:
        peer, word, when = int(e["peer"]), int(e["word"]), int(e["t_ns"])
        if e["what"] == c["applied"]:
            # A slice applied -> the credit with the same word, to the same peer.
            credit = _first_at_or_after(credits_sent.get((peer, word), ()), when)
            if credit is not None:
                out["slice_to_credit"].append((credit - when) / 1e3)
            continue
        if word & 0xFFFFFFFF > 1:
            # A later slice of an instance out -> the one before it.
            if last_sent.get(peer, (-1, 0))[0] == word - 1:
                out["slice_spacing"].append((when - last_sent[peer][1]) / 1e3)
        elif word & 0xFFFFFFFF == 1:
            # An instance's first slice out -> back to the last credit of the
            # instance before it from the same peer, to this rank's record of
            # this one, and to the peer's.
            inst = word >> 32
            credit = _last_at_or_before(credits_got.get((peer, inst - 1), ()), when)
            if credit is not None:
                out["last_credit_to_next_slice"].append((when - credit) / 1e3)
                rec = _first_at_or_after(own_record.get(inst, ()), credit)
                if rec is not None and rec <= when:
                    out["last_credit_to_own_record"].append((rec - credit) / 1e3)
            prev = last_first.get(peer)
            met = _first_at_or_after(peer_record.get((peer, inst), ()), prev[1] if prev else 0)
            if met is not None and met <= when:
                out["peer_record_to_next_slice"].append((when - met) / 1e3)
            if prev is not None and prev[0] == inst - 1:
                out["instance_period"].append((when - prev[1]) / 1e3)
            last_first[peer] = (inst, when)
        last_sent[peer] = (word, when)


def _calls(t: dict, out: dict[str, list[float]]) -> dict:
    """One rank's long calls into UCX, appended to ``out`` by call (us);
    returns its share of the trace's span in them and how many of the
    slices it sent followed one's end within HELD_BY_CALL_NS."""
    c, ev = t["codes"], t["events"]
    if "busy" not in c or not len(ev):
        return {"rank": t["rank"], "share": None, "slices": 0, "held": 0}
    busy = ev[ev["what"] == c["busy"]]
    for key, _ in PROXY_CALLS:
        out[key].extend((busy[busy["kind"] == c[key]]["len"] / 1e3).tolist())
    ends = np.sort((busy["t_ns"] + busy["len"]).astype(np.int64))
    slices = ev[(ev["what"] == c["sent"]) & (ev["kind"] == c["put"]) & (ev["len"] > 0)]
    held = 0
    for when in slices["t_ns"].astype(np.int64):
        end = _last_at_or_before(ends, int(when))
        held += end is not None and when - end <= HELD_BY_CALL_NS
    span = int(ev["t_ns"].max()) - int(ev["t_ns"].min())
    return {"rank": t["rank"], "share": float(busy["len"].sum()) / span if span else None,
            "slices": len(slices), "held": held}


def summarize(traces: list[dict]) -> dict:
    """Of one communicator's traces: hops between ranks of one machine, each
    rank's turnarounds and periods, and the proxies' long calls into UCX
    (microseconds; median, p10, p90 and how many)."""
    out: dict[str, list[float]] = {k: [] for k, _ in TURNAROUNDS + RECORD_SPLIT + PROXY_CALLS}
    ranks = []
    for t in sorted(traces, key=lambda t: t["rank"]):
        _turnarounds(t, out)
        ranks.append(_calls(t, out))
    return {"hops": {k: _stats(v) for k, v in sorted(_hops(traces).items())},
            **{k: _stats(v) for k, v in out.items()}, "ranks": [r["rank"] for r in ranks], "calls": ranks}


def _line(name: str, s: dict) -> str:
    if not s["n"]:
        return f"  {name:<34} -"
    return f"  {name:<34} {s['median_us']:9.1f} {s['p10_us']:9.1f} {s['p90_us']:9.1f} {s['n']:>7}"


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
        for key, label in TURNAROUNDS:
            print(_line(label, s[key]))
        print("the turnarounds split by the records")
        for key, label in RECORD_SPLIT:
            print(_line(label, s[key]))
        threshold = {t["codes"].get("long_call_ns") for t in traces} - {None}
        print("the proxies' own time" + "".join(f" (calls into UCX over {ns / 1e3:g} us)" for ns in threshold))
        for key, label in PROXY_CALLS:
            print(_line(label, s[key]))
        for r in s["calls"]:
            if r["share"] is None:
                print(f"  rank {r['rank']}: no calls into UCX in its trace (a proxy that does not record them)")
            else:
                print(f"  rank {r['rank']}: {100 * r['share']:.0f}% of the time in long calls; "
                      f"{r['held']} of {r['slices']} slices sent within {HELD_BY_CALL_NS // 1000} us of one's end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
