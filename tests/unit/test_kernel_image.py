"""The daemon image's build decision and its on-disk cache (dfccl.kernel_image),
and the NVRTC compile of the shipped sources, which needs no GPU."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest

from dfccl import kernel_image as ki
from dfccl import runtime
from dfccl.errors import BackendError

ROOT = Path(__file__).resolve().parents[2]
KERNEL_SOURCES = [ROOT / "cuda" / "include", ROOT / "cuda" / "daemon"]


# -- cache location ---------------------------------------------------------------------

def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert ki.cache_dir({}) == tmp_path / "home" / ".cache" / "dfccl"
    assert ki.cache_dir({"XDG_CACHE_HOME": "/xdg"}) == Path("/xdg/dfccl")
    assert ki.cache_dir({"XDG_CACHE_HOME": "/xdg", ki.CACHE_DIR_ENV: "/mine"}) == Path("/mine")
    monkeypatch.setenv(ki.CACHE_DIR_ENV, str(tmp_path / "env"))
    assert ki.cache_dir() == tmp_path / "env"


# -- keys -------------------------------------------------------------------------------

def _copy_sources(dst: Path) -> list[Path]:
    out = []
    for src in KERNEL_SOURCES:
        shutil.copytree(src, dst / src.name)
        out.append(dst / src.name)
    return out


def test_tree_digest_follows_content_not_location(tmp_path):
    a, b = _copy_sources(tmp_path / "a"), _copy_sources(tmp_path / "b")
    base = ki.tree_digest(*a)
    assert base == ki.tree_digest(*b) == ki.tree_digest(*KERNEL_SOURCES)
    kernel = b[1] / "daemon_kernel.cu"
    kernel.write_bytes(kernel.read_bytes() + b"\n")
    assert ki.tree_digest(*b) != base
    kernel.rename(b[1] / "renamed.cu")
    assert ki.tree_digest(*b) not in (base, ki.tree_digest(*a))
    (a[0] / "new.h").write_text("")
    assert ki.tree_digest(*a) != base
    # A single file is a root of its own.
    assert ki.tree_digest(a[1] / "arch.cuh") == ki.tree_digest(b[1] / "arch.cuh")


def test_cache_key_changes_with_every_part():
    parts = ("digest", "sm_90", "nvrtc 13.0", "-std=c++17")
    keys = {ki.cache_key(*parts)}
    for i in range(len(parts)):
        changed = list(parts)
        changed[i] += "x"
        keys.add(ki.cache_key(*changed))
    keys.add(ki.cache_key("ab", "c"))
    keys.add(ki.cache_key("a", "bc"))
    keys.add(ki.cache_key(*parts, "-lineinfo"))
    assert len(keys) == len(parts) + 4
    assert ki.cache_key(*parts) == ki.cache_key(*parts)


def test_nvrtc_cache_path_keys_sources_architecture_and_version(tmp_path):
    src = tmp_path / "src"
    _copy_sources(src)
    env = {ki.CACHE_DIR_ENV: str(tmp_path / "cache")}
    p = runtime.nvrtc_cache_path(src, 90, (13, 0), env)
    assert p.parent == tmp_path / "cache" and p.name.startswith("daemon-sm_90-") and p.suffix == ".cubin"
    assert runtime.nvrtc_cache_path(src, 90, (13, 0), env) == p
    others = {runtime.nvrtc_cache_path(src, 80, (13, 0), env), runtime.nvrtc_cache_path(src, 90, (13, 1), env)}
    (src / "daemon" / "wait.cuh").write_text("// edited\n", encoding="utf-8")
    others.add(runtime.nvrtc_cache_path(src, 90, (13, 0), env))
    assert p not in others and len(others) == 3


# -- writing and reading ------------------------------------------------------------------

def test_atomic_write_replaces_whole_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "deep" / "image.bin"
    ki.atomic_write(path, b"first")
    ki.atomic_write(path, b"second")
    assert path.read_bytes() == b"second"
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    with pytest.raises(TypeError):
        ki.atomic_write(path, "not bytes")  # type: ignore[arg-type]
    assert path.read_bytes() == b"second"
    assert os.listdir(path.parent) == ["image.bin"]


def test_cached_build_compiles_on_a_miss_only(tmp_path):
    path = tmp_path / "c" / "daemon-sm_90-k.cubin"
    calls = []

    def build() -> bytes:
        calls.append("build")
        return b"\x7fELF image"

    image, hit = ki.cached_build(path, build, lambda: calls.append("announce"))
    assert (image, hit) == (b"\x7fELF image", False) and calls == ["announce", "build"]
    assert path.read_bytes() == image
    image, hit = ki.cached_build(path, build, lambda: calls.append("announce"))
    assert (image, hit) == (b"\x7fELF image", True) and calls == ["announce", "build"]
    # An empty file (a disk that filled up) is a miss, not an image.
    path.write_bytes(b"")
    assert ki.cached_build(path, build) == (b"\x7fELF image", False)


def test_cached_build_keeps_nothing_when_the_compile_fails(tmp_path):
    path = tmp_path / "daemon.cubin"

    def broken() -> bytes:
        raise RuntimeError("compile error")

    with pytest.raises(RuntimeError):
        ki.cached_build(path, broken)
    assert not path.exists() and os.listdir(tmp_path) == []
    assert ki.cached_build(path, lambda: b"ok") == (b"ok", False)


def test_cached_build_without_a_writable_cache_still_returns_the_image(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache folder would be")
    image, hit = ki.cached_build(blocker / "daemon.cubin", lambda: b"image")
    assert (image, hit) == (b"image", False)
    assert "could not keep the compiled image" in capsys.readouterr().err


# -- the install's decision -----------------------------------------------------------------

def _no_gpu_question() -> bool:
    raise AssertionError("the GPU probe ran although the environment decided")


@pytest.mark.parametrize("environ, nvcc, gpu, archs", [
    ({}, "/usr/bin/nvcc", False, []),                                   # CPU-only machine with nvcc
    ({}, "/usr/bin/nvcc", True, list(ki.DEFAULT_CUDA_ARCHS)),            # GPU machine
    ({}, None, True, []),                                               # GPU, no nvcc: NVRTC at run time
    ({ki.CUDA_ARCHS_ENV: "90"}, "/usr/bin/nvcc", None, ["90"]),          # asked for: built without a GPU
    ({ki.CUDA_ARCHS_ENV: "80, 90"}, "/usr/bin/nvcc", None, ["80", "90"]),
    ({ki.CUDA_ARCHS_ENV: ""}, "/usr/bin/nvcc", False, []),
    ({ki.SKIP_KERNEL_ENV: "1"}, "/usr/bin/nvcc", None, []),
    ({ki.SKIP_KERNEL_ENV: "1", ki.CUDA_ARCHS_ENV: "90"}, "/usr/bin/nvcc", None, []),
    ({ki.SKIP_KERNEL_ENV: "0"}, "/usr/bin/nvcc", True, list(ki.DEFAULT_CUDA_ARCHS)),
])
def test_kernel_build_plan(environ, nvcc, gpu, archs):
    got, why = ki.kernel_build_plan(environ, nvcc, _no_gpu_question if gpu is None else (lambda: gpu))
    assert got == archs and why


def test_kernel_build_plan_refuses_asked_architectures_without_nvcc():
    with pytest.raises(RuntimeError, match="nvcc was not found"):
        ki.kernel_build_plan({ki.CUDA_ARCHS_ENV: "90"}, None, _no_gpu_question)


# -- another daemon image ($DFCCL_DAEMON_IMAGE) ----------------------------------------------

@pytest.mark.parametrize("head", [
    b"\x7fELF\x02\x01",                                                                # cubin
    b"\x50\xed\x55\xba\x01\x00",                                                    # fatbin
    b"//\n// Generated by NVIDIA NVVM Compiler\n.version 9.0\n.visible .entry dfccl_daemon(",   # PTX
])
def test_daemon_image_override_takes_a_cubin_a_fatbin_or_ptx(tmp_path, head):
    image = tmp_path / "daemon.img"
    image.write_bytes(head + b"rest of the image")
    env = {ki.DAEMON_IMAGE_ENV: str(image), ki.FORCE_NVRTC_ENV: "1"}   # the override wins over both
    assert runtime.daemon_image(90, env) == head + b"rest of the image"


def test_daemon_image_override_refuses_what_cannot_be_an_image(tmp_path):
    missing = tmp_path / "missing.fatbin"
    with pytest.raises(BackendError, match=r"DFCCL_DAEMON_IMAGE=.*missing\.fatbin: the daemon image cannot be read"):
        runtime.daemon_image(90, {ki.DAEMON_IMAGE_ENV: str(missing)})
    for name, data in (("empty", b""), ("text", b"not a kernel"), ("other.ptx", b"//\n.visible .entry other_kernel(")):
        bad = tmp_path / name
        bad.write_bytes(data)
        with pytest.raises(BackendError, match=f"{name}: not a daemon image .*{len(data)} bytes"):
            runtime.read_daemon_image(bad)


def test_info_names_the_override(tmp_path, monkeypatch):
    from dfccl import info

    monkeypatch.setenv(ki.DAEMON_IMAGE_ENV, str(tmp_path / "absent.fatbin"))
    k = info.kernel_image_info()
    assert k["path"] == str(tmp_path / "absent.fatbin") and "does not exist" in k["note"]
    image = tmp_path / "daemon.cubin"
    image.write_bytes(b"\x7fELF" + bytes(60))
    monkeypatch.setenv(ki.DAEMON_IMAGE_ENV, str(image))
    k = info.kernel_image_info()
    assert k["path"] == str(image) and "DFCCL_DAEMON_IMAGE is set" in k["note"]


# -- NVRTC (a compiler: no GPU needed) ----------------------------------------------------------

def _nvrtc_version():
    try:
        from cuda.bindings import nvrtc
        err, major, minor = nvrtc.nvrtcVersion()
    except Exception as exc:  # no bindings, or no libnvrtc to load
        pytest.skip(f"NVRTC is not loadable here: {exc}")
    return major, minor


@pytest.mark.timeout(1800)  # minutes of one core: more where the cores are shared
def test_shipped_sources_compile_with_nvrtc_once(tmp_path, monkeypatch, capsys):
    """The run-time path of a GPU machine whose install built no fatbin:
    the sources as shipped compile with NVRTC, and a second use reads the
    cache.  Takes minutes (one architecture, the whole daemon)."""
    major, minor = _nvrtc_version()
    src = tmp_path / "pkg" / "_kernels" / "src"
    _copy_sources(src)
    monkeypatch.setattr(runtime, "_kernel_dir", lambda: src.parent)
    monkeypatch.setenv(ki.CACHE_DIR_ENV, str(tmp_path / "cache"))
    image = runtime.daemon_image(90)
    assert image[:4] == b"\x7fELF"
    err = capsys.readouterr().err
    assert f"compiling the daemon kernel for sm_90 with NVRTC {major}.{minor}" in err and str(tmp_path / "cache") in err
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [runtime.nvrtc_cache_path(src, 90, (major, minor)).name]
    assert runtime.daemon_image(90) == image
    assert "compiling" not in capsys.readouterr().err
