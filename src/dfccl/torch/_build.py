"""The compiled backend (csrc/backend.cpp): built with torch's own extension
tooling (torch.utils.cpp_extension) against the torch in use, on first
import, and kept in dfccl's cache under a key of everything that shapes it
(the sources, dfccl's C API and ABI headers, torch's version and C++ ABI, Python's).

Why at first import and not at dfccl's installation: torch is an optional
extra, installed (or upgraded) after dfccl as often as with it, and the
extension must match the torch that runs it exactly; a build at first
import always sees that torch, and a cached one costs a file lookup."""

import importlib.machinery
import importlib.util
import os
import shutil
import sys
import sysconfig
from pathlib import Path
from types import ModuleType

import torch

from dfccl import capi
from dfccl.errors import DfcclError
from dfccl.kernel_image import cache_dir, cache_key, tree_digest

__all__ = ["IMPL_ENV", "CompiledBackendUnavailable", "build_dir", "load"]

#: "compiled" (fail where the compiled backend cannot be built), "python"
#: (the Python backend), or unset / "auto": compiled where it builds, else
#: Python with a warning saying what is missing.
IMPL_ENV = "DFCCL_TORCH_IMPL"

_SOURCES = Path(__file__).parent / "csrc"


class CompiledBackendUnavailable(DfcclError):
    """The compiled backend cannot be built here (no C++ compiler, no
    ninja); the message names what is missing."""


def _key() -> str:
    headers = Path(capi.include_dir()) / "dfccl"
    return cache_key(tree_digest(_SOURCES, headers / "dfccl_api.h", headers / "abi.h"), torch.__version__,
                     str(torch._C._GLIBCXX_USE_CXX11_ABI), sys.version, sysconfig.get_platform())


def build_dir() -> Path:
    """Where this torch's build of the compiled backend lives."""
    return cache_dir() / "torch" / _key()


def _module_name() -> str:
    return "dfccl_torch_" + _key()[:16]


def _import(path: Path, name: str) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _missing_tools() -> list[str]:
    missing = []
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        missing.append(f"a C++ compiler ({compiler!r} is not on PATH; install g++ or clang++, or set CXX)")
    try:
        from torch.utils.cpp_extension import verify_ninja_availability

        verify_ninja_availability()
    except RuntimeError:
        missing.append("ninja (pip install ninja; dfccl's [torch] extra installs it)")
    return missing


def load() -> ModuleType:
    """The compiled backend's module: the cached build, or a new one (a
    minute or two, once per torch version; progress on stderr)."""
    name = _module_name()
    where = build_dir()
    built = where / f"{name}.so"
    if built.is_file():
        return _import(built, name)
    missing = _missing_tools()
    if missing:
        raise CompiledBackendUnavailable(
            "dfccl.torch: the compiled backend cannot be built: missing " + "; ".join(missing)
            + f". Set {IMPL_ENV}=python to use the Python backend (slower host path) without this warning.")
    from torch.utils import cpp_extension

    where.mkdir(parents=True, exist_ok=True)
    print(f"dfccl.torch: building the compiled backend for torch {torch.__version__} in {where} "
          "(once per torch version; a minute or two)...", file=sys.stderr, flush=True)
    try:
        module = cpp_extension.load(name=name, sources=[str(_SOURCES / "backend.cpp")],
                                    extra_include_paths=[capi.include_dir()], extra_cflags=["-O2"],
                                    build_directory=str(where), verbose=False)
    except Exception as exc:
        raise CompiledBackendUnavailable(f"dfccl.torch: building the compiled backend in {where} failed: {exc}. "
                                         f"Set {IMPL_ENV}=python to use the Python backend.") from exc
    print("dfccl.torch: compiled backend built.", file=sys.stderr, flush=True)
    return module
