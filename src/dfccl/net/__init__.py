"""Ranks on other hosts (docs/multi-node.md): how hosts are told apart, and
each rank's network side, a native proxy over UCX (the ``[net]`` extra;
a thread per lane) between the daemon's queues and mirrors and the remote
peers."""

from dfccl.net._build import EXTRA, NetUnavailableError
from dfccl.net.host import HOST_ID_ENV, host_id
from dfccl.net.link import NetLink

__all__ = ["EXTRA", "HOST_ID_ENV", "NetLink", "NetUnavailableError", "host_id"]
