"""What a kernel's first launch waits for while a dfccl collective is
pending (design decision 28).

A kernel's first launch under lazy module loading may wait for the device to
drain (CUDA programming guide, "Lazy Loading", potential hazards).  With
dfccl the device drains only when the pending collectives complete, and a
stream that waits for a collective stays busy until it completes.  Each case
runs in a fresh process (CUDA reads ``CUDA_MODULE_LOADING`` when it starts),
with the peer of a pending all-reduce arriving ``--peer-delay`` seconds
later from another thread, and times one call on the main thread:

* ``first_launch``: a torch kernel not launched before (``erfinv``);
* ``warm_launch``: the same kernel, launched once before (the control);
* ``module_load``: ``cuModuleLoadData`` + ``cuModuleGetFunction`` + a launch
  of a module compiled at run time (as CuPy, Triton and torch.compile load
  theirs);

each with the current stream waiting for the collective (``Work.wait``) and
without; then, without dfccl, a first launch while a stream waits on a host
word set a second later (``host_wait``) and while a one-second kernel runs
on another stream (``busy_kernel``); and start-up: seconds to a working CUDA
context with torch, and the device memory in use after a matmul, per mode.
A call that takes about the peer delay waited for it.  One ``RESULT`` line
per case as it finishes; ``--json`` appends them to a file.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap

from probe_snippets import CHECKED_CALL, PROBE_KERNEL_CUBIN, report

_CASE = textwrap.dedent(r"""
    import faulthandler, json, sys, threading, time
    faulthandler.dump_traceback_later(CASE_TIMEOUT - 5, exit=True)
    import dfccl, torch
    from cuda.bindings import driver, nvrtc
""") + CHECKED_CALL + textwrap.dedent(r"""
    torch.cuda.set_device(0)
    mode = ok(driver.cuModuleGetLoadingMode(), "cuModuleGetLoadingMode")
    comms = dfccl.Communicator.for_devices([0, 0], backend="cuda")
    s = torch.cuda.current_stream().cuda_stream
    warm = [torch.full((4096,), 1.0, device="cuda:0") for _ in range(2)]
    ws = [c.all_reduce(w) for c, w in zip(comms, warm)]
    for w in ws:
        w.synchronize(timeout=30)
    probe = torch.rand(1024, device="cuda:0") * 0.5
    torch.cuda.synchronize()
""") + PROBE_KERNEL_CUBIN + textwrap.dedent(r"""
    if ACTION == "warm_launch":
        probe.erfinv_()
        torch.cuda.synchronize()

    def action():
        if ACTION in ("first_launch", "warm_launch"):
            probe.erfinv_()
        elif ACTION == "module_load":
            mod = ok(driver.cuModuleLoadData(cubin), "cuModuleLoadData")
            fn = ok(driver.cuModuleGetFunction(mod, b"k"), "cuModuleGetFunction")
            buf = torch.zeros(32, device="cuda:0")
            import ctypes
            params = ((buf.data_ptr(),), (ctypes.c_void_p,))
            ok(driver.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, s, params, 0), "cuLaunchKernel")

    x = [torch.full((4096,), float(r + 1), device="cuda:0") for r in range(2)]
    torch.cuda.synchronize()
    w0 = comms[0].all_reduce(x[0], stream=s)
    if STREAM_WAIT:
        w0.wait(s)
    peer = {}
    def late_peer():
        time.sleep(PEER_DELAY)
        peer["submitted"] = time.perf_counter()
        peer["work"] = comms[1].all_reduce(x[1])
    t = threading.Thread(target=late_peer)
    start = time.perf_counter()
    t.start()
    time.sleep(0.01)
    t0 = time.perf_counter()
    action()
    took = time.perf_counter() - t0
    t.join()
    w0.synchronize(timeout=30)
    peer["work"].synchronize(timeout=30)
    torch.cuda.synchronize()
    assert bool((x[0] == 3.0).all()) and bool((x[1] == 3.0).all())
    for c in comms:
        c.close()
    print("RESULT " + json.dumps({"mode": str(mode).split(".")[-1], "action": ACTION, "stream_wait": STREAM_WAIT,
                                  "took_s": round(took, 4), "peer_delay_s": PEER_DELAY,
                                  "waited": took > 0.5 * PEER_DELAY}), flush=True)
""")

_NO_DFCCL = textwrap.dedent(r"""
    import faulthandler, json, threading, time
    faulthandler.dump_traceback_later(CASE_TIMEOUT - 5, exit=True)
    import torch
    from cuda.bindings import driver
    torch.cuda.set_device(0)
    err, mode = driver.cuModuleGetLoadingMode()
    probe = torch.rand(1024, device="cuda:0") * 0.5
    torch.cuda._sleep(1000)
    word = torch.zeros(1, dtype=torch.int32).pin_memory()
    torch.cuda.synchronize()
    s = torch.cuda.current_stream()
    if ACTION == "host_wait":
        err, = driver.cuStreamWaitValue32(s.cuda_stream, word.data_ptr(), 1, 0)  # GEQ
        assert int(err) == 0, err
        def release():
            time.sleep(PEER_DELAY)
            word[0] = 1
        t = threading.Thread(target=release)
        t.start()
    else:  # busy_kernel
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            torch.cuda._sleep(int(PEER_DELAY * 2.0e9))
        t = None
    time.sleep(0.01)
    t0 = time.perf_counter()
    probe.erfinv_()
    took = time.perf_counter() - t0
    if t is not None:
        t.join()
    torch.cuda.synchronize()
    print("RESULT " + json.dumps({"mode": str(mode).split(".")[-1], "action": ACTION, "stream_wait": ACTION == "host_wait",
                                  "took_s": round(took, 4), "peer_delay_s": PEER_DELAY,
                                  "waited": took > 0.5 * PEER_DELAY}), flush=True)
""")

_STARTUP = textwrap.dedent(r"""
    import json, time
    t0 = time.perf_counter()
    import torch
    a = torch.rand(1024, 1024, device="cuda:0")
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    (a @ a).sum().item()
    free, total = torch.cuda.mem_get_info(0)
    from cuda.bindings import driver
    err, mode = driver.cuModuleGetLoadingMode()
    print("RESULT " + json.dumps({"mode": str(mode).split(".")[-1], "startup_s": round(t1 - t0, 3),
                                  "device_used_mib": round((total - free) / 2**20, 1)}))
""")


def _run(code: str, env_mode: str, timeout: float) -> dict:
    env = dict(os.environ, CUDA_MODULE_LOADING=env_mode)
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        return {"env": env_mode, "error": f"no result within {timeout:g} s", "stderr": err[-2000:]}
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[7:]), env=env_mode)
    return {"env": env_mode, "error": f"rc={out.returncode}", "stderr": out.stderr[-3000:]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peer-delay", type=float, default=1.0)
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--json", help="append the results to this file")
    ap.add_argument("--actions", default=None,
                    help="comma-separated subset of startup, first_launch, warm_launch, module_load, host_wait, "
                         "busy_kernel (default: all)")
    args = ap.parse_args()
    keep = set(args.actions.split(",")) if args.actions else None
    cases = []
    for env_mode in ("EAGER", "LAZY"):
        if keep is None or "startup" in keep:
            cases.append((env_mode, _STARTUP))
        for action, stream_wait in (("first_launch", True), ("warm_launch", True), ("first_launch", False),
                                    ("module_load", True), ("module_load", False)):
            if keep is None or action in keep:
                cases.append((env_mode, f"ACTION = {action!r}\nSTREAM_WAIT = {stream_wait}\n" + _CASE))
        for action in ("host_wait", "busy_kernel"):
            if keep is None or action in keep:
                cases.append((env_mode, f"ACTION = {action!r}\n" + _NO_DFCCL))
    for env_mode, body in cases:
        code = f"CASE_TIMEOUT = {args.timeout}\nPEER_DELAY = {args.peer_delay}\n" + body
        r = _run(code, env_mode, args.timeout)
        report(r, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
