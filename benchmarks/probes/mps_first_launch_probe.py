"""Does a kernel's first launch in one process wait for a stream of another
process that shares the GPU through MPS?

`module_loading_probe.py` showed that a first launch waits for the device to
drain, including a stream of the same process that waits on a host word.
This probe asks the same across processes: two processes on one GPU, both
MPS clients.  The *waiter* queues ``cuStreamWaitValue32`` on a pinned host
word of its own and a kernel behind it, then releases the word
``--delay`` seconds later (``--waiting-streams``: on that many streams at
once); meanwhile the *launcher* times one call:

* ``first_launch``: a torch kernel it never launched (``erfinv``);
* ``warm_launch``: the same kernel, launched once before (the control);
* ``module_load``: ``cuModuleLoadData`` + ``cuModuleGetFunction`` + a launch
  of a module compiled at run time;
* ``stream_write``: ``cuStreamWriteValue32`` on its stream into its own
  pinned word, timed until the word lands (a write queued behind the other
  process's wait, on a hardware queue they share, lands only after the
  release).

A call that takes about the delay waited for the other process's stream.
Run it under MPS (``nvidia-cuda-mps-control -d`` with the same
``CUDA_MPS_PIPE_DIRECTORY``); without MPS the two processes are time-sliced
and the result says nothing about MPS.  One ``RESULT`` line per case;
``--json`` appends them to a file.

    python benchmarks/mps_first_launch_probe.py [--delay 1.5] [--json out.jsonl]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap

from probe_snippets import CHECKED_CALL, PROBE_KERNEL_CUBIN, report

_COMMON = textwrap.dedent(r"""
    import faulthandler, json, os, sys, time
    faulthandler.dump_traceback_later(CASE_TIMEOUT - 3, exit=True)
    import torch
    from cuda.bindings import driver
""") + CHECKED_CALL + textwrap.dedent(r"""
    def touch(name, text=""):
        with open(os.path.join(DIR, name + ".tmp"), "w") as f:
            f.write(text)
        os.replace(os.path.join(DIR, name + ".tmp"), os.path.join(DIR, name))

    def await_file(name):
        path = os.path.join(DIR, name)
        while not os.path.exists(path):
            time.sleep(0.002)

    torch.cuda.set_device(0)
    mode = str(ok(driver.cuModuleGetLoadingMode(), "cuModuleGetLoadingMode")).split(".")[-1]
""")

_WAITER = _COMMON + textwrap.dedent(r"""
    word = torch.zeros(1, dtype=torch.int32).pin_memory()
    after = torch.zeros(16, device="cuda:0")
    after.add_(0.0)  # loaded and launched once: its launch below must not be a first launch
    torch.cuda.synchronize()
    await_file("launcher_ready")
    # WAITING_STREAMS streams each wait on the word, with a kernel behind
    # the wait: every one of them is busy until the release.
    streams = [torch.cuda.current_stream()] + [torch.cuda.Stream() for _ in range(WAITING_STREAMS - 1)]
    for s in streams:
        ok(driver.cuStreamWaitValue32(s.cuda_stream, word.data_ptr(), 1, 0), "cuStreamWaitValue32")  # GEQ
        with torch.cuda.stream(s):
            after.add_(1.0)
    touch("waiting", repr(time.time()))
    time.sleep(DELAY)
    released = time.time()
    word[0] = 1
    torch.cuda.synchronize()
    assert float(after[0]) == float(len(streams))
    print("RESULT " + json.dumps({"role": "waiter", "mode": mode, "released_at": released}), flush=True)
""")

_LAUNCHER = _COMMON + textwrap.dedent(r"""
    import ctypes
    from cuda.bindings import nvrtc
    probe = torch.rand(1024, device="cuda:0") * 0.5
""") + PROBE_KERNEL_CUBIN + textwrap.dedent(r"""
    buf = torch.zeros(32, device="cuda:0")
    if ACTION == "warm_launch":
        probe.erfinv_()
    torch.cuda.synchronize()
    s = torch.cuda.current_stream().cuda_stream

    if ACTION == "stream_write":
        written = torch.zeros(1, dtype=torch.int32).pin_memory()
        word = ctypes.c_int32.from_address(written.data_ptr())

    def action():
        if ACTION in ("first_launch", "warm_launch"):
            probe.erfinv_()
        elif ACTION == "stream_write":
            # Returns when the write lands (or DELAY + 5 s): a write queued
            # behind the other process's wait lands only after its release.
            ok(driver.cuStreamWriteValue32(s, written.data_ptr(), 1, 0), "cuStreamWriteValue32")
            end = time.perf_counter() + DELAY + 5
            while word.value != 1 and time.perf_counter() < end:
                pass
        else:
            mod = ok(driver.cuModuleLoadData(cubin), "cuModuleLoadData")
            fn = ok(driver.cuModuleGetFunction(mod, b"k"), "cuModuleGetFunction")
            params = ((buf.data_ptr(),), (ctypes.c_void_p,))
            ok(driver.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, s, params, 0), "cuLaunchKernel")

    touch("launcher_ready")
    await_file("waiting")
    time.sleep(0.05)
    t0 = time.perf_counter()
    action()
    took = time.perf_counter() - t0
    ended = time.time()
    torch.cuda.synchronize()
    print("RESULT " + json.dumps({"role": "launcher", "mode": mode, "action": ACTION, "took_s": round(took, 4),
                                  "ended_at": ended}), flush=True)
""")


def _result(out: str) -> dict | None:
    for line in out.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return None


def run_case(env_mode: str, action: str, delay: float, timeout: float, waiting_streams: int = 1) -> dict:
    with tempfile.TemporaryDirectory(prefix="dfccl-mps-probe-") as d:
        head = (f"CASE_TIMEOUT = {timeout}\nDELAY = {delay}\nDIR = {d!r}\nACTION = {action!r}\n"
                f"WAITING_STREAMS = {waiting_streams}\n")
        env = dict(os.environ, CUDA_MODULE_LOADING=env_mode)
        procs = {role: subprocess.Popen([sys.executable, "-c", head + body], stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, env=env)
                 for role, body in (("waiter", _WAITER), ("launcher", _LAUNCHER))}
        outs = {}
        for role, p in procs.items():
            try:
                outs[role] = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                outs[role] = p.communicate()
        w, l = _result(outs["waiter"][0]), _result(outs["launcher"][0])
        if w is None or l is None:
            return {"env": env_mode, "action": action, "error": "no result",
                    "waiter_stderr": outs["waiter"][1][-1500:], "launcher_stderr": outs["launcher"][1][-1500:]}
        return {"env": env_mode, "mode": l["mode"], "action": action, "waiting_streams": waiting_streams,
                "took_s": l["took_s"], "delay_s": delay,
                # the launch returned within 50 ms of the other process's release
                "returned_after_release_s": round(l["ended_at"] - w["released_at"], 4),
                "waited": l["took_s"] > 0.5 * delay}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--delay", type=float, default=1.5)
    ap.add_argument("--timeout", type=float, default=40.0)
    ap.add_argument("--json", help="append the results to this file")
    ap.add_argument("--waiting-streams", default="1",
                    help="comma-separated: how many of the waiter's streams wait (each value is a case)")
    ap.add_argument("--actions", default="warm_launch,first_launch,module_load,stream_write")
    ap.add_argument("--modes", default="EAGER,LAZY")
    args = ap.parse_args()
    mps = os.environ.get("CUDA_MPS_PIPE_DIRECTORY")
    print(f"# CUDA_MPS_PIPE_DIRECTORY={mps or '(unset: the default pipe directory)'}", flush=True)
    cases = [(m, a, int(n)) for m in args.modes.split(",") for a in args.actions.split(",")
             for n in args.waiting_streams.split(",")]
    for env_mode, action, nstreams in cases:
        r = run_case(env_mode, action, args.delay, args.timeout, nstreams)
        report(r, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
