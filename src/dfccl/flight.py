"""The flight recorder: a bounded ring, per rank, of what happened to its
collectives, for `Communicator.status()`, `python -m dfccl status` and
`dfccl.trace.export`.

What is exact and what is derived:
- exact (host clock, CLOCK_MONOTONIC in ns, comparable across the processes
  of a host): submission, the moment the host saw completion (retirement),
  the final status and error, aborts, closes and lost peers;
- exact counts, measured by the daemon (dfccl_result): preemptions, resumes,
  time queued (pulled -> first run), inside runs and first run -> done;
- derived: the first run's timestamp (completion seen by the host minus the
  daemon's first run -> done time; the device clock is not the host's), and
  the preemptions, which are counts without timestamps;
- live, for pending collectives: whom the daemon last waited for
  (slot_waiting) and which ranks have published the instance (their records).

Recording costs one deque append per submission (made by the daemon, from
the descriptor's ``flight``); `CommOptions.flight_events`
bounds the memory (0 switches it off)."""

from __future__ import annotations

import collections
import threading
import time
import weakref
from dataclasses import asdict, dataclass, field

from dfccl._native import layout
from dfccl.errors import collective_name
from dfccl.types import DataType

__all__ = ["FlightRecorder", "CommStatus", "PendingStatus", "recorders"]

_DTYPES = {int(d): d.name.lower() for d in DataType}
_STATUS = {layout.STATUS_OK: "ok", layout.STATUS_MISMATCH: "mismatch", layout.STATUS_PEER_ABORTED: "peer_aborted",
           layout.STATUS_ABORTED: "aborted", layout.STATUS_BAD_TASK: "bad_task", layout.STATUS_PEER_LOST: "peer_lost"}

_registry_lock = threading.Lock()
_registry: "weakref.WeakSet[FlightRecorder]" = weakref.WeakSet()


def recorders() -> list["FlightRecorder"]:
    """Every live recorder of this process (one per communicator rank)."""
    with _registry_lock:
        return sorted(_registry, key=lambda r: (r.comm_key, r.rank))


class FlightRecorder:
    """One rank's ring of collectives and notes (aborts, losses)."""

    def __init__(self, *, rank: int, world_size: int, comm_key: int, backend: str, device: int, maxlen: int):
        self.rank = rank
        self.world_size = world_size
        self.comm_key = comm_key
        self.backend = backend
        self.device = device
        self.enabled = maxlen > 0
        self._works: collections.deque = collections.deque(maxlen=max(maxlen, 1))
        self._notes: collections.deque = collections.deque(maxlen=max(min(maxlen, 256), 1))
        with _registry_lock:
            _registry.add(self)

    @property
    def ring(self) -> collections.deque | None:
        """Where submissions are recorded, as (work, count, dtype): the
        daemon appends to it as it submits (None when recording is off)."""
        return self._works if self.enabled else None

    def note(self, event: str, **fields) -> None:
        """A host-side event: abort, close, peer_lost."""
        self._notes.append({"event": event, "t_ns": time.monotonic_ns(), **fields})

    def events(self) -> list[dict]:
        """The ring as events, oldest first: submit, first_run, preempted,
        complete or error per collective, and the notes."""
        out = []
        for work, count, dtype in list(self._works):
            base = {"kind": work.kind, "tag": _jsonable(work.tag), "instance": work.instance, "count": count,
                    "dtype": _DTYPES.get(dtype, dtype),
                    "bytes": count * _itemsize(dtype)}
            out.append({"event": "submit", "t_ns": work.submitted_ns, **base})
            if not work.done():
                continue
            stats = work.stats or {}
            err = work.exception()
            retired = work.retired_ns
            if stats.get("channels"):
                out.append({"event": "first_run", "t_ns": max(work.submitted_ns, retired - stats["wall_ns"]),
                            "derived": True, **base})
                if stats["preemptions"]:
                    out.append({"event": "preempted", "t_ns": retired, "derived": True, "count_preemptions":
                                stats["preemptions"], "count_resumes": stats["resumes"], **base})
            end = {"event": "error" if err is not None else "complete", "t_ns": retired,
                   "status": _STATUS.get(work.status, work.status), **base}
            if err is not None:
                end["error"] = f"{type(err).__name__}: {err}"
            for k in ("preemptions", "resumes", "queued_ns", "running_ns", "wall_ns"):
                if k in stats:
                    end[k] = stats[k]
            out.append(end)
        out.extend(dict(n) for n in self._notes)
        out.sort(key=lambda e: e["t_ns"])
        return out

    def works(self) -> list:
        return [w for w, _c, _d in list(self._works)]


def _itemsize(dtype: int) -> int:
    return (1, 1, 4, 4, 8, 8, 2, 4, 8, 2)[dtype] if 0 <= dtype < 10 else 0


def _jsonable(tag):
    return tag if isinstance(tag, (str, int, float, bool)) or tag is None else repr(tag)


@dataclass
class PendingStatus:
    """One pending collective as `Communicator.status()` reports it."""

    kind: str
    tag: object                       # None: untagged
    instance: int
    age_s: float
    state: str                        # "waiting for ranks to join", "transferring", ...
    waiting_for: int | None = None    # the daemon's live report
    joined_ranks: list[int] | None = None
    missing_ranks: list[int] | None = None


@dataclass
class CommStatus:
    """What one rank of a communicator is doing (`Communicator.status()`)."""

    rank: int
    world_size: int
    backend: str
    device: int
    path: str
    state: str                          # "open", "aborted", "closed", "peer N lost"
    pending: list[PendingStatus] = field(default_factory=list)
    recent: list[dict] = field(default_factory=list)   # the last events of the flight recorder
    # collectives captured in CUDA graphs: kind, tag, error of the last failed replay (None: none failed)
    captured: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = asdict(self)
        for p in d["pending"] + d["captured"]:
            p["tag"] = _jsonable(p["tag"])
        return d

    def __str__(self) -> str:
        return format_status(self.to_dict())


def format_status(d: dict) -> str:
    """Human-readable lines of one CommStatus.to_dict()."""
    lines = [f"rank {d['rank']}/{d['world_size']} {d['backend']}:{d['device']} path={d['path']} {d['state']}: "
             f"{len(d['pending'])} pending"]
    for p in d["pending"]:
        line = f"  {p['kind']} {collective_name(p['tag'], p['instance'])}, {p['age_s']:.1f} s: {p['state']}"
        if p.get("missing_ranks"):
            line += f"; ranks {p['missing_ranks']} have not joined (ranks {p['joined_ranks']} have)"
        elif p.get("waiting_for") is not None:
            line += f"; waits for rank {p['waiting_for']}"
        lines.append(line)
    captured = d.get("captured", [])
    if captured:
        failed = [c for c in captured if c.get("error")]
        lines.append(f"  {len(captured)} captured in CUDA graphs, {len(failed)} with a failed replay")
        for c in failed[-3:]:
            name = "untagged" if c["tag"] is None else f"tag {c['tag']!r}"
            lines.append(f"  captured {c['kind']} {name}: {c['error']}")
    errors = [e for e in d.get("recent", []) if e["event"] in ("error", "abort", "peer_lost")]
    for e in errors[-3:]:
        lines.append(f"  recent {e['event']}: {e.get('error') or e.get('detail', '')}".rstrip())
    return "\n".join(lines)
