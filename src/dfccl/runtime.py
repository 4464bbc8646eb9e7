"""The devices and the per-device daemons of this process."""

from __future__ import annotations

import atexit
import os
import sys
import threading
from importlib import resources
from pathlib import Path
from typing import Mapping

from dfccl import kernel_image
from dfccl._deprecated import renamed_attributes
from dfccl.errors import BackendError, InvalidArgumentError
from dfccl.options import DaemonOptions, link_ahead, link_block
from dfccl.policy import default_policy

__all__ = ["default_backend", "device_count", "get_device", "get_daemon", "shutdown", "device_synchronize",
           "compute_capability", "driver_ok", "nvrtc_cubin", "daemon_image", "read_daemon_image"]

# Old names, one release (design decision 43).
__getattr__ = renamed_attributes(__name__, {"get_context": "get_daemon"})

_lock = threading.RLock()
_daemons: dict = {}
_devices: dict = {}
_cuda_count: int | None = None

SIM_DEVICES_DEFAULT = 4


_NOT_LOADED = object()
_cuda_mod: object = _NOT_LOADED


def _cuda_module():
    """The CUDA backend's module, or None where it was not built; looked up
    once (the plain call asks for every collective)."""
    global _cuda_mod
    if _cuda_mod is _NOT_LOADED:
        try:
            from dfccl._native import cuda_device
        except ImportError:
            cuda_device = None
        _cuda_mod = cuda_device
    return _cuda_mod


def cuda_device_count() -> int:
    global _cuda_count
    if _cuda_count is None:
        mod = _cuda_module()
        _cuda_count = mod.device_count() if mod is not None else 0
    return _cuda_count


def default_backend() -> str:
    """The backend used where none is named.

    Returns:
        "cuda" when a GPU is visible (and the CUDA backend was built), else
        "sim"; DFCCL_BACKEND overrides.
    """
    env = os.environ.get("DFCCL_BACKEND")
    if env:
        return resolve_backend(env)
    return "cuda" if cuda_device_count() > 0 else "sim"


def resolve_backend(name: str | None) -> str:
    if name is None:
        return default_backend()
    if name not in ("cuda", "sim"):
        raise InvalidArgumentError(f"backend must be 'cuda' or 'sim', not {name!r}")
    if name == "cuda" and cuda_device_count() == 0:
        raise BackendError("the cuda backend needs a visible GPU and the CUDA driver"
                           + ("" if _cuda_module() else " (dfccl was built without cuda.h)"))
    return name


def device_count(backend: str | None = None) -> int:
    """How many devices a backend offers.

    Args:
        backend: "cuda", "sim" or None (the default backend).

    Returns:
        The GPUs visible (cuda), or the simulated GPUs the demo uses (sim:
        DFCCL_SIM_DEVICES, default 4; any device number works in the simulator).
    """
    backend = resolve_backend(backend)
    if backend == "cuda":
        return cuda_device_count()
    return int(os.environ.get("DFCCL_SIM_DEVICES", SIM_DEVICES_DEFAULT))


# -- the daemon kernel image -----------------------------------------------------
def _kernel_dir():
    return resources.files("dfccl") / "_kernels"


#: NVRTC's options besides the architecture and the include folders (which
#: depend on where dfccl is installed and shape nothing else).
NVRTC_OPTIONS = ("-std=c++17", "-default-device")


#: How a cubin and a fatbin begin (cuModuleLoadData also takes PTX text).
_IMAGE_MAGICS = (b"\x7fELF", b"\x50\xed\x55\xba")


def daemon_image(compute_capability: int, environ: Mapping[str, str] | None = None) -> bytes:
    """The daemon module: the file $DFCCL_DAEMON_IMAGE names, else the
    fatbin built by nvcc at install, else the shipped sources compiled with
    NVRTC (cuda.bindings.nvrtc), once per architecture and source version
    (kernel_image.cache_dir())."""
    env = os.environ if environ is None else environ
    override = env.get(kernel_image.DAEMON_IMAGE_ENV, "")
    if override:
        return read_daemon_image(override)
    fatbin = _kernel_dir() / "daemon.fatbin"
    if fatbin.is_file() and not env.get(kernel_image.FORCE_NVRTC_ENV):
        return fatbin.read_bytes()
    return _nvrtc_image(compute_capability)


def read_daemon_image(path: str | os.PathLike) -> bytes:
    """The daemon image at ``path`` (a cubin, a fatbin or PTX text), or
    BackendError saying why it cannot be one, before the driver is asked
    to load it."""
    where = f"{kernel_image.DAEMON_IMAGE_ENV}={path}"
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise BackendError(f"{where}: the daemon image cannot be read ({exc.strerror or exc})") from exc
    if data[:4] in _IMAGE_MAGICS or (data.lstrip()[:1] in (b"/", b".") and b".entry dfccl_daemon" in data):
        return data
    raise BackendError(f"{where}: not a daemon image (expected a cubin, a fatbin or PTX of dfccl_daemon, "
                       f"as nvcc builds from cuda/daemon/daemon_kernel.cu; the file has {len(data)} bytes)")


def nvrtc_cache_path(src_dir: str | os.PathLike, cc: int, nvrtc_version: tuple[int, int],
                     environ: Mapping[str, str] | None = None) -> Path:
    """Where the NVRTC image of the sources in ``src_dir`` for sm_``cc`` is
    kept: its name holds a key of the sources, the architecture, NVRTC's
    version and the options."""
    key = kernel_image.cache_key(kernel_image.tree_digest(src_dir), f"sm_{cc}",
                                 "nvrtc %d.%d" % tuple(nvrtc_version), *NVRTC_OPTIONS)
    return kernel_image.cache_dir(environ) / f"daemon-sm_{cc}-{key}.cubin"


def _nvrtc_image(cc: int) -> bytes:
    try:
        from cuda.bindings import nvrtc
        err, major, minor = nvrtc.nvrtcVersion()
    except Exception as exc:  # no bindings, or no libnvrtc to load
        raise BackendError(f"no daemon fatbin was built at install and NVRTC is unavailable ({exc}); "
                           "install the CUDA toolkit's NVRTC, or reinstall dfccl with nvcc on PATH") from exc
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise BackendError(f"nvrtcVersion failed: {err}")
    src_dir = Path(str(_kernel_dir() / "src"))
    path = nvrtc_cache_path(src_dir, cc, (major, minor))

    def announce() -> None:
        print(f"dfccl: compiling the daemon kernel for sm_{cc} with NVRTC {major}.{minor} "
              f"(once; cached in {path.parent})", file=sys.stderr, flush=True)

    image, _hit = kernel_image.cached_build(path, lambda: _nvrtc_compile(nvrtc, src_dir, cc), announce)
    return image


def _nvrtc_compile(nvrtc, src_dir: Path, cc: int) -> bytes:
    source = (src_dir / "daemon" / "daemon_kernel.cu").read_bytes()
    return nvrtc_cubin(source, "daemon_kernel.cu", cc,
                       [o.encode() for o in NVRTC_OPTIONS] + [b"-I" + str(src_dir / "include").encode(),
                                                             b"-I" + str(src_dir / "daemon").encode()])


def driver_ok(result: tuple, what: str):
    """A cuda.bindings driver call's result without its CUresult (None, one
    value or a tuple), or BackendError naming the call."""
    from cuda.bindings import driver

    err, *rest = result
    if err != driver.CUresult.CUDA_SUCCESS:
        raise BackendError(f"{what} failed: {err}", driver_code=int(err))
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else tuple(rest)


def nvrtc_cubin(source: bytes, name: str, compute_capability: int, options: list[bytes]) -> bytes:
    """``source`` compiled by NVRTC into a cubin for sm_<compute_capability>."""
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:
        raise BackendError(f"compiling {name} needs cuda.bindings.nvrtc, which is unavailable") from exc

    def ok(result, what):
        err, *rest = result
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise BackendError(f"NVRTC {what} failed: {err}")
        return rest[0] if len(rest) == 1 else rest

    try:
        created = nvrtc.nvrtcCreateProgram(source, name.encode(), 0, [], [])
    except RuntimeError as exc:  # the bindings load libnvrtc on first use
        raise BackendError(f"compiling {name} needs NVRTC, which cannot be loaded: {exc}") from exc
    prog = ok(created, "nvrtcCreateProgram")
    try:
        opts = [f"--gpu-architecture=sm_{compute_capability}".encode(), *options]
        err, = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            size = ok(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
            log = b" " * size
            ok(nvrtc.nvrtcGetProgramLog(prog, log), "nvrtcGetProgramLog")
            raise BackendError(f"NVRTC could not compile {name} for sm_{compute_capability}:\n"
                               f"{log.decode(errors='replace')}")
        size = ok(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        cubin = b" " * size
        ok(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        return cubin
    finally:
        ok(nvrtc.nvrtcDestroyProgram(prog), "nvrtcDestroyProgram")


# -- devices and daemons --------------------------------------------------------------
def get_device(backend: str, device: int, blocks: int | None = None):
    key = (backend, device)
    with _lock:
        dev = _devices.get(key)
        if dev is None:
            if device < 0:
                raise InvalidArgumentError(f"device must be >= 0, not {device}")
            if backend == "cuda":
                if _cuda_forked_from:
                    raise BackendError(f"this process was forked by process {_cuda_forked_from} after dfccl had "
                                       "initialised CUDA there, and CUDA cannot be used in such a child: start "
                                       "workers that use GPUs with multiprocessing's 'spawn' (or 'forkserver') "
                                       "method")
                mod = _cuda_module()
                if device >= cuda_device_count():
                    raise InvalidArgumentError(f"cuda device {device} does not exist ({cuda_device_count()} visible)")
                dev = mod.CudaDevice(device, daemon_image(compute_capability(device)), blocks or 0)
            else:
                from dfccl._native.sim_device import SimDevice
                dev = SimDevice(device, blocks or 2)
            _devices[key] = dev
        return dev


def compute_capability(device: int) -> int:
    """major * 10 + minor of CUDA device ``device`` (90 for sm_90)."""
    from cuda.bindings import driver

    attr = driver.CUdevice_attribute
    dev = driver_ok(driver.cuDeviceGet(device), "cuDeviceGet")
    major = driver_ok(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev),
                      "cuDeviceGetAttribute(COMPUTE_CAPABILITY_MAJOR)")
    minor = driver_ok(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev),
                      "cuDeviceGetAttribute(COMPUTE_CAPABILITY_MINOR)")
    return major * 10 + minor


def get_daemon(backend: str, device: int, options: DaemonOptions | None = None):
    """The daemon of (backend, device) in this process, created on
    first use with ``options`` (later callers must pass equal options or
    None)."""
    from dfccl._native.daemon import Daemon

    key = (backend, device)
    with _lock:
        entry = _daemons.get(key)
        if entry is not None:
            daemon, opts = entry
            if options is not None and options != opts:
                raise InvalidArgumentError(
                    f"the daemon of {backend}:{device} already runs with {opts}; a communicator asked for {options}. "
                    "Daemon options are per device and process: use the same ones (or another device).")
            return daemon
        opts = options or DaemonOptions()
        dev = get_device(backend, device, opts.blocks)
        blocks = opts.blocks or dev.default_blocks
        daemon = Daemon(dev, blocks=blocks, slots=opts.max_outstanding, max_endpoints=opts.max_endpoints,
                        policy=default_policy(backend, opts), link_ahead=link_ahead(opts),
                        link_block=link_block(opts, dev.resident_blocks or None, blocks))
        _daemons[key] = (daemon, opts)
        return daemon


def shutdown() -> None:
    """Stops every daemon of this process and frees its memory.  Pending
    collectives fail with AbortedError.  Runs at interpreter exit."""
    with _lock:
        entries = list(_daemons.items())
        _daemons.clear()
        devices = list(_devices.values())
        _devices.clear()
    for _, (daemon, _opts) in entries:
        try:
            daemon.close()
        except Exception:
            pass
    for dev in devices:
        try:
            dev.close()
        except Exception:
            pass


atexit.register(shutdown)

# -- fork -----------------------------------------------------------------------
# A forked child inherits this module's daemons and devices, but not their
# threads, their daemons, nor (on GPUs) CUDA or its pinned memory.  Left as
# they are, the child's exit would close them (ten seconds waiting for a
# daemon that is not there, CUDA calls that are not allowed, the parent's
# shared-memory files unlinked) and a collective on one would never
# complete.  So the child forgets them: they count as closed, their pending
# Works fail, nothing of theirs is freed, and new communicators get new
# daemons (liveness.py marks the communicators).
_inherited: list = []          # the parent's objects, kept so that nothing of theirs is collected here
_cuda_forked_from = 0          # the parent's pid, if dfccl had initialised CUDA there


def _forget_in_child() -> None:
    global _lock, _cuda_forked_from
    _lock = threading.RLock()   # another thread may have held it at the fork
    parent = os.getppid()
    for daemon, _opts in _daemons.values():
        daemon.forget_after_fork(parent)
        _inherited.append(daemon)
    for (name, _device), dev in _devices.items():
        dev.forget_after_fork()
        _inherited.append(dev)
        if name == "cuda":
            _cuda_forked_from = parent
    _daemons.clear()
    _devices.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def device_synchronize(backend: str, device: int) -> None:
    """A device-wide synchronisation (cuCtxSynchronize; in the simulator: wait
    until the daemon is not running).  Returns once the daemon has left the
    device, which it does when it makes no progress: that is what keeps such
    syncs from deadlocking with peers.

    Args:
        backend: "cuda" or "sim".
        device: the device to synchronise.
    """
    dev = get_device(backend, device)
    if backend == "cuda":
        dev.context_synchronize()
    else:
        dev.synchronize()


def cuda_pointer_info(ptr: int):
    """CUDA ordinal of the device memory at ``ptr``, or None if it is not
    device memory."""
    mod = _cuda_module()
    if mod is None or cuda_device_count() == 0:
        return None
    return mod.pointer_device(ptr)
