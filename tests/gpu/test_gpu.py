"""The daemon kernel on real GPUs (marker ``gpu``; ``multigpu`` needs two).

Correctness of every collective on both data paths, the deadlock scenarios of
the simulator suite plus device-wide synchronisation and long compute kernels
on the GPU, and NCCL run on the same scenarios (in subprocesses, with a
timeout) to record that it hangs or mis-reduces where dfccl completes.
Set DFCCL_GPU_CHAOS_ROUNDS to change the chaos test's rounds (default 100).
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

import dfccl
from dfccl import runtime
from dfccl.bench import arrays
from dfccl_support import scenarios as sc

pytestmark = pytest.mark.gpu

RESULTS = os.environ.get("DFCCL_GPU_RESULTS")  # where to append JSON lines of figures


def record(name: str, **fields) -> None:
    if RESULTS:
        with open(RESULTS, "a") as f:
            f.write(json.dumps({"test": name, **fields}) + "\n")


def gpu_devices(nranks: int) -> list[int]:
    """nranks ranks spread round-robin over the visible GPUs."""
    n = runtime.cuda_device_count()
    return [r % n for r in range(nranks)]


@pytest.fixture(scope="module")
def comms2():
    """Two ranks per path (on two GPUs when there are two)."""
    out = {p: dfccl.Communicator.for_devices(gpu_devices(2), backend="cuda", options=dfccl.CommOptions(path=p))
           for p in ("direct", "ring")}
    yield out
    for cs in out.values():
        for c in cs:
            c.close()


def test_host_copies_do_not_wait_for_the_default_stream():
    """The backend's host <-> device copies (liveness heartbeats, the live
    "waiting for" word of a timeout message) run on a private stream: a long
    kernel on the legacy default stream, where torch queues its work and
    where a stream may wait for a collective, does not hold them up."""
    torch = pytest.importorskip("torch")
    be = runtime.get_device("cuda", 0)
    word = np.zeros(4, np.uint32)
    dev = be.alloc_device(16)
    try:
        with torch.cuda.device(0):
            torch.cuda._sleep(2_000_000_000)  # ~1 s of spinning on the default stream
            t0 = time.perf_counter()
            be.copy_to_device(dev, word.ctypes.data, 16)
            be.copy_from_device(word.ctypes.data, dev, 16)
            took = time.perf_counter() - t0
            torch.cuda.synchronize()
        assert took < 0.3, f"host copies waited {took:.2f} s for the default stream"
    finally:
        be.free_device(dev)


def test_one_hardware_queue():
    """CUDA_DEVICE_MAX_CONNECTIONS=1 (Megatron-LM sets it) puts every stream
    of the process on one hardware queue: a stream waiting for a collective
    then holds up whatever is queued after the wait, on any stream, dfccl's
    own launches and copies included.  The daemon must stay while a stream
    waits (a relaunch queued behind the wait would never run); the host
    must never wait for its private stream on the way to a collective
    (an all-to-all's split table) or to an explanation (waiting_for,
    status).  Rank 1 arrives after ten idle-quit periods each time.  In a
    fresh process: the variable is read when CUDA starts.  Every torch
    kernel is run once first: a kernel's first launch loads its module
    (lazy loading), which waits for the device to drain, here for the
    collective that only this thread's later submission completes."""
    import subprocess
    import sys
    pytest.importorskip("torch")
    code = r"""
import faulthandler, sys, time
faulthandler.dump_traceback_later(90, exit=True)
import torch, dfccl
torch.cuda.set_device(0)
comms = dfccl.Communicator.for_devices([0, 0], backend="cuda")
s = torch.cuda.current_stream().cuda_stream
slowest = {"waiting_for": 0.0, "status": 0.0, "all_to_all_submit": 0.0}
warm = torch.full((8,), 1.0, device="cuda:0")
bool(((warm * 2) == 2).all()); torch.equal(torch.cat([warm, torch.arange(8, dtype=torch.float32, device="cuda:0")]), warm)
torch.cuda.synchronize()
for it in range(3):
    xs = [torch.full((4096,), float(r + 1 + it), device="cuda:0") for r in range(2)]
    sends = [torch.arange(8, dtype=torch.float32, device="cuda:0") + 100 * r for r in range(2)]
    recvs = [torch.full((8,), -1.0, device="cuda:0") for _ in range(2)]
    torch.cuda.synchronize()
    w0 = comms[0].all_reduce(xs[0], stream=s)   # ordered after the stream ...
    w0.wait(s)                                  # ... which waits for it
    ys = xs[0] * 2                              # queued behind the wait
    t0 = time.perf_counter(); a0 = comms[0].all_to_all(sends[0], recvs[0])
    slowest["all_to_all_submit"] = max(slowest["all_to_all_submit"], time.perf_counter() - t0)
    time.sleep(0.05)                            # ten idle-quit periods
    t0 = time.perf_counter(); w0.waiting_for()
    slowest["waiting_for"] = max(slowest["waiting_for"], time.perf_counter() - t0)
    t0 = time.perf_counter(); str(comms[0].status())
    slowest["status"] = max(slowest["status"], time.perf_counter() - t0)
    assert not w0.done()
    w1 = comms[1].all_reduce(xs[1])
    a1 = comms[1].all_to_all(sends[1], recvs[1])
    for w in (w1, a0, a1):
        w.synchronize(timeout=30)
    torch.cuda.synchronize()
    total = float(3 + 2 * it)
    assert bool((xs[0] == total).all()) and bool((xs[1] == total).all()), (xs[0][:4], xs[1][:4])
    assert bool((ys == 2 * total).all()), ys[:4]
    for r in range(2):
        expect = torch.cat([sends[p][4 * r:4 * r + 4] for p in range(2)])
        assert torch.equal(recvs[r], expect), (r, recvs[r], expect)
for c in comms:
    c.close()
print("RESULT", " ".join(f"{k}={v:.4f}" for k, v in slowest.items()))
"""
    env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=150, env=env)
    assert out.returncode == 0 and "RESULT" in out.stdout, out.stdout[-3000:] + out.stderr[-6000:]
    slowest = dict(kv.split("=") for kv in out.stdout.split("RESULT")[1].split())
    record("one_hardware_queue", **{k: float(v) for k, v in slowest.items()})
    # None of them waits for the collective (held for 50 ms each round).
    assert float(slowest["waiting_for"]) < 0.01 and float(slowest["all_to_all_submit"]) < 0.04, slowest
    assert float(slowest["status"]) < 2.0, slowest


_FIRST_LAUNCH = r"""
import faulthandler, os, sys, threading, time
faulthandler.dump_traceback_later(50, exit=True)
import torch
import dfccl
torch.cuda.set_device(0)
comms = dfccl.Communicator.for_devices([0, 0], backend="cuda")
s = torch.cuda.current_stream().cuda_stream
probe = torch.rand(1024, device="cuda:0") * 0.5
x = [torch.full((4096,), float(r + 1), device="cuda:0") for r in range(2)]
torch.cuda.synchronize()
w0 = comms[0].all_reduce(x[0], stream=s)
w0.wait(s)                        # the stream now waits for rank 1 ...
late, stop = {}, threading.Event()
def rank1():
    time.sleep(PEER_DELAY)        # ... which comes later, from another thread
    late["work"] = comms[1].all_reduce(x[1])
def explain():                    # status() reads device memory meanwhile
    while not stop.is_set():
        str(comms[0].status())
        time.sleep(0.05)
threads = [threading.Thread(target=rank1), threading.Thread(target=explain)]
for t in threads:
    t.start()
time.sleep(0.2)
t0 = time.perf_counter()
probe.erfinv_()                   # a torch kernel's first launch in this process
took = time.perf_counter() - t0
stop.set()
for t in threads:
    t.join()
late["work"].synchronize(timeout=30)
w0.synchronize(timeout=30)
torch.cuda.synchronize()
assert bool((x[0] == 3.0).all()) and bool((x[1] == 3.0).all())
assert torch.allclose(probe, torch.erfinv(torch.erf(probe)), atol=1e-4)
for c in comms:
    c.close()
print("RESULT", f"{took:.4f}")
"""


@pytest.mark.parametrize("loading", ["LAZY", "EAGER"])
def test_first_launch_while_a_stream_waits(loading):
    """A kernel's first launch in a process waits for the device to drain,
    in both module-loading modes (benchmarks/probes/module_loading_probe.py): here
    for a collective a stream waits for, whose peer another thread submits a
    second later.  Meanwhile status() reads device memory; a driver call
    made with the GIL held would block there too and keep the submitting
    thread from running (seen: the process stopped).  dfccl makes such calls
    without the GIL, so the launch returns once the peer has come.  In a
    fresh process: CUDA reads CUDA_MODULE_LOADING when it starts."""
    import subprocess
    import sys
    pytest.importorskip("torch")
    env = dict(os.environ, CUDA_MODULE_LOADING=loading)
    out = subprocess.run([sys.executable, "-c", "PEER_DELAY = 1.0\n" + _FIRST_LAUNCH], capture_output=True,
                         text=True, timeout=120, env=env)
    assert out.returncode == 0 and "RESULT" in out.stdout, out.stdout[-3000:] + out.stderr[-6000:]
    took = float(out.stdout.split("RESULT")[1].split()[0])
    record("first_launch_while_a_stream_waits", loading=loading, took_s=took)
    assert took < 10.0, took


def test_stream_reached_tells_a_held_stream():
    """A stream-ordered collective whose stream is held (a wait on a host
    word queued before it) is taken up by the daemon (Daemon.submissions
    passes its entry) but not armed: Daemon.stream_reached says False,
    read from its armed word; released, it completes."""
    torch = pytest.importorskip("torch")
    from cuda.bindings import driver

    comms = dfccl.Communicator.for_devices([0, 0], backend="cuda")
    try:
        with torch.cuda.device(0):
            word = torch.zeros(1, dtype=torch.int32).pin_memory()
            side = torch.cuda.Stream(device=0)
            xs = [torch.full((256,), float(r + 1), device="cuda:0") for r in range(2)]
            torch.cuda.synchronize()
            err, = driver.cuStreamWaitValue32(side.cuda_stream, word.data_ptr(), 1, 0)  # GEQ
            assert int(err) == 0, err
            daemon = comms[0]._daemon
            w0 = comms[0].all_reduce(xs[0], stream=side.cuda_stream)
            assert w0.stream_ordered
            deadline = time.monotonic() + 10
            while daemon.submissions[1] <= w0.position and time.monotonic() < deadline:
                time.sleep(0.01)
            assert daemon.submissions[1] > w0.position, daemon.submissions
            assert daemon.stream_reached(w0) is False
            word[0] = 1
            w1 = comms[1].all_reduce(xs[1])
            for w in (w0, w1):
                w.synchronize(timeout=30)
            torch.cuda.synchronize()
            assert bool((xs[0] == 3.0).all()) and bool((xs[1] == 3.0).all())
            assert daemon.stream_reached(w0) is None  # retired: no longer in its slot
    finally:
        for c in comms:
            c.close()


@pytest.fixture
def rng(request):
    return np.random.default_rng(abs(hash(request.node.nodeid)) % (2**32))


def test_smoke_single_rank(rng):
    """The module loads, the daemon launches, a one-rank all-reduce copies."""
    (c,) = dfccl.Communicator.for_devices([0], backend="cuda")
    try:
        x = rng.standard_normal(1000).astype(np.float32)
        send = arrays.from_numpy("cuda", 0, x)
        recv = arrays.empty("cuda", 0, 1000, np.float32, fill=77)
        c.all_reduce(send, recv).synchronize(timeout=30)
        np.testing.assert_array_equal(recv.download(), x)
        daemon = runtime.get_daemon("cuda", 0)
        assert daemon.launches >= 1
        sms = daemon.daemon_sms()   # every block launched, each on a real SM
        assert len(sms) == daemon.nblocks and all(s is not None and 0 <= s < daemon.device.sm_count for s in sms), sms
        record("smoke", launches=daemon.launches, blocks=daemon.nblocks, sms=sms)
    finally:
        c.close()


CASES = [
    ("all_reduce", "float32", "sum"), ("all_reduce", "float16", "sum"), ("all_reduce", "int32", "max"),
    ("all_reduce", "int8", "sum"), ("all_reduce", "float64", "prod"), ("all_reduce", "uint64", "min"),
    ("all_reduce", "int64", "avg"), ("all_reduce", "float32", "avg"),
    ("all_gather", "float32", "sum"), ("all_gather", "int8", "sum"),
    ("reduce_scatter", "float32", "sum"), ("reduce_scatter", "int32", "min"), ("reduce_scatter", "float16", "max"),
    ("broadcast", "float32", "sum"), ("broadcast", "uint8", "sum"),
    ("reduce", "float32", "sum"), ("reduce", "int64", "max"),
]
SIZES = [1, 7, 4099, (1 << 20) + 3, 16 << 20]


@pytest.mark.parametrize("path", ["direct", "ring"])
@pytest.mark.parametrize("kind,dtype,op", CASES)
def test_collectives(comms2, path, kind, dtype, op, rng):
    comms = comms2[path]
    for count in SIZES:
        if kind in ("all_gather", "reduce_scatter"):
            count = max(1, count // 2)
        for root in (0, 1) if kind in ("broadcast", "reduce") else (0,):
            spec = sc.Spec(f"{kind}-{count}-{root}", kind, count, dtype, op, root)
            sc.run(comms, [spec], [[0], [0]], rng=rng, timeout=60)


@pytest.mark.parametrize("path", ["direct", "ring"])
def test_in_place(comms2, path, rng):
    comms = comms2[path]
    n = len(comms)
    count = (1 << 18) + 5
    xs = [rng.standard_normal(count * n).astype(np.float32) for _ in range(n)]
    bufs = [arrays.from_numpy("cuda", c.device, x) for c, x in zip(comms, xs)]
    ws = [c.all_reduce(b, tag="ip-ar") for c, b in zip(comms, bufs)]
    for w in ws:
        w.synchronize(timeout=60)
    want = sc.reduce_reference(xs, "sum")
    for b in bufs:
        sc.assert_close(b.download(), want, "float32", "sum", n, f"in-place all_reduce {path}")
    # all_gather in place: each rank's input is its slice of the output.
    for c, b, x in zip(comms, bufs, xs):
        b.upload(x)
    ws = [c.all_gather(b[c.rank * count:(c.rank + 1) * count], b, tag="ip-ag") for c, b in zip(comms, bufs)]
    for w in ws:
        w.synchronize(timeout=60)
    want = np.concatenate([x[r * count:(r + 1) * count] for r, x in enumerate(xs)])
    for b in bufs:
        np.testing.assert_array_equal(b.download(), want)
    # reduce_scatter in place: each rank's output is its slice of the input.
    for b, x in zip(bufs, xs):
        b.upload(x)
    ws = [c.reduce_scatter(b, b[c.rank * count:(c.rank + 1) * count], tag="ip-rs") for c, b in zip(comms, bufs)]
    for w in ws:
        w.synchronize(timeout=60)
    total = sc.reduce_reference(xs, "sum")
    for c, b in zip(comms, bufs):
        got = b.download()[c.rank * count:(c.rank + 1) * count]
        sc.assert_close(got, total[c.rank * count:(c.rank + 1) * count], "float32", "sum", n, "in-place rs")


@pytest.mark.parametrize("path", ["direct", "ring"])
def test_one_gib(comms2, path, rng):
    """1 GiB all-reduce (float32), checked element by element."""
    comms = comms2[path]
    spec = sc.Spec("gib", "all_reduce", 1 << 28, "float32")
    t0 = time.perf_counter()
    sc.run(comms, [spec], [[0]] * len(comms), rng=rng, timeout=300)
    record("one_gib", path=path, seconds=time.perf_counter() - t0)


def test_bit_identical_to_uninterrupted(rng):
    """The same collectives give bit-identical results whether they ran
    uninterrupted (same order everywhere) or were preempted and resumed
    (reversed order on one rank)."""
    comms = dfccl.Communicator.for_devices(gpu_devices(2), backend="cuda")
    try:
        specs = [sc.Spec(f"b{i}", "all_reduce", (1 << 16) * (i + 1) + i, "float32") for i in range(6)]
        inputs = [[sc.random_input(rng, "float32", s.count, "sum") for _ in comms] for s in specs]

        def once(orders):
            outs = []
            bufs = [[arrays.from_numpy("cuda", c.device, inputs[i][r]) for r, c in enumerate(comms)]
                    for i in range(len(specs))]
            works = {}
            for r, c in enumerate(comms):
                for i in orders[r]:
                    works[(i, r)] = c.all_reduce(bufs[i][r], tag=(specs[i].tag, tuple(orders[0])))
            for w in works.values():
                w.synchronize(timeout=60)
            pre = sum(w.stats["preemptions"] for w in works.values())
            for i in range(len(specs)):
                outs.append([bufs[i][r].download() for r in range(len(comms))])
            return outs, pre

        calm, _ = once([list(range(6))] * 2)
        rough, pre = once([list(range(6)), list(range(5, -1, -1))])
        for i in range(len(specs)):
            for r in range(len(comms)):
                assert calm[i][r].tobytes() == rough[i][r].tobytes(), f"{specs[i].tag} rank {r} differs"
        record("bit_identical", preemptions=pre)
    finally:
        for c in comms:
            c.close()


@pytest.mark.parametrize("nranks", [4, 8])
@pytest.mark.parametrize("path", ["direct", "ring"])
def test_several_ranks_per_gpu(nranks, path, rng):
    """4- and 8-rank rings on the GPUs we have (several ranks per GPU)."""
    comms = dfccl.Communicator.for_devices(gpu_devices(nranks), backend="cuda", options=dfccl.CommOptions(path=path))
    try:
        specs = sc.random_specs(rng, 12, nranks=nranks, max_bytes=4 << 20)
        orders = [list(rng.permutation(len(specs))) for _ in range(nranks)]
        rep = sc.run(comms, specs, orders, rng=rng, timeout=120)
        record("several_ranks_per_gpu", nranks=nranks, path=path, seconds=rep.seconds,
               preemptions=rep.total_preemptions)
    finally:
        for c in comms:
            c.close()


def test_threads_driving_communicators_that_share_devices(rng):
    """Two communicators on the same GPUs share each device's daemon; a
    thread drives each as fast as it can (submissions from both threads
    reach one ring; a waiter must see its collective complete although the
    other thread retired it first)."""
    devs = gpu_devices(2)
    pairs = {name: dfccl.Communicator.for_devices(devs, backend="cuda") for name in ("a", "b")}
    seeds = {name: int(rng.integers(1 << 31)) for name in pairs}
    errors, rounds = [], 500

    def drive(name):
        comms, local = pairs[name], np.random.default_rng(seeds[name])
        try:
            for i in range(rounds):
                host = [local.integers(-1000, 1000, 256).astype(np.int32) for _ in range(2)]
                bufs = [arrays.from_numpy("cuda", devs[r], host[r]) for r in range(2)]
                works = [comms[r].all_reduce(bufs[r]) for r in range(2)]
                for w in works:
                    w.synchronize(timeout=60)
                for r in range(2):
                    if not np.array_equal(arrays.to_numpy(bufs[r]), host[0] + host[1]):
                        errors.append(f"{name}, round {i}, rank {r}: wrong sum")
                        return
        except Exception as exc:  # reported below, with the thread's name
            errors.append(f"{name}: {type(exc).__name__}: {exc}")

    t0 = time.monotonic()
    try:
        sc.run_concurrently([lambda n=name: drive(n) for name in pairs], timeout=240)
    finally:
        for comms in pairs.values():
            for c in comms:
                c.close()
    assert not errors, errors
    record("threads_sharing_devices", rounds=rounds, seconds=time.monotonic() - t0)


# -- deadlock scenarios ----------------------------------------------------------------
@pytest.mark.parametrize("path", ["direct", "ring"])
def test_inconsistent_order(comms2, path, rng):
    comms = comms2[path]
    specs = [sc.Spec("A", "all_reduce", 1 << 22, "float32"), sc.Spec("B", "all_reduce", 1 << 12, "int32", "max")]
    rep = sc.run(comms, specs, [[0, 1], [1, 0]], rng=rng, timeout=60)
    record("inconsistent_order", path=path, seconds=rep.seconds, preemptions=rep.preemptions)


@pytest.mark.parametrize("path", ["direct", "ring"])
def test_wait_between_collectives(comms2, path, rng):
    comms = comms2[path]
    specs = sc.random_specs(rng, 6, nranks=2, max_bytes=4 << 20)
    rep = sc.run(comms, specs, [list(range(6)), list(range(5, -1, -1))], rng=rng, threads=True, wait_each={0},
                 timeout=60)
    record("wait_between", path=path, seconds=rep.seconds, preemptions=rep.total_preemptions)


@pytest.mark.parametrize("path", ["direct", "ring"])
def test_device_synchronize_while_collective_waits(comms2, path, rng):
    """cuCtxSynchronize on rank 0's GPU while its collective waits for rank 1,
    which submits only after the synchronise returned (one thread drives
    both): the daemon leaves the GPU when it makes no progress, so the
    synchronise returns; the daemon's watcher brings the daemon back."""
    comms = comms2[path]
    specs = [sc.Spec(f"sync{i}", "all_reduce", 1 << 20, "float32") for i in range(4)]
    sync_times = []

    def sync_first(rank, k):
        if rank == 1:
            t0 = time.perf_counter()
            runtime.device_synchronize("cuda", comms[0].device)
            sync_times.append(time.perf_counter() - t0)

    rep = sc.run(comms, specs, [list(range(4))] * 2, rng=rng, between=sync_first, timeout=60)
    record("device_sync", path=path, seconds=rep.seconds, sync_seconds=sync_times)


_SYNC_AFTER_LAST = r"""
import sys, time, numpy as np, dfccl
from dfccl import runtime
from dfccl.bench import arrays
n = runtime.cuda_device_count()
empty = int(sys.argv[1])
opts = dfccl.DaemonOptions(idle_quit_ns=30 * 10**9, empty_quit_ns=empty or None)
comms = dfccl.Communicator.for_devices([0, 1 % n], backend="cuda", daemon_options=opts)
rng = np.random.default_rng()
hosts = [rng.standard_normal(1 << 18).astype(np.float32) for _ in comms]
bufs = [arrays.from_numpy("cuda", c.device, h) for c, h in zip(comms, hosts)]
for w in [c.all_reduce(b) for c, b in zip(comms, bufs)]:
    w.synchronize(timeout=30)
t0 = time.perf_counter()
runtime.device_synchronize("cuda", comms[0].device)
sync = time.perf_counter() - t0
got = arrays.to_numpy(bufs[0])
assert np.allclose(got, hosts[0] + hosts[1], rtol=1e-5, atol=1e-5)
t0 = time.perf_counter()
for c in comms:
    c.close()
runtime.shutdown()
print("RESULT", sync, time.perf_counter() - t0)
"""


@pytest.mark.parametrize("empty_quit", ["default", "2s"])
def test_device_synchronize_after_the_last_collective(empty_quit):
    """A device-wide synchronisation right after the last collective
    completed (torch.cuda.synchronize() at the end of a training step)
    returns once the daemon, with nothing left to run, leaves: after
    empty_quit_ns (50 us by default), however long the idle quit (30 s
    here).  The control keeps the daemon 2 s: the synchronisation waits for
    it, which is what a step paid with the 5 ms idle quit alone.  In a
    fresh process: daemon options are fixed per process and device."""
    import subprocess
    import sys
    arg = "0" if empty_quit == "default" else str(2 * 10**9)
    out = subprocess.run([sys.executable, "-c", _SYNC_AFTER_LAST, arg], capture_output=True, text=True, timeout=120)
    assert "RESULT" in out.stdout, out.stdout + out.stderr
    sync, close = map(float, out.stdout.split("RESULT")[1].split())
    record("sync_after_last", empty_quit=empty_quit, sync_seconds=sync, close_seconds=close)
    if empty_quit == "default":
        assert sync < 0.5 and close < 5, (sync, close)
    else:
        assert sync > 1.0, f"the synchronisation did not wait for the resident daemon ({sync:.3f} s)"


_NVRTC_ALL_REDUCE = r"""
import numpy as np, dfccl
from dfccl import runtime
from dfccl.bench import arrays
n = runtime.cuda_device_count()
comms = dfccl.Communicator.for_devices([0, 1 % n], backend="cuda")
hosts = [np.full(1 << 16, r + 1, np.float32) for r in range(2)]
bufs = [arrays.from_numpy("cuda", c.device, h) for c, h in zip(comms, hosts)]
for w in [c.all_reduce(b, tag="nvrtc") for c, b in zip(comms, bufs)]:
    w.synchronize(timeout=60)
assert (arrays.to_numpy(bufs[0]) == 3).all() and (arrays.to_numpy(bufs[1]) == 3).all()
print("RESULT ok")
"""


@pytest.mark.timeout(1800)  # the first run compiles the whole daemon (minutes of one core)
def test_nvrtc_image_is_compiled_once_and_cached(tmp_path):
    """Without a fatbin (an install on a machine without a GPU) the daemon is
    compiled with NVRTC at first use, announced on stderr, kept in
    DFCCL_CACHE_DIR, and the next process loads it from there; both run a
    collective with it.  Fresh processes: the image is read once a process."""
    import subprocess
    import sys
    env = dict(os.environ, DFCCL_FORCE_NVRTC="1", DFCCL_CACHE_DIR=str(tmp_path))
    runs = [subprocess.run([sys.executable, "-c", _NVRTC_ALL_REDUCE], capture_output=True, text=True, timeout=800,
                           env=env) for _ in range(2)]
    for out in runs:
        assert "RESULT ok" in out.stdout, out.stdout + out.stderr
    assert "compiling the daemon kernel for sm_" in runs[0].stderr and str(tmp_path) in runs[0].stderr
    assert "compiling" not in runs[1].stderr, runs[1].stderr
    cached = list(tmp_path.iterdir())
    assert len(cached) == 1 and cached[0].name.startswith("daemon-sm_") and cached[0].suffix == ".cubin"


@pytest.mark.timeout(1800)  # without an installed fatbin, the reference image is compiled with NVRTC first
def test_daemon_image_from_the_environment(tmp_path):
    """DFCCL_DAEMON_IMAGE names the image a process loads instead of the
    installed one (a profiling build, say): a copy of the installed image runs
    a collective; a file that is not an image is refused when the daemon
    starts, naming the variable."""
    import subprocess
    import sys
    image = tmp_path / "daemon.fatbin"
    image.write_bytes(runtime.daemon_image(runtime.compute_capability(0)))
    ok = subprocess.run([sys.executable, "-c", _NVRTC_ALL_REDUCE], capture_output=True, text=True, timeout=800,
                        env=dict(os.environ, DFCCL_DAEMON_IMAGE=str(image)))
    assert "RESULT ok" in ok.stdout, ok.stdout + ok.stderr
    bad = tmp_path / "notes.txt"
    bad.write_text("not a kernel")
    refused = subprocess.run([sys.executable, "-c", _NVRTC_ALL_REDUCE], capture_output=True, text=True, timeout=120,
                             env=dict(os.environ, DFCCL_DAEMON_IMAGE=str(bad)))
    assert "RESULT ok" not in refused.stdout
    assert "DFCCL_DAEMON_IMAGE=" in refused.stderr and "not a daemon image" in refused.stderr, refused.stderr


def test_long_compute_kernels_while_pending(comms2, rng):
    """Long compute kernels occupy both GPUs while collectives are pending in
    rank-divergent order; everything completes and the compute is right."""
    torch = pytest.importorskip("torch")
    comms = comms2["direct"]
    specs = [sc.Spec(f"k{i}", "all_reduce", 1 << 20, "float32") for i in range(4)]
    insts = [sc.prepare(s, comms, rng) for s in specs]
    mats = []
    for c in comms:
        with torch.cuda.device(c.device):
            a = torch.randn(4096, 4096, device=f"cuda:{c.device}")
            mats.append((a, [a @ a for _ in range(2)]))
    for i in range(4):
        sc.submit(insts[i], comms[0])
    for c, (a, _) in zip(comms, mats):
        with torch.cuda.device(c.device):
            for _ in range(200):  # ~0.5 s of matrix products per GPU
                a = torch.tanh(a @ a * 1e-3)
    for i in range(3, -1, -1):
        sc.submit(insts[i], comms[1])
    for inst in insts:
        for w in inst.works:
            w.synchronize(timeout=120)
        sc.verify(inst)
    torch.cuda.synchronize()


def test_chaos(rng):
    """8 ranks on the GPUs (4 per GPU on two), 32 collectives each in its own
    permutation, many rounds with fresh data: no wrong element; preemptions per
    collective reported."""
    rounds = int(os.environ.get("DFCCL_GPU_CHAOS_ROUNDS", "100"))
    comms = dfccl.Communicator.for_devices(gpu_devices(8), backend="cuda")
    try:
        specs = sc.random_specs(rng, 32, nranks=8, max_bytes=1 << 20)
        orders = [list(rng.permutation(len(specs))) for _ in range(8)]
        rep = sc.run(comms, specs, orders, rng=rng, rounds=rounds, timeout=300)
        record("chaos", rounds=rounds, seconds=rep.seconds, collectives=rep.collectives,
               preemptions=rep.preemptions, resumes=rep.resumes, path=comms[0].path)
        assert rep.collectives == 32 * rounds
    finally:
        for c in comms:
            c.close()


def test_control_without_preemption_hangs():
    """Control on the GPU: with preemption off (run to completion, like NCCL),
    A,B vs B,A never completes -- the timeouts name the peer each side waits
    for -- and abort() releases both.  In a fresh process, because daemon
    options are fixed per process and device.  One daemon block, as NCCL runs
    one kernel at a time per stream: with more, A and B may land on different
    blocks and run side by side."""
    import subprocess
    import sys
    code = r"""
import numpy as np, dfccl, sys
from dfccl import runtime
from dfccl_support import scenarios as sc
n = runtime.cuda_device_count()
comms = dfccl.Communicator.for_devices([0, 1 % n], backend="cuda",
        daemon_options=dfccl.DaemonOptions(preemption=False, blocks=1), options=dfccl.CommOptions(path="direct"))
rng = np.random.default_rng(0)
specs = [sc.Spec("A", "all_reduce", 4096, "float32"), sc.Spec("B", "all_reduce", 4096, "float32")]
insts = [sc.prepare(s, comms, rng) for s in specs]
sc.submit(insts[0], comms[0]); sc.submit(insts[1], comms[0])
sc.submit(insts[1], comms[1]); sc.submit(insts[0], comms[1])
hung = 0
for w in (insts[0].works[0], insts[1].works[1]):
    try:
        w.synchronize(timeout=2.0)
    except dfccl.CollectiveTimeoutError as e:
        hung += 1
        print("timeout:", e)
for c in comms:
    c.abort()
print("RESULT", hung, sc.settle_after_abort(insts))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "RESULT" in out.stdout, out.stdout + out.stderr
    hung, finished = map(int, out.stdout.split("RESULT")[1].split())
    record("control_no_preemption", hung=hung, finished_after_abort=finished)
    assert hung == 2 and finished == 4, out.stdout


# -- NCCL on the same scenarios -----------------------------------------------------------
@pytest.mark.multigpu
def test_nccl_stream_ordered_inconsistent_order_hangs():
    """NCCL on the canonical case dfccl completes above (test_inconsistent_order):
    two communicators whose collectives share one stream per GPU, issued in
    opposite orders (NCCL through CuPy, one thread per GPU).  NCCL hangs."""
    from dfccl_support import nccl_reference

    if not nccl_reference.cupy_nccl_available(2):
        pytest.skip("CuPy with NCCL and two GPUs are needed (pip install cupy-cuda13x)")
    verdict = nccl_reference.stream_order_reference(timeout=10.0)
    record("nccl_reference", scenario="inconsistent_order_one_stream", **verdict)
    assert verdict["outcome"] == "hung", verdict


@pytest.mark.multigpu
@pytest.mark.parametrize("scenario", ["inconsistent_order_two_groups", "inconsistent_order_one_group",
                                      "wait_between", "device_sync"])
def test_nccl_through_torch_on_same_scenario(scenario):
    """The same scenarios through torch.distributed (NCCL, one process per GPU),
    recorded as they come out.  torch gives every process group its own
    stream, so opposite orders on two groups can run concurrently and
    complete; a synchronise between the collectives hangs, and opposite
    orders within one communicator reduce A with B."""
    ref = pytest.importorskip("dfccl_support.nccl_reference")
    if not ref.available("nccl"):
        pytest.skip("torch.distributed with NCCL is not available")
    verdict = ref.run_nccl_scenario(scenario, world_size=2, timeout=10.0)
    record("nccl_reference", scenario=scenario, outcome=verdict.outcome, seconds=verdict.seconds,
           detail=verdict.detail[:300])
    assert verdict.outcome != "error", verdict
    if scenario == "device_sync":
        assert verdict.outcome == "hung", verdict
    if scenario == "inconsistent_order_one_group":
        assert verdict.outcome in ("wrong_result", "hung"), verdict


def test_forked_child_on_gpu():
    """A process that forks after dfccl initialised CUDA: the child fails
    clearly (the parent's communicators and pending collectives are not its
    own; CUDA is refused with the 'spawn' advice), its exit handlers return
    at once and make no CUDA call, and the parent's collectives go on."""
    from dfccl_support.forking import outcomes, run_in_forked_child

    comms = dfccl.Communicator.for_devices(gpu_devices(2), backend="cuda")
    try:
        host = np.random.default_rng().standard_normal(4096).astype(np.float32)
        x = [arrays.from_numpy("cuda", c.device, host + r) for r, c in enumerate(comms)]
        pending = comms[0].all_reduce(x[0], tag="across the fork")   # rank 1 joins after the child is gone

        def child():
            return outcomes({"submit": lambda: comms[0].all_reduce(x[0], tag="in the child"),
                             "pending": lambda: pending.synchronize(timeout=10),
                             "new": lambda: dfccl.Communicator.for_devices([0], backend="cuda"),
                             "close": lambda: [c.close() for c in comms]})

        out = run_in_forked_child(child)
        assert "error" not in out, out
        assert out["submit"].startswith("ClosedError") and "forked this process" in out["submit"], out
        assert out["pending"].startswith("ClosedError") and "forked this process" in out["pending"], out
        assert out["new"].startswith("BackendError") and "'spawn'" in out["new"], out
        assert out["close"] is None and out["close_s"] < 1.0 and out["exit_s"] < 2.0, out
        comms[1].all_reduce(x[1], tag="across the fork").synchronize(timeout=30)
        pending.synchronize(timeout=30)
        want = 2 * host + 1
        for a in x:
            sc.assert_close(arrays.to_numpy(a), want, "float32", "sum", 2)
    finally:
        sc.settle(comms)


@pytest.mark.no_mps
def test_device_fault_fails_pending_collectives():
    """Another kernel of the process faults (an illegal address): the CUDA
    daemon fails and the daemon with it, so the collective a synchronize()
    waits for never completes.  The watcher finds the fault (cuStreamQuery
    on the daemon's stream) within 100 ms: synchronize() raises a
    BackendError naming it, and close() returns at once.  In a subprocess:
    the fault ends every kernel of the process."""
    pytest.importorskip("cupy")
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import time
        import cupy
        import dfccl
        comms = dfccl.Communicator.for_devices([0, 0], backend="cuda")
        x = cupy.ones(64, cupy.float32)
        w = comms[0].all_reduce(x, tag="waits")   # rank 1 never joins
        time.sleep(0.2)
        bad = cupy.RawKernel(r'extern "C" __global__ void bad() { *(volatile int *)16 = 1; }', "bad")
        bad((1,), (1,), ())
        t0 = time.monotonic()
        try:
            w.synchronize()
            print("NO ERROR", flush=True)
        except dfccl.BackendError as exc:
            print("FAULT", round(time.monotonic() - t0, 3), exc, flush=True)
        t0 = time.monotonic()
        for c in comms:
            c.close()
        print("CLOSED", round(time.monotonic() - t0, 3), flush=True)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    lines = r.stdout.splitlines()
    fault = next((l for l in lines if l.startswith(("FAULT", "NO ERROR"))), None)
    closed = next((l for l in lines if l.startswith("CLOSED")), None)
    record("device_fault", fault=fault, closed=closed)
    assert fault is not None and fault.startswith("FAULT"), r.stdout + r.stderr
    assert "CUDA_ERROR_ILLEGAL_ADDRESS" in fault and float(fault.split()[1]) < 5.0, fault
    assert closed is not None and float(closed.split()[1]) < 5.0, r.stdout + r.stderr
