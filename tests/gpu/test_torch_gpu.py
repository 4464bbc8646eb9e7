"""The torch.distributed backend with one process per rank on GPUs: the
simulator scenarios with CUDA tensors (collectives, point to point and
all-to-all), plus what only CUDA has: stream ordering, a host that never
blocks, side streams, timeouts and graph capture.

On two GPUs, or on one shared through MPS (``DFCCL_TEST_MPS=1``, marker
``gpu_processes``, with eager module loading in the ranks): without MPS two
processes on one GPU are time-sliced (each collective waits for the other
process's slice, milliseconds), and these scenarios then outrun their time
limits (seen on one H200)."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import tempfile
import threading
import time
import traceback
from datetime import timedelta

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from net_scenarios import UCX_ENV, needs_ucx  # noqa: E402
from torch_scenarios import (_all_reduce_fast_path, _all_reduce_ops, _all_to_all, _async_and_futures,  # noqa: E402
                             _ddp_default, _ddp_hook, _fsdp2, _functional, _gather_scatter, _hierarchical_all_reduce,
                             _point_to_point, _unsupported)

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_processes, pytest.mark.timeout(180),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU visible to torch")]

WORLD = 2


def _worker(fn, rank, world_size, store_path, results, stacks_after_s, stacks_path, impl, per_host):
    import faulthandler

    if impl is not None:
        os.environ["DFCCL_TORCH_IMPL"] = impl   # read when dfccl.torch is imported, below
    if per_host:
        # Ranks on "different hosts" of this machine: the network path (UCX
        # over TCP on loopback), per_host ranks on each.
        os.environ.update(UCX_ENV)
        os.environ["DFCCL_HOST_ID"] = f"torch-host-{rank // per_host}"

    # A stuck rank shows where: every thread's stack, written without the GIL
    # to a file the harness reads back (pytest's capture of a child's stderr
    # is lost when the child is killed).
    stacks = open(stacks_path, "w")
    faulthandler.dump_traceback_later(stacks_after_s, exit=False, file=stacks)
    try:
        import dfccl.torch as dt

        device = rank % torch.cuda.device_count()
        torch.cuda.set_device(device)
        torch.set_default_device(f"cuda:{device}")
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("dfccl", store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=30))
        comm = dt.communicator()

        def status_before_stacks():
            # What dfccl says it waits for (needs the GIL: skipped if held).
            time.sleep(max(1.0, stacks_after_s - 10))
            try:
                stacks.write(f"rank {rank} status: {comm.status()}\n")
                stacks.write(_daemon_side(comm))
                stacks.flush()
                stacks.write(_device_probe())
                stacks.flush()
            except Exception:
                pass  # closed meanwhile: nothing was stuck

        threading.Thread(target=status_before_stacks, daemon=True).start()
        try:
            fn(rank, world_size)
            torch.cuda.synchronize()
        finally:
            dist.destroy_process_group()
        results.put((rank, None))
    except BaseException:
        results.put((rank, traceback.format_exc()))
    finally:
        faulthandler.cancel_dump_traceback_later()


def _daemon_side(comm) -> str:
    """Why this rank's daemon has not started what is pending: whether it
    runs, whether it has taken each submission up, and whether the stream
    of a stream-ordered one has armed it.  Host memory only, but for the
    armed words (bounded reads)."""
    daemon = comm._daemon
    published, taken = daemon.submissions
    lines = [f"  daemon {daemon.daemon_state} (daemon epoch {daemon.epoch}, launches {daemon.launches}), "
             f"submissions published {published}, taken {taken}, streams waiting {daemon.stream_waits}"]
    for w in daemon.pending_works(comm._endpoint.id):
        lines.append(f"  {w.kind} tag {w.tag!r} instance {w.instance}: entry {w.position} "
                     f"({'taken' if taken > w.position else 'not taken'}), "
                     + (f"stream-ordered, armed {daemon.stream_reached(w)}" if w.stream_ordered else "armed at submission")
                     + f", waiting for {w.waiting_for()}, done {w.done()}")
    return "\n".join(lines) + "\n"


def _device_probe(wait_s: float = 1.0) -> str:
    """Whether this process can still run work on its GPU while it stalls:
    a kernel on a fresh stream, then a device-to-host copy on it, each
    given ``wait_s`` (a stall that holds every queue of the process up
    differs from one stream held behind a collective)."""
    lines = []
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        x = torch.empty(16, device=torch.cuda.current_device())
        for what, op in (("a kernel", lambda: x.fill_(2.0)),
                         ("a device-to-host copy", lambda: x.to("cpu", non_blocking=True))):
            done = torch.cuda.Event()
            op()
            done.record(stream)
            t0 = time.monotonic()
            while not done.query() and time.monotonic() - t0 < wait_s:
                time.sleep(0.01)
            lines.append(f"  probe: {what} on a fresh stream " + ("ran" if done.query() else f"did not run within {wait_s} s"))
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def _rank_environment():
    """The environment the ranks start with.  Two processes on one GPU with
    lazy module loading stop in a torch kernel's first launch between
    collectives (docs/torch.md, "Known problems"; dfccl warns of it at
    start-up), so under MPS they load eagerly.  CUDA reads the variable
    when it starts, which in a rank is at the import of this module."""
    if os.environ.get("DFCCL_TEST_MPS", "") in ("", "0") or "CUDA_MODULE_LOADING" in os.environ:
        yield
        return
    os.environ["CUDA_MODULE_LOADING"] = "EAGER"
    try:
        yield
    finally:
        del os.environ["CUDA_MODULE_LOADING"]


def run_gpus(fn, world_size: int = WORLD, join_s: float = 90.0, impl: str | None = None, per_host: int = 0) -> None:
    """Runs fn(rank, world_size) in one process per rank; ``impl``: the
    backend implementation ("compiled", "python"; None: dfccl.torch's
    default); ``per_host``: ranks on each "host" (0: all on this one)."""
    mp_context = mp.get_context("spawn")
    results = mp_context.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "store")
        stacks = [os.path.join(tmp, f"stacks-{r}.txt") for r in range(world_size)]
        procs = [mp_context.Process(target=_worker,
                                    args=(fn, r, world_size, path, results, join_s - 30, stacks[r], impl, per_host))
                 for r in range(world_size)]
        with _rank_environment():
            for p in procs:
                p.start()
        errors = {}
        try:
            for _ in procs:
                rank, err = results.get(timeout=join_s)
                if err is not None:
                    errors[rank] = err
        except Exception:
            errors["harness"] = f"a rank did not report within {join_s} s"
            for r, f in enumerate(stacks):
                if os.path.exists(f) and os.path.getsize(f):
                    errors[f"stacks of rank {r} after {join_s - 30:g} s"] = open(f).read()
        finally:
            for p in procs:
                p.join(timeout=20)
                if p.is_alive():
                    p.kill()
                    p.join()
    assert not errors, "\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(errors.items(), key=str))


# -- CUDA-only scenarios -----------------------------------------------------------

def _streams(rank, ws):
    dev = torch.device("cuda", torch.cuda.current_device())
    store = dist.distributed_c10d._get_default_store()
    total = float(sum(range(1, ws + 1)))
    # Ordered after the current stream: the fill runs after a long kernel, and
    # the collective must see the filled values.
    t = torch.zeros(1 << 20, device=dev)
    torch.cuda._sleep(20_000_000)
    t.fill_(rank + 1)
    dist.all_reduce(t)
    torch.cuda.synchronize()
    assert bool((t == total).all())
    # The host never blocks: rank 0's blocking-style call returns before rank 1
    # has even issued its collective; the stream waits instead.
    t = torch.full((4096,), float(rank + 1), device=dev)
    if rank == 0:
        start = time.monotonic()
        dist.all_reduce(t)
        assert time.monotonic() - start < 5.0
        store.set("rank0_returned", "1")
    else:
        store.wait(["rank0_returned"])
        dist.all_reduce(t)
    torch.cuda.synchronize()
    assert bool((t == total).all())
    # A side stream: the collective follows it, wait() makes it wait.
    side = torch.cuda.Stream(device=dev)
    with torch.cuda.stream(side):
        t = torch.full((1000,), float(rank + 1), device=dev)
        w = dist.all_reduce(t, async_op=True)
        w.wait()
        u = t * 2
    side.synchronize()
    assert bool((u == 2 * total).all())
    # Futures are stream-ordered (DDP's get_future path).
    t = torch.full((10,), float(rank + 1), device=dev)
    fut = dist.all_reduce(t, async_op=True).get_future()
    assert bool((fut.wait()[0] == total).all())


def _divergent_order(rank, ws):
    """Two communicators over the same ranks, submitted in opposite orders on
    one stream (NCCL hangs here); async_op=True, so no stream waits between."""
    g = dist.new_group([0, 1])
    a = torch.full((1 << 16,), float(rank + 1))
    b = torch.full((1 << 10,), float(10 * (rank + 1)))
    if rank == 0:
        works = [dist.all_reduce(a, async_op=True), dist.all_reduce(b, group=g, async_op=True)]
    else:
        works = [dist.all_reduce(b, group=g, async_op=True), dist.all_reduce(a, async_op=True)]
    for w in works:
        w.wait()
    torch.cuda.synchronize()
    assert bool((a == 3.0).all()) and bool((b == 30.0).all())


def _timeout(rank, ws):
    import dfccl.torch as dt

    store = dist.distributed_c10d._get_default_store()
    t = torch.ones(64)
    if rank == 0:
        w = dist.all_reduce(t, async_op=True)
        with pytest.raises(dt.TorchCollectiveTimeoutError, match="did not complete within"):
            w.wait(timeout=timedelta(seconds=0.5))  # an explicit timeout blocks the host
        store.set("go", "1")
        w.wait(timeout=timedelta(seconds=30))
    else:
        store.wait(["go"])
        dist.all_reduce(t)
    torch.cuda.synchronize()
    assert bool((t == 2.0).all())


def _graph_capture(rank, ws):
    """Collectives captured in torch.cuda.graph run at each replay: two
    all-reduces issued in opposite orders on the two ranks (async, waited
    for at the end of the capture), an all_to_all_single with uneven splits
    and a barrier, replayed with fresh inputs and eager collectives of the
    same shapes in between; a host wait on a captured work is refused;
    resetting the graph gives back what the capture held.  The compiled
    backend captures all but the all-to-all through the C API: only that
    one reaches its Python side."""
    import dfccl.torch as dt

    backend = dt.backend_of(None, "cuda")
    compiled = not isinstance(backend, dt.ProcessGroupDfccl)

    a = torch.zeros(1000)
    b = torch.zeros(300_000)
    eager = torch.ones(1000)
    splits = [[3, 5], [7, 2]]                   # splits[r][p]: rank r sends rank p
    send = torch.zeros(sum(splits[rank]))
    recv = torch.zeros(splits[0][rank] + splits[1][rank])
    dist.all_reduce(eager)                      # outside capture: binds the shapes' plans
    handed = backend.counts()[1] if compiled else 0
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        first, second = (a, b) if rank == 0 else (b, a)
        works = [dist.all_reduce(first, async_op=True), dist.all_reduce(second, async_op=True)]
        for w in works:
            w.wait()
        dist.all_to_all_single(recv, send, output_split_sizes=[splits[0][rank], splits[1][rank]],
                               input_split_sizes=splits[rank])
        # captured: each replay waits for every rank's.  With its device named:
        # a group that serves CPU tensors too gets torch's plain barrier() on CPU.
        dist.barrier(device_ids=[torch.cuda.current_device()])
        # (the compiled backend may hand the error back through C++: matched by message)
        with pytest.raises(Exception, match="no completion on the host"):
            works[0].wait(timeout=timedelta(seconds=1))
        with pytest.raises(Exception, match="no completion on the host"):
            works[0].is_completed()
    if compiled:
        assert backend.counts()[1] == handed + 1, "only all_to_all_single goes to the Python side under capture"
    daemon = dt.communicator()._daemon
    assert len(daemon.captured) == 4
    for k in range(1, 51):
        a.fill_(float(rank + k))
        b.copy_(torch.arange(300_000, dtype=torch.float32) * (rank + 1) + k)
        send.copy_(torch.arange(send.numel(), dtype=torch.float32) + 100 * rank + 1000 * k)
        graph.replay()
        eager.fill_(1.0)
        dist.all_reduce(eager)                  # an eager collective of a's shape between replays
        torch.cuda.synchronize()
        assert bool((a == 2 * k + 1).all()), k
        assert bool((b == torch.arange(300_000, dtype=torch.float32) * 3 + 2 * k).all()), k
        assert bool((eager == 2.0).all()), k
        # Rank p's part from rank r starts at sum(splits[r][:p]) of r's send.
        parts = [torch.arange(sum(splits[r][:rank]), sum(splits[r][:rank + 1]), dtype=torch.float32)
                 + 100 * r + 1000 * k for r in range(2)]
        assert bool((recv == torch.cat(parts)).all()), k
    graph.reset()
    torch.cuda.synchronize()
    deadline = time.monotonic() + 5.0
    while daemon.captured and time.monotonic() < deadline:
        time.sleep(0.01)
    assert daemon.captured == []


# -- tests -------------------------------------------------------------------------

def test_all_reduce_every_op_gpu():
    run_gpus(_all_reduce_ops)


def test_all_reduce_fast_path_gpu():
    run_gpus(_all_reduce_fast_path)


def test_gather_scatter_broadcast_reduce_gpu():
    run_gpus(_gather_scatter)


def test_functional_collectives_gpu():
    run_gpus(_functional)


def test_async_ops_and_futures_gpu():
    run_gpus(_async_and_futures)


def test_ddp_gpu():
    run_gpus(_ddp_default)


def test_ddp_tagged_hook_gpu():
    run_gpus(_ddp_hook)


@pytest.mark.multigpu
def test_fsdp2_gpu():
    """On two GPUs only.  Two processes on one GPU (MPS) share its hardware
    queues: FSDP2's side streams each wait for a collective, and those
    waits held every queue of both processes (a kernel on a fresh stream
    did not start in either; docs/torch.md, "Known problems"), so the
    other process's stream writes that arm its part never ran."""
    run_gpus(_fsdp2)


def test_unsupported_gpu():
    run_gpus(_unsupported)


def test_stream_semantics():
    run_gpus(_streams)


def test_divergent_order_one_stream():
    run_gpus(_divergent_order)


def test_timeout_gpu():
    run_gpus(_timeout)


@pytest.mark.parametrize("impl", ["compiled", "python"])
def test_graph_capture_replays(impl):
    run_gpus(_graph_capture, impl=impl)


def test_point_to_point_gpu():
    run_gpus(_point_to_point)


def test_all_to_all_gpu():
    run_gpus(_all_to_all)


@needs_ucx
@pytest.mark.parametrize("impl", ["compiled", "python"])
def test_hierarchical_all_reduce_across_hosts_gpu(impl):
    """Four processes, two per "host": a large all-reduce runs
    hierarchically through either implementation (test_torch_sim.py's)."""
    run_gpus(_hierarchical_all_reduce, world_size=4, join_s=150.0, impl=impl, per_host=2)


_DEVICE_ID = r"""
import torch, torch.distributed as dist
import dfccl.torch as dt
dist.init_process_group("dfccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
assert dt.backend_of(dist.group.WORLD, "cuda:0") is not None
t = torch.ones(8, device="cuda:0")
dist.all_reduce(t)
g = dist.new_group([0])
dist.all_reduce(t, group=g)
torch.cuda.synchronize()
assert bool((t == 1.0).all())
dist.destroy_process_group()
print("OK", dt.implementation())
"""


def test_init_with_device_id():
    """init_process_group(device_id=...) (eager init): torch asks the group
    for its CUDA backend, which the compiled backend registers."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _DEVICE_ID], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "OK compiled" in out.stdout, out.stdout + out.stderr
