"""``dfccl info``: versions, GPUs, peer access, the daemon kernel image and
the defaults the daemon runs with.  Prints what it can on a machine without
a GPU (the simulator's defaults) and never fails on a missing piece."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from importlib import metadata, resources
from pathlib import Path
from typing import TextIO

from dfccl import kernel_image

__all__ = ["collect_info", "print_info", "kernel_image_info", "nccl_version"]


def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _driver_version() -> str:
    try:
        from cuda.bindings import driver

        err, = driver.cuInit(0)
        if err != driver.CUresult.CUDA_SUCCESS:
            return f"not available ({err.name if hasattr(err, 'name') else err})"
        err, v = driver.cuDriverGetVersion()
        if err != driver.CUresult.CUDA_SUCCESS:
            return "unknown"
        return f"{v // 1000}.{v % 1000 // 10}"
    except Exception as exc:  # no libcuda, no cuda-bindings
        return f"not available ({type(exc).__name__})"


def nccl_version() -> str:
    """NCCL as torch, CuPy or an nvidia-nccl wheel provides it, else "not found"."""
    found = []
    try:
        import torch

        found.append(("torch", ".".join(str(x) for x in torch.cuda.nccl.version())))
    except Exception:
        pass
    try:
        from cupy.cuda import nccl

        v = nccl.get_version()
        found.append(("cupy", f"{v // 10000}.{v // 100 % 100}.{v % 100}"))
    except Exception:
        pass
    for wheel in ("nvidia-nccl-cu13", "nvidia-nccl-cu12"):
        v = _dist_version(wheel)
        if v:
            found.append((wheel, v))
    if not found:
        return "not found (torch, cupy and nvidia-nccl are absent)"
    return ", ".join(f"{v} (via {src})" for src, v in found)


def kernel_image_info() -> dict:
    """Where the daemon image is and which architectures it holds: the
    file $DFCCL_DAEMON_IMAGE names, else the fatbin built at install."""
    override = os.environ.get(kernel_image.DAEMON_IMAGE_ENV, "")
    path = Path(override) if override else resources.files("dfccl") / "_kernels" / "daemon.fatbin"
    if override and not path.is_file():
        return {"path": str(path), "architectures": [],
                "note": f"{kernel_image.DAEMON_IMAGE_ENV} names a file that does not exist: the cuda backend "
                        "will refuse to start"}
    if not path.is_file():
        return {"path": None, "architectures": [],
                "note": "no fatbin built at install (no GPU or nvcc there, or DFCCL_SKIP_KERNEL=1): the cuda "
                        f"backend compiles the daemon with NVRTC at first use, cached in {kernel_image.cache_dir()}"}
    info = {"path": str(path), "architectures": [], "note": ""}
    tool = shutil.which("cuobjdump")
    if tool is None:
        info["note"] = "architectures unknown (cuobjdump not found)"
    else:
        archs: set[str] = set()
        for flag in ("--list-elf", "--list-ptx"):
            try:
                out = subprocess.run([tool, flag, str(path)], capture_output=True, text=True, timeout=30).stdout
            except (OSError, subprocess.SubprocessError):
                continue
            kind = "ptx" if flag == "--list-ptx" else "sass"
            archs.update(f"{m} ({kind})" for m in re.findall(r"sm_\d+[a-z]?", out))
        info["architectures"] = sorted(archs)
        info["resources"] = _kernel_resources(tool, str(path))
        if not archs:
            info["note"] = "architectures unknown (cuobjdump listed none)"
    if override:
        chosen = (f"{kernel_image.DAEMON_IMAGE_ENV} is set: the cuda backend loads this image instead of the "
                  "installed one")
        info["note"] = "; ".join(n for n in (info["note"], chosen) if n)
    elif os.environ.get(kernel_image.FORCE_NVRTC_ENV):
        info["note"] = f"{kernel_image.FORCE_NVRTC_ENV} is set: the daemon is compiled with NVRTC instead, " \
                       f"cached in {kernel_image.cache_dir()}"
    return info


def _kernel_resources(tool: str, path: str) -> dict:
    """Registers, stack and shared memory of dfccl_daemon per architecture
    (``cuobjdump -res-usage``): {"sm_90": {"REG": 122, "STACK": 224, ...}}."""
    try:
        out = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    found: dict[str, dict] = {}
    arch = None
    lines = out.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"\s*arch = (sm_\d+[a-z]?)", line)
        if m:
            arch = m.group(1)
        if "Function dfccl_daemon" in line and arch and i + 1 < len(lines):
            found[arch] = {k: int(v) for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", lines[i + 1])}
    return found


def _gpus() -> tuple[list[dict], list[list[bool]]]:
    from dfccl import runtime

    n = runtime.cuda_device_count()
    if n == 0:
        return [], []
    from cuda.bindings import driver

    driver.cuInit(0)
    attr = driver.CUdevice_attribute
    gpus, handles = [], []
    for d in range(n):
        _, dev = driver.cuDeviceGet(d)
        handles.append(dev)
        _, raw = driver.cuDeviceGetName(96, dev)
        _, major = driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
        _, minor = driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)
        _, sms = driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev)
        _, mem = driver.cuDeviceTotalMem(dev)
        gpus.append({"index": d, "name": raw.split(b"\0", 1)[0].decode(), "cc": f"{major}.{minor}", "sms": sms,
                     "memory_gib": round(mem / (1 << 30), 1), "default_blocks": max(1, min(32, sms // 4))})
    peer = [[i == j or bool(driver.cuDeviceCanAccessPeer(handles[i], handles[j])[1]) for j in range(n)]
            for i in range(n)]
    return gpus, peer


def _defaults(backend: str) -> dict:
    from dfccl.options import CommOptions, DaemonOptions
    from dfccl.planning import default_ll_max_bytes
    from dfccl.policy import default_policy

    pol = default_policy(backend, DaemonOptions())
    comm = CommOptions().resolved(backend)
    return {"blocks": "a quarter of the SMs, at most 32" if backend == "cuda" else "2",
            "base_window_us": pol.base_window_ns / 1000, "window_range_us": (pol.min_base_ns / 1000,
                                                                              pol.max_base_ns / 1000),
            "max_window_us": pol.max_window_ns / 1000, "idle_quit_us": pol.idle_quit_ns / 1000,
            "empty_quit_us": pol.empty_quit_ns / 1000,
            "max_outstanding": DaemonOptions().max_outstanding, "staging_mib": comm.staging_bytes / (1 << 20),
            "one_shot_kib": comm.one_shot_bytes / 1024, "bytes_per_channel_kib": comm.bytes_per_channel / 1024,
            "ll_max_bytes_2_ranks": default_ll_max_bytes(2 * DaemonOptions().max_outstanding, 2,
                                                         comm.ll_memory_bytes),
            "ll_memory_mib": comm.ll_memory_bytes / (1 << 20)}


def _network() -> dict:
    """This host's identity and UCX for ranks on other hosts (dfccl.net)."""
    from dfccl import net
    from dfccl.net import _build

    info = {"host_id": net.host_id(), "host_id_from": net.HOST_ID_ENV if os.environ.get(net.HOST_ID_ENV)
            else "hostname and boot id", "ucx": None, "proxy": None,
            "ucx_tls": os.environ.get("UCX_TLS", "UCX's choice"), "ucx_settings": None, "inline_bytes": None,
            "lanes": None}
    try:
        root = _build.ucx_root()
        info["ucx"] = f"{(root / 'UCX_WHEEL_VERSION.txt').read_text().strip()} ({root})"
        path = _build.library_path()
        info["proxy"] = str(path) if path.is_file() else "not built yet (python -m dfccl.net builds it)"
        if path.is_file():
            from dfccl.errors import InvalidArgumentError
            from dfccl.net.link import inline_bytes, lanes, ucx_settings

            info["ucx_settings"] = [{"name": n, "value": v, "from": f} for n, v, f in ucx_settings()]
            for key, read in (("inline_bytes", inline_bytes), ("lanes", lanes)):
                try:
                    value, source = read()
                    info[key] = {"value": value, "from": source}
                except InvalidArgumentError as exc:
                    info[key] = {"value": None, "from": str(exc)}
    except net.NetUnavailableError as exc:
        info["ucx"] = f"not available: {exc}"
    return info


def collect_info() -> dict:
    import dfccl
    from dfccl import runtime

    try:
        gpus, peer = _gpus()
        gpu_error = None
    except Exception as exc:
        gpus, peer, gpu_error = [], [], f"{type(exc).__name__}: {exc}"
    try:
        default = runtime.default_backend()
    except Exception as exc:
        default = f"unknown ({exc})"
    return {
        "versions": {"dfccl": dfccl.__version__, "python": sys.version.split()[0],
                     "numpy": _dist_version("numpy"), "cuda-bindings": _dist_version("cuda-bindings"),
                     "cuda driver": _driver_version(), "nccl": nccl_version(),
                     "ml_dtypes": _dist_version("ml-dtypes") or "not installed (numpy bfloat16 needs it)"},
        "default_backend": default,
        "gpus": gpus,
        "gpu_error": gpu_error,
        "peer_access": peer,
        "kernel": kernel_image_info(),
        "network": _network(),
        "defaults": {b: _defaults(b) for b in (("cuda", "sim") if gpus else ("sim",))},
    }


def print_info(out: TextIO = sys.stdout) -> dict:
    info = collect_info()
    p = lambda *a: print(*a, file=out)  # noqa: E731
    p("versions:")
    for name, v in info["versions"].items():
        p(f"  {name:14} {v if v is not None else 'not installed'}")
    p(f"default backend: {info['default_backend']}")
    if info["gpus"]:
        p(f"GPUs: {len(info['gpus'])}")
        for g in info["gpus"]:
            p(f"  cuda:{g['index']}  {g['name']}  cc {g['cc']}  {g['sms']} SMs  {g['memory_gib']} GiB  "
              f"default daemon blocks {g['default_blocks']}")
        n = len(info["gpus"])
        p("peer access (row: from, column: to):")
        p("        " + " ".join(f"{j:>4}" for j in range(n)))
        for i, row in enumerate(info["peer_access"]):
            p(f"  {i:>4}  " + " ".join(f"{'yes' if ok else 'no':>4}" for ok in row))
    else:
        p("GPUs: none visible" + (f" ({info['gpu_error']})" if info["gpu_error"] else "")
          + "; the sim backend runs simulated GPUs on host threads")
    k = info["kernel"]
    p(f"kernel image: {k['path'] or 'none'}")
    if k["architectures"]:
        p(f"  architectures: {', '.join(k['architectures'])}")
    for arch, r in sorted(k.get("resources", {}).items()):
        p(f"  {arch}: {r.get('REG', '?')} registers per thread, {r.get('STACK', '?')} B stack, "
          f"{r.get('SHARED', '?')} B shared memory per block")
    if k["note"]:
        p(f"  {k['note']}")
    n = info["network"]
    p(f"network: host id {n['host_id']} ({n['host_id_from']}); peers with another host id are reached over "
      "UCX (Communicator.transports: 'ucx')")
    p(f"  UCX: {n['ucx']}; transports {n['ucx_tls']}")
    if n["proxy"]:
        p(f"  proxy: {n['proxy']}")
    if n["ucx_settings"]:
        p("  UCX settings of the proxy: " + ", ".join(f"{u['name']}={u['value']} ({u['from']})"
                                                      for u in n["ucx_settings"]))
    for key, label in (("inline_bytes", "bytes a message carries in its header"),
                       ("lanes", "proxy lanes (threads and connections per peer)")):
        if n[key]:
            v = n[key]
            p(f"  {label}: {v['value']} ({v['from']})" if v["value"] is not None else f"  {label}: {v['from']}")
    for backend, d in info["defaults"].items():
        p(f"defaults ({backend}):")
        p(f"  daemon blocks per device: {d['blocks']}; max outstanding collectives: {d['max_outstanding']}")
        p(f"  preemption window: base {d['base_window_us']:g} us (adapts within {d['window_range_us'][0]:g}.."
          f"{d['window_range_us'][1]:g} us), at most {d['max_window_us']:g} us; idle quit {d['idle_quit_us']:g} us "
          f"({d['empty_quit_us']:g} us with nothing left to run)")
        p(f"  ring staging {d['staging_mib']:g} MiB per rank; one-shot all_reduce up to {d['one_shot_kib']:g} KiB; "
          f"one channel per {d['bytes_per_channel_kib']:g} KiB")
        p(f"  LL protocol up to {d['ll_max_bytes_2_ranks']} bytes per rank with 2 ranks (LL region "
          f"{d['ll_memory_mib']:g} MiB per rank; fewer max_tags allow more, up to 4096)")
    return info
