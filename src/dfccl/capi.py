"""The C API: C and C++ code submits bound collectives, tests and waits for
them, with no Python object per collective and, in the common case,
without the GIL (``cuda/include/dfccl/dfccl_api.h``, docs/c-api.md).

    plan = comm.prepare_all_reduce(n, "float32").bind(x)
    table = dfccl.capi.table_address()   # a const dfccl_api *
    c_plan = plan.c_plan                  # a const dfccl_plan *, valid while `plan` lives

C extensions read the table with ``PyCapsule_Import(DFCCL_API_CAPSULE, 0)``
(``capsule()`` is that capsule); build them with ``include_dir()`` on the
include path."""

from __future__ import annotations

import ctypes

from dfccl import kernel_image
from dfccl._native.capi import API_VERSION, CAPSULE_NAME, api_capsule

__all__ = ["API_VERSION", "CAPSULE_NAME", "capsule", "table_address", "include_dir"]


def capsule():
    """The table (a ``dfccl_api``) in a PyCapsule named CAPSULE_NAME."""
    return api_capsule()


def table_address() -> int:
    """The table's address (a ``const dfccl_api *``) as an int, for callers
    that take it that way (ctypes); it stays valid for the process."""
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype = ctypes.c_void_p
    get.argtypes = [ctypes.py_object, ctypes.c_char_p]
    return get(api_capsule(), CAPSULE_NAME.encode())


def include_dir() -> str:
    """Where ``<dfccl/dfccl_api.h>`` is: the headers shipped with the
    package, or those of a source checkout."""
    return kernel_image.include_dir()
