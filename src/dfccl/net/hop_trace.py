"""The network proxies' hop trace on disk (``DFCCL_NET_TRACE``): what each
rank's proxy recorded, written when the rank closes and read back by
``python -m dfccl.net.hops`` (hops.py, which says what the trace shows)."""

from __future__ import annotations

import glob
import os

import numpy as np

from dfccl.net.host import machine_id

__all__ = ["TRACE_ENV", "parse_format", "save_trace", "load_traces"]

#: Where ranks write their hop traces (unset: no trace).
TRACE_ENV = "DFCCL_NET_TRACE"


def parse_format(text: str) -> tuple[np.dtype, dict[str, int]]:
    """The proxy's description of its trace (``dfccl_net_trace_format``):
    the events' dtype and the codes of what happened (sent, applied) and of
    the message kinds (put, record, status, share)."""
    size, fields, codes = text.split(";")
    names, formats, offsets = [], [], []
    for field in fields.split():
        name, offset, width = field.split(":")
        names.append(name)
        formats.append(f"<u{width}")
        offsets.append(int(offset))
    dtype = np.dtype({"names": names, "formats": formats, "offsets": offsets, "itemsize": int(size)})
    return dtype, {k: int(v) for k, v in (c.split("=") for c in codes.split())}


def save_trace(directory: str, comm_key: int, rank: int, nranks: int, events: np.ndarray, fmt: str) -> str:
    """Writes one rank's trace of the communicator ``comm_key`` (``events``
    as the proxy's format ``fmt`` lays them out) to ``directory`` (created
    if needed); returns the file's path."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"dfccl-net-{comm_key:016x}-rank{rank}-{os.getpid()}.npz")
    np.savez(path, events=events.view(np.uint8), format=fmt, rank=rank, nranks=nranks, comm=f"{comm_key:016x}",
             machine=machine_id())
    return path


def load_traces(directory: str) -> dict[str, list[dict]]:
    """Every trace in ``directory``, by communicator: dicts of rank,
    nranks, machine, events (a structured array) and codes."""
    out: dict[str, list[dict]] = {}
    for path in sorted(glob.glob(os.path.join(directory, "dfccl-net-*.npz"))):
        with np.load(path) as z:
            dtype, codes = parse_format(str(z["format"]))
            out.setdefault(str(z["comm"]), []).append(
                {"path": path, "rank": int(z["rank"]), "nranks": int(z["nranks"]), "machine": str(z["machine"]),
                 "events": z["events"].view(dtype), "codes": codes})
    return out
