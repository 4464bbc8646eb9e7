"""Builds dfccl's Cython extensions and the daemon kernel.

- The daemon sources in cuda/ are compiled twice: by the host compiler into
  the simulator backend (dfccl._native.sim_backend), and by nvcc into a fatbin
  (sm_80 and sm_90 machine code plus PTX) shipped as dfccl/_kernels/daemon.fatbin.
- Where nvcc is missing the fatbin is skipped; at run time the CUDA backend then
  compiles the shipped sources with NVRTC (cuda.bindings.nvrtc).
- DFCCL_CUDA_ARCHS overrides the architectures, e.g. "90" or "80;90".
- DFCCL_LINEINFO=1 builds the fatbin with -lineinfo (source lines in Nsight
  Compute's source view; same machine code otherwise).
- DFCCL_STEP_PROFILE=1 builds the fatbin and the simulator with the step
  profile (Context.daemon_profile: time per LL step and per completion;
  a few clock reads more per run, so off by default).
- DFCCL_SKIP_KERNEL=1 skips the fatbin even where nvcc is present (faster
  builds, CI without GPUs); the sources are still shipped for NVRTC.
"""

import glob
import os
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))
CUDA_SRC = os.path.join(ROOT, "cuda")
CUDA_INCLUDE = os.path.join(CUDA_SRC, "include")


def find_cuda_home():
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var) and os.path.isdir(os.environ[var]):
            return os.environ[var]
    nvcc = shutil.which("nvcc")
    if nvcc:
        home = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
        if os.path.isfile(os.path.join(home, "include", "cuda.h")):
            return home
    if os.path.isfile("/usr/local/cuda/include/cuda.h"):
        return "/usr/local/cuda"
    return None


CUDA_HOME = find_cuda_home()


def nvcc_path():
    found = shutil.which("nvcc")
    if found:
        return found
    if CUDA_HOME and os.path.isfile(os.path.join(CUDA_HOME, "bin", "nvcc")):
        return os.path.join(CUDA_HOME, "bin", "nvcc")
    return None


def cuda_archs():
    spec = os.environ.get("DFCCL_CUDA_ARCHS", "80;90")
    return [a.strip() for a in spec.replace(",", ";").split(";") if a.strip()]


def step_profile_flags():
    """DFCCL_STEP_PROFILE=1: count the daemon's step profile (abi.h, dfccl_step_profile)."""
    return ["-DDFCCL_STEP_PROFILE=1"] if os.environ.get("DFCCL_STEP_PROFILE", "") not in ("", "0") else []


CXX_FLAGS = ["-std=c++17", "-O2", "-Wno-unknown-pragmas"]


def kernel_headers():
    """The C headers every extension includes (directly or, for the simulator,
    the whole daemon): an edit to one rebuilds the extensions that use it."""
    found = []
    for sub in ("include/dfccl", "daemon", "sim"):
        d = os.path.join(CUDA_SRC, sub)
        found += sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith((".h", ".cuh", ".cpp")))
    return found


def extensions():
    headers = kernel_headers()
    common = dict(include_dirs=[CUDA_INCLUDE], language="c++", extra_compile_args=CXX_FLAGS, depends=headers)
    exts = [
        Extension("dfccl._native.backend", ["src/dfccl/_native/backend.pyx"], **common),
        Extension("dfccl._native.work", ["src/dfccl/_native/work.pyx"], **common),
        Extension("dfccl._native.tag_table", ["src/dfccl/_native/tag_table.pyx"], **common),
        Extension("dfccl._native.descriptor", ["src/dfccl/_native/descriptor.pyx"], **common),
        Extension("dfccl._native.launch", ["src/dfccl/_native/launch.pyx"], **common),
        Extension("dfccl._native.hotpath", ["src/dfccl/_native/hotpath.pyx"], **common),
        Extension("dfccl._native.retire", ["src/dfccl/_native/retire.pyx"], **common),
        Extension("dfccl._native.inspection", ["src/dfccl/_native/inspection.pyx"], **common),
        Extension("dfccl._native.endpoints", ["src/dfccl/_native/endpoints.pyx"], **common),
        Extension("dfccl._native.context", ["src/dfccl/_native/context.pyx"], **common),
        Extension("dfccl._native.capi", ["src/dfccl/_native/capi.pyx"], **common),
        Extension("dfccl._native.sim_backend",
                  ["src/dfccl/_native/sim_backend.pyx", "cuda/sim/sim_device.cpp", "cuda/sim/sim_stream.cpp"],
                  include_dirs=[CUDA_INCLUDE, os.path.join(CUDA_SRC, "sim")], language="c++",
                  extra_compile_args=CXX_FLAGS + step_profile_flags() + ["-pthread"], extra_link_args=["-pthread"],
                  depends=headers),
    ]
    # The CUDA backend needs no CUDA headers: it declares the driver ABI itself
    # and resolves entry points at run time (cuda/include/dfccl/cuda_driver.h).
    exts.append(Extension("dfccl._native.cuda_backend", ["src/dfccl/_native/cuda_backend.pyx"], **common))
    from Cython.Build import cythonize
    return cythonize(exts, compiler_directives={"language_level": "3", "embedsignature": True},
                     include_path=["src"])


def compile_kernels(out_dir):
    """nvcc -> daemon.fatbin; returns False (and explains) where nvcc is absent
    or DFCCL_SKIP_KERNEL is set."""
    if os.environ.get("DFCCL_SKIP_KERNEL", "") not in ("", "0"):
        stale = os.path.join(out_dir, "daemon.fatbin")
        if os.path.exists(stale):
            # An older build's fatbin would no longer match the shipped sources.
            os.remove(stale)
        print("dfccl: DFCCL_SKIP_KERNEL is set: the CUDA backend will compile the daemon with NVRTC at run time",
              file=sys.stderr)
        return False
    nvcc = nvcc_path()
    if nvcc is None:
        print("dfccl: nvcc not found: the CUDA backend will compile the daemon with NVRTC at run time",
              file=sys.stderr)
        return False
    os.makedirs(out_dir, exist_ok=True)
    archs = cuda_archs()
    gencode = []
    for a in archs:
        gencode += [f"-gencode=arch=compute_{a},code=sm_{a}"]
    gencode += [f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}"]
    out = os.path.join(out_dir, "daemon.fatbin")
    lineinfo = ["-lineinfo"] if os.environ.get("DFCCL_LINEINFO", "") not in ("", "0") else []
    cmd = [nvcc, "-std=c++17", "-O3", *lineinfo, *step_profile_flags(), "--fatbin", f"-I{CUDA_INCLUDE}", *gencode,
           os.path.join(CUDA_SRC, "daemon", "daemon_kernel.cu"), "-o", out]
    print("dfccl: " + " ".join(cmd), file=sys.stderr)
    subprocess.check_call(cmd)
    return True


def copy_kernel_sources(out_dir):
    """Ships cuda/include and cuda/daemon for run-time NVRTC compilation."""
    src_dir = os.path.join(out_dir, "src")
    for sub in ("include", "daemon"):
        dst = os.path.join(src_dir, sub)
        if os.path.isdir(dst):
            shutil.rmtree(dst)
        shutil.copytree(os.path.join(CUDA_SRC, sub), dst)


class BuildExt(build_ext):
    def run(self):
        super().run()
        # Next to the extension modules: in place for editable installs, in
        # build_lib otherwise.
        native = os.path.dirname(self.get_ext_fullpath("dfccl._native.context"))
        kernels = os.path.join(os.path.dirname(native), "_kernels")
        copy_kernel_sources(kernels)
        compile_kernels(kernels)


class BuildPy(build_py):
    def run(self):
        super().run()
        copy_kernel_sources(os.path.join(self.build_lib, "dfccl", "_kernels"))

    def find_data_files(self, package, src_dir):
        # Cython's generated C++ sits next to the .pyx sources; it is a build
        # product, not part of the installed package.
        files = super().find_data_files(package, src_dir)
        return [f for f in files if not f.endswith((".cpp", ".c"))]


setup(ext_modules=extensions(), cmdclass={"build_ext": BuildExt, "build_py": BuildPy})
