"""Host identity and the [net] extra: what tells hosts apart, and the error
that names the extra when UCX is missing."""

from __future__ import annotations

import sys

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

