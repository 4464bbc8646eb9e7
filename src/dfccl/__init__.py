"""dfccl: GPU collective communication that cannot deadlock on collective order.

A persistent daemon kernel per GPU runs every collective, preempts one whose
peers have not arrived, runs another, and resumes the first exactly where it
stopped.  See README.md and docs/.
"""

from dfccl._deprecated import renamed_attributes
from dfccl._native.work import Work
from dfccl.buffers import Buffer
from dfccl.communicator import Communicator, Plan
from dfccl.environment import init_from_env
from dfccl.errors import (AbortedError, BackendError, ClosedError, CollectiveTimeoutError, DfcclError, ErrorCode,
                          InvalidArgumentError, MismatchError, NotSupportedError, PeerAbortedError, PeerLostError,
                          ResourceError, StartupTimeoutError)
from dfccl.options import CommOptions, DaemonOptions
from dfccl.runtime import default_backend, device_count, device_synchronize, shutdown
from dfccl.types import DataType, ReduceOp
from dfccl.unique_id import UniqueId

__version__ = "0.1.0"

# Old names, one release (design decision 43).
__getattr__ = renamed_attributes(__name__, {"ContextOptions": "DaemonOptions"})

__all__ = [
    "Communicator",
    "init_from_env",
    "Plan",
    "Work",
    "Buffer",
    "UniqueId",
    "CommOptions",
    "DaemonOptions",
    "DataType",
    "ReduceOp",
    "default_backend",
    "device_count",
    "device_synchronize",
    "shutdown",
    "DfcclError",
    "ErrorCode",
    "InvalidArgumentError",
    "MismatchError",
    "PeerAbortedError",
    "PeerLostError",
    "AbortedError",
    "CollectiveTimeoutError",
    "StartupTimeoutError",
    "ResourceError",
    "BackendError",
    "ClosedError",
    "NotSupportedError",
]
