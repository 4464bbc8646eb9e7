"""Chrome / Perfetto traces of the flight recorder (open them in
ui.perfetto.dev or chrome://tracing).

`export(path)` writes every rank of this process: one track per rank, one
slice per collective from submission to the moment the host saw it complete
(exact, host clock), a nested "run" slice from the derived first run, and
instant events for errors, aborts and lost peers.  Processes of one host share
the clock (CLOCK_MONOTONIC), so `merge(paths, out)` puts the traces of several
processes side by side."""

from __future__ import annotations

import json
import os
import time

from dfccl.errors import InvalidArgumentError
from dfccl.flight import recorders

__all__ = ["export", "merge", "trace_events"]


def trace_events() -> list[dict]:
    """This process's flight recorders as Chrome trace events."""
    pid = os.getpid()
    now = time.monotonic_ns()
    events: list[dict] = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                           "args": {"name": f"dfccl pid {pid}"}}]
    for rec in recorders():
        tid = (rec.comm_key & 0xFFFF) * 100 + rec.rank
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                       "args": {"name": f"comm {rec.comm_key:016x} rank {rec.rank}/{rec.world_size} "
                                        f"({rec.backend}:{rec.device})"}})
        submits: dict = {}
        for e in rec.events():
            key = (e.get("kind"), e.get("tag"), e.get("instance"))
            args = {k: v for k, v in e.items() if k not in ("event", "t_ns")}
            if e["event"] == "submit":
                submits[key] = e
            elif e["event"] in ("complete", "error"):
                start = submits.pop(key, None)
                t0 = start["t_ns"] if start else e["t_ns"]
                events.append({"ph": "X", "name": _slice_name(e), "cat": "collective", "pid": pid,
                               "tid": tid, "ts": t0 / 1e3, "dur": max(e["t_ns"] - t0, 0) / 1e3, "args": args})
                if e["event"] == "error":
                    events.append({"ph": "i", "s": "t", "name": "error", "pid": pid, "tid": tid,
                                   "ts": e["t_ns"] / 1e3, "args": args})
            elif e["event"] == "first_run":
                end = e["t_ns"]
                events.append({"ph": "X", "name": "run", "cat": "daemon (derived start)", "pid": pid, "tid": tid,
                               "ts": end / 1e3, "dur": 0, "args": args, "_key": key})
            elif e["event"] in ("abort", "close", "peer_lost"):
                events.append({"ph": "i", "s": "t", "name": e["event"], "pid": pid, "tid": tid,
                               "ts": e["t_ns"] / 1e3, "args": args})
        # Runs end where their collective ends.
        ends = {(ev["args"].get("kind"), ev["args"].get("tag"), ev["args"].get("instance")): ev["ts"] + ev["dur"]
                for ev in events if ev.get("cat") == "collective" and ev["tid"] == tid}
        for ev in events:
            if "_key" in ev:
                ev["dur"] = max(ends.get(ev.pop("_key"), ev["ts"]) - ev["ts"], 0)
        for key, e in submits.items():   # still pending
            events.append({"ph": "X", "name": f"{_slice_name(e)} (pending)", "cat": "collective",
                           "pid": pid, "tid": tid, "ts": e["t_ns"] / 1e3, "dur": (now - e["t_ns"]) / 1e3,
                           "args": {**{k: v for k, v in e.items() if k not in ("event", "t_ns")}, "pending": True}})
    return events


def _slice_name(e: dict) -> str:
    # One name for every instance of a tag, so that a trace viewer groups
    # them; untagged ones never read like an int tag.
    return f"{e['kind']} {'untagged' if e['tag'] is None else e['tag']}"


def export(path: str | os.PathLike) -> str:
    """Writes this process's collectives (every rank's flight recorder) as a
    Chrome trace JSON file; returns the path."""
    if not isinstance(path, (str, os.PathLike)):
        raise InvalidArgumentError(f"export: path must be a str or os.PathLike, not {type(path).__name__}")
    doc = {"traceEvents": trace_events(), "displayTimeUnit": "ns"}
    with open(path, "w") as f:
        json.dump(doc, f, default=repr)
    return os.fspath(path)


def merge(paths, output: str | os.PathLike) -> str:
    """Merges traces written by `export` in several processes of one host."""
    if isinstance(paths, (str, os.PathLike)) or not hasattr(paths, "__iter__"):
        raise InvalidArgumentError("merge: paths must be a list of trace files")
    events: list = []
    for p in paths:
        try:
            with open(p) as f:
                events.extend(json.load(f)["traceEvents"])
        except (OSError, ValueError, KeyError) as exc:
            raise InvalidArgumentError(f"merge: {p} is not a trace written by dfccl.trace.export ({exc})") from None
    with open(output, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ns"}, f)
    return os.fspath(output)
