"""Where the daemon kernel's machine code comes from, and where it is kept.

* At install (setup.py) nvcc builds ``daemon.fatbin`` only where it will be
  used: a GPU is present, or ``DFCCL_CUDA_ARCHS`` asks for architectures
  (:func:`kernel_build_plan`).  Elsewhere only the sources are shipped.
* At run time, without a fatbin, the CUDA backend compiles the shipped sources
  with NVRTC for the GPU's architecture, once: the image is kept in
  :func:`cache_dir` under a key of everything that shapes it.

Both compilers go through :func:`cached_build`, so unchanged sources are never
compiled twice.  Standard library only: setup.py loads this file by path,
before dfccl is built.
"""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Mapping

__all__ = ["CACHE_DIR_ENV", "CUDA_ARCHS_ENV", "SKIP_KERNEL_ENV", "FORCE_NVRTC_ENV", "DAEMON_IMAGE_ENV",
           "DEFAULT_CUDA_ARCHS", "cache_dir", "include_dir", "tree_digest", "cache_key", "atomic_write",
           "cached_build", "gpu_present", "kernel_build_plan"]

#: Overrides where run-time compiled images are kept.
CACHE_DIR_ENV = "DFCCL_CACHE_DIR"
#: Architectures for nvcc ("90" or "80;90"); set, it makes the install build the fatbin.
CUDA_ARCHS_ENV = "DFCCL_CUDA_ARCHS"
#: Set (not "0"), the install builds no fatbin even where a GPU is present.
SKIP_KERNEL_ENV = "DFCCL_SKIP_KERNEL"
#: Set, the CUDA backend compiles the daemon with NVRTC even where a fatbin was built.
FORCE_NVRTC_ENV = "DFCCL_FORCE_NVRTC"
#: A daemon image that the CUDA backend loads instead of the installed one:
#: a build with the step profile or line information, say, made from the
#: installed package's sources (docs/profiling.md, "Another daemon image").
DAEMON_IMAGE_ENV = "DFCCL_DAEMON_IMAGE"
#: What a GPU machine's install builds when no architectures are asked for.
DEFAULT_CUDA_ARCHS = ("80", "90")

# Hex digits of the key in a cached file's name: 128 bits.
_KEY_CHARS = 32


def _is_set(environ: Mapping[str, str], name: str) -> bool:
    return environ.get(name, "") not in ("", "0")


def cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """$DFCCL_CACHE_DIR, else $XDG_CACHE_HOME/dfccl, else ~/.cache/dfccl."""
    env = os.environ if environ is None else environ
    if env.get(CACHE_DIR_ENV):
        return Path(env[CACHE_DIR_ENV])
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dfccl"


def tree_digest(*paths: str | os.PathLike) -> str:
    """SHA-256 over every file under ``paths`` (files or folders): names
    relative to their root and contents, in a fixed order, so the same
    sources give the same digest wherever they are installed."""
    h = hashlib.sha256()
    for root in map(Path, paths):
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for f in files:
            rel = f.name if f == root else f.relative_to(root).as_posix()
            data = f.read_bytes()
            h.update(f"{rel}\0{len(data)}\0".encode())
            h.update(data)
    return h.hexdigest()


def cache_key(*parts: str) -> str:
    """One key for everything that shapes a compiled image (source digest,
    architecture, compiler version, flags): any change gives another key."""
    h = hashlib.sha256()
    for part in parts:
        b = str(part).encode()
        h.update(f"{len(b)}\0".encode())
        h.update(b)
    return h.hexdigest()[:_KEY_CHARS]


def atomic_write(path: str | os.PathLike, data: bytes, mode: int = 0o644) -> None:
    """Writes ``path`` whole or not at all: a temporary file in the same
    folder, renamed over it, so a reader (another process compiling the same
    image) never sees a partial file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def cached_build(path: str | os.PathLike, build: Callable[[], bytes],
                 announce: Callable[[], None] | None = None) -> tuple[bytes, bool]:
    """The image kept at ``path``, else ``build()``'s (after ``announce()``),
    kept there for next time.  Returns (image, hit).  A cache that cannot be
    written costs the next run a compile, never this one its image."""
    path = Path(path)
    try:
        data = path.read_bytes()
        if data:
            return data, True
    except OSError:
        pass
    if announce is not None:
        announce()
    data = build()
    try:
        atomic_write(path, data)
    except OSError as exc:
        print(f"dfccl: could not keep the compiled image in {path.parent}: {exc}", file=sys.stderr)
    return data, False


def include_dir() -> str:
    """Where dfccl's C headers (``<dfccl/...>``) are: those shipped with the
    package, or those of a source checkout."""
    here = os.path.dirname(os.path.abspath(__file__))
    for d in (os.path.join(here, "_kernels", "src", "include"),
              os.path.join(os.path.dirname(os.path.dirname(here)), "cuda", "include")):
        if os.path.isfile(os.path.join(d, "dfccl", "dfccl_api.h")):
            return d
    raise FileNotFoundError("dfccl/dfccl_api.h is neither shipped with this package nor in a source checkout")


def gpu_present() -> bool:
    """Whether this machine has an NVIDIA GPU: a device node, ``nvidia-smi
    -L``, or the driver through cuda.bindings (importable only outside pip's
    build isolation)."""
    if glob.glob("/dev/nvidia[0-9]*"):
        return True
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            out = ""
        if any(line.startswith("GPU ") for line in out.splitlines()):
            return True
    try:
        from cuda.bindings import driver
        err, = driver.cuInit(0)
        if err == driver.CUresult.CUDA_SUCCESS:
            err, count = driver.cuDeviceGetCount()
            return err == driver.CUresult.CUDA_SUCCESS and count > 0
    except Exception:  # no bindings, no driver library: no usable GPU either way
        pass
    return False


def kernel_build_plan(environ: Mapping[str, str], nvcc: str | None,
                      has_gpu: Callable[[], bool]) -> tuple[list[str], str]:
    """The architectures the install builds the fatbin for (empty: none) and
    why.  ``has_gpu`` is asked only when it decides."""
    if _is_set(environ, SKIP_KERNEL_ENV):
        return [], f"{SKIP_KERNEL_ENV} is set"
    asked = environ.get(CUDA_ARCHS_ENV, "")
    if asked.strip():
        archs = [a.strip() for a in asked.replace(",", ";").split(";") if a.strip()]
        if nvcc is None:
            raise RuntimeError(f"{CUDA_ARCHS_ENV}={asked} asks for a kernel build, but nvcc was not found "
                               "(put it on PATH or set CUDA_HOME)")
        return archs, f"{CUDA_ARCHS_ENV}={asked}"
    if nvcc is None:
        return [], "nvcc was not found"
    if not has_gpu():
        return [], "no GPU here"
    return list(DEFAULT_CUDA_ARCHS), "a GPU is present"
