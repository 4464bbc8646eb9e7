"""Builds dfccl's Cython extensions and the daemon kernel.

- The daemon sources in cuda/ are compiled twice: by the host compiler into
  the simulator backend (dfccl._native.sim_device), and by nvcc into a fatbin
  (sm_80 and sm_90 machine code plus PTX) shipped as dfccl/_kernels/daemon.fatbin.
- The fatbin is built only where it will be used: a GPU is present
  (/dev/nvidia*, nvidia-smi -L, or the CUDA driver), or DFCCL_CUDA_ARCHS names
  the architectures, e.g. "90" or "80;90" (a build without a GPU, for a wheel).
  Elsewhere, or where nvcc is missing, the sources are shipped and the CUDA
  backend compiles them with NVRTC at first use, once (dfccl.kernel_image).
- DFCCL_LINEINFO=1 builds the fatbin with -lineinfo (source lines in Nsight
  Compute's source view; same machine code otherwise).
- DFCCL_STEP_PROFILE=1 builds the fatbin and the simulator with the step
  profile (Daemon.daemon_profile: time per LL step and per completion;
  a few clock reads more per run, so off by default).
- DFCCL_SKIP_KERNEL=1 skips the fatbin even where a GPU is present.
- Compiled extensions and the fatbin are kept in build/dfccl-cache under a key
  of their inputs: reinstalling (another extra, say) recompiles only what
  changed.  pip shows what is built with `pip install -v`.
"""

import concurrent.futures
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))
CUDA_SRC = os.path.join(ROOT, "cuda")
CUDA_INCLUDE = os.path.join(CUDA_SRC, "include")
# Survives pip's temporary build folders: pip builds a local project in place.
BUILD_CACHE = os.path.join(ROOT, "build", "dfccl-cache")


def _load_kernel_image():
    """dfccl/kernel_image.py, loaded by path: dfccl itself is not built yet."""
    spec = importlib.util.spec_from_file_location("_dfccl_kernel_image",
                                                  os.path.join(ROOT, "src", "dfccl", "kernel_image.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


kernel_image = _load_kernel_image()


def say(msg):
    # pip shows a build's output only with -v; stderr keeps it apart from
    # setuptools' own lines.
    print(f"dfccl: {msg}", file=sys.stderr, flush=True)


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
        Extension("dfccl._native.device", ["src/dfccl/_native/device.pyx"], **common),
        Extension("dfccl._native.work", ["src/dfccl/_native/work.pyx"], **common),
        Extension("dfccl._native.array_view", ["src/dfccl/_native/array_view.pyx"], **common),
        Extension("dfccl._native.tag_instances", ["src/dfccl/_native/tag_instances.pyx"], **common),
        Extension("dfccl._native.tag_table", ["src/dfccl/_native/tag_table.pyx"], **common),
        Extension("dfccl._native.layout", ["src/dfccl/_native/layout.pyx"], **common),
        Extension("dfccl._native.descriptor", ["src/dfccl/_native/descriptor.pyx"], **common),
        Extension("dfccl._native.launch", ["src/dfccl/_native/launch.pyx"], **common),
        Extension("dfccl._native.hotpath", ["src/dfccl/_native/hotpath.pyx"], **common),
        Extension("dfccl._native.completion", ["src/dfccl/_native/completion.pyx"], **common),
        Extension("dfccl._native.retire", ["src/dfccl/_native/retire.pyx"], **common),
        Extension("dfccl._native.inspection", ["src/dfccl/_native/inspection.pyx"], **common),
        Extension("dfccl._native.endpoints", ["src/dfccl/_native/endpoints.pyx"], **common),
        Extension("dfccl._native.graphs", ["src/dfccl/_native/graphs.pyx"], **common),
        Extension("dfccl._native.daemon_memory", ["src/dfccl/_native/daemon_memory.pyx"], **common),
        Extension("dfccl._native.daemon", ["src/dfccl/_native/daemon.pyx"], **common),
        Extension("dfccl._native.capi", ["src/dfccl/_native/capi.pyx"], **common),
        Extension("dfccl._native.sim_device",
                  ["src/dfccl/_native/sim_device.pyx", "cuda/sim/sim_device.cpp", "cuda/sim/sim_stream.cpp"],
                  include_dirs=[CUDA_INCLUDE, os.path.join(CUDA_SRC, "sim")], language="c++",
                  extra_compile_args=CXX_FLAGS + step_profile_flags() + ["-pthread"], extra_link_args=["-pthread"],
                  depends=headers),
    ]
    # The CUDA backend needs no CUDA headers: it declares the driver ABI itself
    # and resolves entry points at run time (cuda/include/dfccl/cuda_driver.h).
    exts.append(Extension("dfccl._native.cuda_driver", ["src/dfccl/_native/cuda_driver.pyx"], **common))
    exts.append(Extension("dfccl._native.cuda_device", ["src/dfccl/_native/cuda_device.pyx"], **common))
    from Cython.Build import cythonize
    return cythonize(exts, compiler_directives={"language_level": "3", "embedsignature": True},
                     include_path=["src"])


def nvcc_version(nvcc):
    return subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout.strip()


def compile_kernels(out_dir):
    """nvcc -> daemon.fatbin where kernel_build_plan says so (else none, and
    the CUDA backend compiles the shipped sources with NVRTC at first use).
    The fatbin is kept in BUILD_CACHE under a key of the sources, nvcc's
    version and the flags; an unchanged build is a copy."""
    out = os.path.join(out_dir, "daemon.fatbin")
    nvcc = nvcc_path()
    archs, why = kernel_image.kernel_build_plan(os.environ, nvcc, kernel_image.gpu_present)
    if not archs:
        if os.path.exists(out):
            # An older build's fatbin would no longer match the shipped sources.
            os.remove(out)
        say(f"daemon kernel not built ({why}): the CUDA backend compiles it with NVRTC at first use")
        return False
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    gencode += [f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}"]
    lineinfo = ["-lineinfo"] if os.environ.get("DFCCL_LINEINFO", "") not in ("", "0") else []
    flags = ["-std=c++17", "-O3", *lineinfo, *step_profile_flags(), "--fatbin", *gencode]
    sources = [os.path.join(CUDA_SRC, "include"), os.path.join(CUDA_SRC, "daemon")]
    key = kernel_image.cache_key(kernel_image.tree_digest(*sources), nvcc_version(nvcc), *flags)
    cached = os.path.join(BUILD_CACHE, f"daemon-{key}.fatbin")

    def build():
        os.makedirs(BUILD_CACHE, exist_ok=True)
        tmp = cached + ".out"
        cmd = [nvcc, *flags, f"-I{CUDA_INCLUDE}", os.path.join(CUDA_SRC, "daemon", "daemon_kernel.cu"), "-o", tmp]
        say(" ".join(cmd))
        subprocess.check_call(cmd)
        try:
            with open(tmp, "rb") as f:
                return f.read()
        finally:
            os.remove(tmp)

    def announce():
        say(f"building the daemon kernel with nvcc for sm_{', sm_'.join(archs)} ({why}; minutes)")

    image, hit = kernel_image.cached_build(cached, build, announce)
    if hit:
        say(f"daemon kernel for sm_{', sm_'.join(archs)} unchanged: reused {os.path.relpath(cached, ROOT)}")
    kernel_image.atomic_write(out, image)
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
    def finalize_options(self):
        super().finalize_options()
        # pip asks for no parallelism: the extension modules are independent,
        # so use the machine's cores.
        if not self.parallel:
            self.parallel = os.cpu_count() or 1

    def run(self):
        # Next to the extension modules: in place for editable installs, in
        # build_lib otherwise.
        native = os.path.dirname(self.get_ext_fullpath("dfccl._native.daemon"))
        kernels = os.path.join(os.path.dirname(native), "_kernels")
        copy_kernel_sources(kernels)
        # nvcc's one long compile beside the modules' compiles, not after them.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            kernel = pool.submit(compile_kernels, kernels)
            super().run()
            kernel.result()

    def build_extension(self, ext):
        # pip builds each install in a fresh build_lib, where distutils'
        # timestamps see nothing built: key the module on its inputs instead.
        target = self.get_ext_fullpath(ext.name)
        suffix = sysconfig.get_config_var("EXT_SUFFIX")
        tools = [getattr(self.compiler, a, None)
                 for a in ("compiler_so", "compiler_so_cxx", "linker_so", "linker_so_cxx")]
        key = kernel_image.cache_key(
            kernel_image.tree_digest(*ext.sources, *ext.depends), sys.version, suffix, repr(tools),
            repr(ext.include_dirs), repr(ext.define_macros), repr(ext.extra_compile_args), repr(ext.extra_link_args),
            repr(ext.libraries))
        cached = os.path.join(BUILD_CACHE, f"{ext.name}-{key}{suffix}")

        def build():
            super(BuildExt, self).build_extension(ext)
            with open(target, "rb") as f:
                return f.read()

        image, hit = kernel_image.cached_build(cached, build, lambda: say(f"compiling {ext.name}"))
        if hit:
            say(f"{ext.name} unchanged: reused {os.path.relpath(cached, ROOT)}")
            kernel_image.atomic_write(target, image, mode=0o755)


class BuildPy(build_py):
    def run(self):
        super().run()
        copy_kernel_sources(os.path.join(self.build_lib, "dfccl", "_kernels"))

    def find_data_files(self, package, src_dir):
        # Cython's generated C++ sits next to the .pyx sources; it is a build
        # product, not part of the installed package.  Other C++ (the torch
        # backend's source, built on first import) is shipped.
        files = super().find_data_files(package, src_dir)
        def generated(f):
            return f.endswith((".cpp", ".c")) and os.path.exists(os.path.splitext(f)[0] + ".pyx")
        return [f for f in files if not generated(f)]


setup(ext_modules=extensions(), cmdclass={"build_ext": BuildExt, "build_py": BuildPy})
