"""Host identity and the [net] extra: what tells hosts apart, the error that
names the extra when UCX is missing, and the hop trace's analysis on a
trace made by hand."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from dfccl.net import EXTRA, NetUnavailableError, host_id
from dfccl.net import _build


def test_host_id_is_hostname_and_boot_id(monkeypatch):
    import socket

    monkeypatch.delenv("DFCCL_HOST_ID", raising=False)
    hid = host_id()
    assert hid.startswith(socket.gethostname())
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            assert hid == f"{socket.gethostname()}/{f.read().strip()}"
    except OSError:
        assert hid == socket.gethostname()


def test_host_id_override(monkeypatch):
    monkeypatch.setenv("DFCCL_HOST_ID", "rack7-node3")
    assert host_id() == "rack7-node3"


def test_missing_ucx_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "libucx", None)   # import libucx raises ImportError
    with pytest.raises(NetUnavailableError, match=r"pip install \"dfccl\[net\]\""):
        _build.ucx_root()
    assert EXTRA == "dfccl[net]"


def _trace(rank: int, rows: list[tuple], fmt: str) -> dict:
    from dfccl.net.hop_trace import parse_format

    dtype, codes = parse_format(fmt)
    ev = np.zeros(len(rows), dtype)
    for i, (t, what, kind, peer, seq, word, length) in enumerate(rows):
        ev[i]["t_ns"], ev[i]["what"], ev[i]["kind"], ev[i]["peer"] = t, codes[what], codes[kind], peer
        ev[i]["seq"], ev[i]["word"], ev[i]["len"] = seq, word, length
    return {"rank": rank, "nranks": 2, "machine": "m", "events": ev, "codes": codes}


def test_hops_reads_a_synthetic_trace():
    """dfccl.net.hops on a hand-made trace of one instance of two slices,
    with codes unlike the proxy's (it takes them from the trace): the hops,
    the receiver's turnaround, the slices' spacing, and the long calls into
    UCX with the slice one of them held back."""
    from dfccl.net import hops

    fmt = ("48;t_ns:0:8 seq:8:8 word:16:8 len:24:8 what:32:4 kind:36:4 peer:40:4;"
           "sent=5 applied=6 busy=7 worker_pass=1 send_call=2 put=3 record=4 status=8 share=9")
    w1, w2 = (1 << 32) | 1, (1 << 32) | 2
    sender = _trace(0, [(1000, "sent", "record", 1, 0, 1, 0), (2000, "applied", "record", 1, 0, 1, 0),
                        (3000, "sent", "put", 1, 1, w1, 100), (3000, "busy", "send_call", 2, 0, 0, 30000),
                        (34000, "sent", "put", 1, 2, w2, 100), (60000, "applied", "put", 1, 1, w1, 0),
                        (61000, "applied", "put", 1, 2, w2, 0)], fmt)
    receiver = _trace(1, [(1500, "sent", "record", 0, 0, 1, 0), (1800, "applied", "record", 0, 0, 1, 0),
                          (10000, "applied", "put", 0, 1, w1, 100), (20000, "sent", "put", 0, 1, w1, 0),
                          (40000, "applied", "put", 0, 2, w2, 100), (41000, "busy", "worker_pass", 2, 0, 0, 25000),
                          (50000, "sent", "put", 0, 2, w2, 0)], fmt)
    got = hops.summarize([sender, receiver])
    assert got["hops"]["slice"]["n"] == 2 and got["hops"]["slice"]["median_us"] == pytest.approx(6.5)
    assert got["hops"]["word"]["n"] == 2 and got["hops"]["word"]["median_us"] == pytest.approx(25.5)
    assert got["hops"]["record"]["n"] == 2
    assert got["slice_to_credit"]["n"] == 2 and got["slice_to_credit"]["median_us"] == pytest.approx(10.0)
    assert got["slice_spacing"]["n"] == 1 and got["slice_spacing"]["median_us"] == pytest.approx(31.0)
    assert got["send_call"]["n"] == 1 and got["send_call"]["median_us"] == pytest.approx(30.0)
    assert got["worker_pass"]["n"] == 1 and got["worker_pass"]["median_us"] == pytest.approx(25.0)
    calls = {r["rank"]: r for r in got["calls"]}
    assert (calls[0]["slices"], calls[0]["held"]) == (2, 1)     # the second slice left 1 us after the send call
    assert calls[0]["share"] == pytest.approx(30000 / 60000)
    assert (calls[1]["slices"], calls[1]["held"]) == (0, 0)
