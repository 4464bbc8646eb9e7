"""Names renamed by design decision 43 keep working for one release, each
with a DeprecationWarning that names its replacement."""

from __future__ import annotations

import numpy as np
import pytest

import dfccl
from dfccl import options, runtime
from dfccl.buffers import as_buffer
from dfccl.environment import init_from_env
from dfccl.errors import InvalidArgumentError


def test_context_options_is_daemon_options():
    with pytest.warns(DeprecationWarning, match="dfccl.DaemonOptions"):
        assert dfccl.ContextOptions is dfccl.DaemonOptions
    with pytest.warns(DeprecationWarning, match="dfccl.options.DaemonOptions"):
        from dfccl.options import ContextOptions
    assert ContextOptions is options.DaemonOptions


def test_unknown_names_still_raise():
    with pytest.raises(AttributeError, match="NoSuchOptions"):
        dfccl.NoSuchOptions  # noqa: B018
    with pytest.raises(AttributeError):
        runtime.no_such_function  # noqa: B018


def test_get_context_is_get_daemon():
    with pytest.warns(DeprecationWarning, match="get_daemon"):
        assert runtime.get_context is runtime.get_daemon


def test_buffer_kind_is_device_type():
    b = as_buffer(np.zeros(4, np.float32))
    with pytest.warns(DeprecationWarning, match="Buffer.device_type"):
        assert b.kind == b.device_type == "cpu"


def test_context_options_keyword():
    opts = dfccl.DaemonOptions(blocks=2)
    with pytest.warns(DeprecationWarning, match="daemon_options="):
        comms = dfccl.Communicator.for_devices([40, 41], backend="sim", context_options=opts)
    try:
        assert all(runtime.get_daemon("sim", d, opts) is c._daemon for d, c in zip((40, 41), comms))
    finally:
        for c in comms:
            c.close()
    with pytest.raises(InvalidArgumentError, match="pass daemon_options= only"):
        dfccl.Communicator.for_devices([40], backend="sim", daemon_options=opts, context_options=opts)
    with pytest.raises(InvalidArgumentError, match="pass daemon_options= only"):
        init_from_env(daemon_options=opts, context_options=opts, environ={})
