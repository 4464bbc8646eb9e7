"""Code the probes share.  The child processes of module_loading_probe.py
and mps_first_launch_probe.py are fresh interpreters started with
``python -c``, so their pieces are source text, pasted into the child's
program; the rest are plain functions (a host gap, the empty-quit option,
a result line)."""

import textwrap
import time

# ok(res, what): a cuda.bindings call's result without its error code, or
# RuntimeError naming the call.
CHECKED_CALL = textwrap.dedent(r"""
    def ok(res, what):
        err = res[0]
        if int(err) != 0:
            raise RuntimeError(f"{what}: {err}")
        return res[1:] if len(res) > 2 else (res[1] if len(res) == 2 else None)
""")

# cubin: a one-line kernel `k(float *x)` compiled with NVRTC for device 0
# (needs torch, ok and `from cuda.bindings import nvrtc`).
PROBE_KERNEL_CUBIN = textwrap.dedent(r"""
    _src = b'extern "C" __global__ void k(float *x) { x[threadIdx.x] += 1.0f; }'
    _prog = ok(nvrtc.nvrtcCreateProgram(_src, b"k.cu", 0, [], []), "nvrtcCreateProgram")
    _cc = torch.cuda.get_device_capability(0)
    _rc = nvrtc.nvrtcCompileProgram(_prog, 1, [f"--gpu-architecture=sm_{_cc[0]}{_cc[1]}".encode()])[0]
    if int(_rc) != 0:
        raise RuntimeError(f"nvrtcCompileProgram: {_rc}")
    cubin = b" " * ok(nvrtc.nvrtcGetCUBINSize(_prog), "nvrtcGetCUBINSize")
    ok(nvrtc.nvrtcGetCUBIN(_prog, cubin), "nvrtcGetCUBIN")
""")


def report(result: dict, json_path: str | None) -> None:
    """One probe case's result: a ``RESULT`` line, and a dated line appended
    to ``json_path`` when given."""
    import json
    import time

    print("RESULT", json.dumps(result), flush=True)
    if json_path:
        with open(json_path, "a") as f:
            f.write(json.dumps(dict(result, date=time.strftime("%Y-%m-%d"))) + "\n")


def spin(seconds: float) -> None:
    """A host gap spun, not slept: a sleep would add the scheduler's wake-up
    to whatever comes after it."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def quit_options(empty_quit_us: float | None):
    """DaemonOptions with this empty quit (and an idle quit at least as long,
    5 ms at the least), or None for the defaults."""
    if empty_quit_us is None:
        return None
    import dfccl

    quit_ns = int(empty_quit_us * 1000)
    return dfccl.DaemonOptions(empty_quit_ns=quit_ns, idle_quit_ns=max(quit_ns, 5_000_000))
