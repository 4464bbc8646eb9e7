"""The network proxy's native library (csrc/proxy.cpp and the headers it
includes): compiled on first use against the UCX of the ``libucx`` wheel
(the ``[net]`` extra) with the system C++ compiler, and kept in dfccl's
cache under a key of everything that shapes it (the sources, dfccl's
headers, the UCX wheel's version and place, the compiler).  Design
decision 45 says why at first use."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from dfccl.errors import BackendError
from dfccl.kernel_image import cache_dir, cache_key, cached_build, include_dir, tree_digest

__all__ = ["EXTRA", "NetUnavailableError", "ucx_root", "library_path", "load"]

#: What to install for ranks on other hosts.
EXTRA = "dfccl[net]"

_SOURCES = Path(__file__).parent / "csrc"


class NetUnavailableError(BackendError):
    """Ranks on other hosts need UCX and a C++ compiler; the message names
    what is missing (``pip install "dfccl[net]"`` installs UCX)."""


def ucx_root() -> Path:
    """The ``libucx`` wheel's folder (include/, lib/, bin/ucx_perftest)."""
    try:
        import libucx
    except ImportError:
        raise NetUnavailableError(
            f"dfccl: ranks on other hosts talk through UCX, which is not installed: pip install \"{EXTRA}\" "
            "(the libucx-cu13 wheel)") from None
    return Path(libucx.__file__).parent


def _compiler() -> str:
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise NetUnavailableError(f"dfccl: the network proxy is compiled on first use, but no C++ compiler is on "
                                  f"PATH ({cxx!r}); install g++ or clang++, or set CXX")
    return cxx


def library_path() -> Path:
    """Where this UCX's build of the proxy is kept."""
    root = ucx_root()
    headers = Path(include_dir()) / "dfccl"
    key = cache_key(tree_digest(_SOURCES, headers / "net.h", headers / "abi.h", headers / "host_signals.h"), str(root),
                    (root / "UCX_WHEEL_VERSION.txt").read_text().strip(), _compiler(), sys.platform)
    return cache_dir() / "net" / key / "libdfccl_net.so"


def _compile(root: Path) -> bytes:
    lib = root / "lib"
    with tempfile.TemporaryDirectory(prefix="dfccl-net-") as tmp:
        out = os.path.join(tmp, "libdfccl_net.so")
        # One translation unit: proxy.cpp includes the other pieces (csrc/*.h,
        # found beside it), so they keep internal linkage (the library exports
        # the dfccl_net_* functions alone) and the compiler sees the whole
        # data path to inline, which separate objects would hide from it.
        cmd = [_compiler(), "-O2", "-std=c++17", "-shared", "-fPIC", f"-I{include_dir()}", f"-I{root / 'include'}",
               str(_SOURCES / "proxy.cpp"), "-o", out, f"-L{lib}", "-lucp", "-lucs", f"-Wl,-rpath,{lib}", "-lpthread"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise NetUnavailableError(f"dfccl: compiling the network proxy failed ({' '.join(cmd)}):\n{done.stderr}")
        return Path(out).read_bytes()


_loaded: ctypes.CDLL | None = None


def load() -> ctypes.CDLL:
    """The proxy library, built first if this UCX has none yet (seconds)."""
    global _loaded
    if _loaded is None:
        root = ucx_root()
        path = library_path()
        cached_build(path, lambda: _compile(root),
                     lambda: print(f"dfccl: compiling the network proxy into {path.parent} (once per UCX)...",
                                   file=sys.stderr, flush=True))
        _loaded = ctypes.CDLL(str(path))
    return _loaded
