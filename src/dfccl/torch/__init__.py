"""``torch.distributed`` backend: ``import dfccl.torch`` then
``dist.init_process_group(backend="dfccl")``.

Two implementations of one backend:

- compiled (the default): a C++ ``c10d::Backend`` (csrc/backend.cpp, built
  against the torch in use on first import and cached) that submits
  collectives through dfccl's C API with no Python on the per-call path, and
  hands the rarer forms to the Python side;
- Python (:class:`ProcessGroupDfccl`): the whole backend in Python, where no
  C++ compiler is available (or with ``DFCCL_TORCH_IMPL=python``).

Stream semantics (CUDA): a collective is ordered after the current stream at
call time and never blocks the host; ``Work.wait()`` makes the current stream
wait for it.  CPU tensors (the simulator) have no streams: ``wait()`` blocks
until the collective completes.  See docs/torch.md.
"""

import contextlib
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

import dfccl
from dfccl.errors import InvalidArgumentError
from dfccl.torch._build import IMPL_ENV, CompiledBackendUnavailable, build_dir, load
from dfccl.torch._common import (BACKEND_ENV, NotSupportedError, TorchCollectiveTimeoutError, as_buffer,
                                 premul_sum_supported)
from dfccl.torch._group import BACKEND_NAME, DEVICE_TYPES, DfcclWork, ProcessGroupDfccl
from dfccl.torch._hook import TaggedAllreduceState, backend_of, tagged_allreduce, tagged_allreduce_hook

__all__ = [
    "BACKEND_NAME",
    "BACKEND_ENV",
    "DEVICE_TYPES",
    "IMPL_ENV",
    "ProcessGroupDfccl",
    "DfcclWork",
    "TaggedAllreduceState",
    "tagged_allreduce",
    "tagged_allreduce_hook",
    "backend_of",
    "communicator",
    "cpu_stream",
    "implementation",
    "NotSupportedError",
    "InvalidArgumentError",
    "TorchCollectiveTimeoutError",
    "CompiledBackendUnavailable",
    "create_process_group",
    "premul_sum_supported",
]

# Kept for the host-path probe and older callers: a tensor's dfccl view.
_buffer = as_buffer


def _compiled_module() -> Any:
    """The compiled backend's module, or None where the Python backend
    serves (asked for, or the compiled one cannot be built: a warning says
    why)."""
    impl = os.environ.get(IMPL_ENV, "auto").strip() or "auto"
    if impl not in ("auto", "compiled", "python"):
        raise InvalidArgumentError(f"{IMPL_ENV} must be 'auto', 'compiled' or 'python', not {impl!r}")
    if impl == "python":
        return None
    try:
        return load()
    except CompiledBackendUnavailable as exc:
        if impl == "compiled":
            raise
        warnings.warn(f"{exc} Using the Python backend.", RuntimeWarning, stacklevel=3)
        return None


_compiled = _compiled_module()


def implementation() -> str:
    """"compiled" or "python": which backend ``init_process_group("dfccl")`` makes."""
    return "python" if _compiled is None else "compiled"


def create_process_group(backend_options: Any, pg_options: Any = None) -> Any:
    """The creator torch calls for ``backend="dfccl"`` (registered on import,
    with torch's extended creator arguments): the compiled backend over a
    Python side, or the Python process group.

    Args:
        backend_options: torch's (store, group rank and size, timeout).
        pg_options: ``init_process_group`` / ``new_group``'s ``pg_options``:
            a :class:`dfccl.CommOptions` for the group's communicators
            (for example ``hierarchy_min_bytes``, ``peer_timeout``), or None.

    Returns:
        The group's backend.
    """
    store, rank, size = backend_options.store, backend_options.group_rank, backend_options.group_size
    timeout = backend_options.timeout
    if _compiled is None:
        return ProcessGroupDfccl(store, rank, size, timeout, options=pg_options)
    group = ProcessGroupDfccl(store, rank, size, timeout, compiled=True, options=pg_options)
    return _compiled.Backend(rank, size, group, group.timeout.total_seconds())


def communicator(group: Any = None, device: Any = None) -> dfccl.Communicator:
    """The dfccl :class:`~dfccl.Communicator` of ``group`` (default: the
    default group) for ``device`` (default: the communicator the group
    created first), for the low-level API (tags, plans, stats, ``status()``)."""
    device_type = torch.device(device).type if device is not None else "cpu"
    backend = backend_of(group, device_type)
    side = backend if isinstance(backend, ProcessGroupDfccl) else backend.group
    return side.communicator(device)


@contextlib.contextmanager
def cpu_stream(stream: Any, group: Any = None) -> Iterator[None]:
    """Within the block, the collectives of CPU tensors (the simulator) on
    ``group`` (default: the default group) follow the simulated stream
    ``stream`` (``runtime.get_device("sim", i).create_stream()``, of the
    group's simulated device) as CUDA tensors' follow torch's current
    stream: ``wait()`` makes the stream wait, and while the stream captures
    (``stream.begin_capture()``) they are captured as under
    ``torch.cuda.graph``.  What tests and probes of stream order and graph
    capture run on the simulator."""
    backend = backend_of(group, "cpu")
    side = backend if isinstance(backend, ProcessGroupDfccl) else backend.group
    before = side.cpu_stream
    compiled_before = None if side is backend else backend.cpu_stream
    side.set_cpu_stream(stream)
    if side is not backend:
        backend.cpu_stream = 0 if stream is None else stream.handle
    try:
        yield
    finally:
        side.set_cpu_stream(before)
        if side is not backend:
            backend.cpu_stream = compiled_before


dist.Backend.register_backend(BACKEND_NAME, create_process_group, extended_api=True, devices=list(DEVICE_TYPES))
