"""The torch.distributed backend (dfccl.torch) on the simulator: 2-4 spawned
processes, CPU tensors, every collective and reduction checked against a
reference computed locally (modelled on PyTorch's test_c10d_pypg.py and
test_c10d_common.py).  The compiled backend runs every scenario; the Python
backend (where no C++ compiler is available) a representative few."""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import traceback
from datetime import timedelta

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch was built without torch.distributed", allow_module_level=True)

# Builds the compiled backend now, if it is not cached, rather than inside a
# timed test (a minute or two).
import dfccl.torch as dt  # noqa: E402
from net_scenarios import UCX_ENV, needs_ucx  # noqa: E402
from torch_scenarios import (_all_reduce_fast_path, _all_reduce_ops, _all_to_all, _async_and_futures, _ddp_default,  # noqa: E402
                             _ddp_hook, _divergent_groups, _fsdp2, _functional, _gather_scatter, _graph_capture_sim,
                             _hierarchical_all_reduce, _point_to_point, _timeouts_entry, _unsupported)

# A test's first use of a pool includes starting it (torch's import in four
# processes: seconds, more on a busy machine).
pytestmark = pytest.mark.timeout(180)


# -- harness -------------------------------------------------------------------------
# Importing torch costs seconds per process, so the ranks are a pool of
# processes kept for the whole module; each test initialises a fresh default
# process group in the first world_size of them and destroys it at the end.

POOL_SIZE = 4


def _pool_worker(rank, commands, results, impl, per_host):
    os.environ["DFCCL_TORCH_BACKEND"] = "sim"
    os.environ["DFCCL_TORCH_IMPL"] = impl
    if per_host:
        # Ranks on "different hosts" of this machine: the network path (UCX
        # over TCP on loopback), per_host ranks on each.
        os.environ.update(UCX_ENV)
        os.environ["DFCCL_HOST_ID"] = f"torch-host-{rank // per_host}"
    import dfccl.torch  # noqa: F401  (registers the backend)

    results.put((rank, "ready"))
    while True:
        item = commands.get()
        if item is None:
            # Interpreter finalisation with torch loaded takes seconds on a
            # busy machine: shut dfccl down and leave at once.
            import dfccl

            dfccl.shutdown()
            results.close()
            results.join_thread()
            os._exit(0)
        fn, world_size, store_path, timeout_s = item
        try:
            store = dist.FileStore(store_path, world_size)
            dist.init_process_group("dfccl", store=store, rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=timeout_s))
            try:
                fn(rank, world_size)
            finally:
                dist.destroy_process_group()
            results.put((rank, None))
        except BaseException:
            results.put((rank, traceback.format_exc()))


class _Pool:
    def __init__(self, impl: str, per_host: int = 0):
        self.mp_context = mp.get_context("spawn")
        self.results = self.mp_context.Queue()
        self.commands = [self.mp_context.Queue() for _ in range(POOL_SIZE)]
        self.procs = [self.mp_context.Process(target=_pool_worker,
                                              args=(r, self.commands[r], self.results, impl, per_host), daemon=True)
                      for r in range(POOL_SIZE)]
        for p in self.procs:
            p.start()
        self.ready = False

    def wait_ready(self, timeout_s: float = 150.0) -> None:
        """Waits until every process has imported torch and dfccl.torch, so
        that a test's time limit covers the test and not the start-up."""
        if self.ready:
            return
        for _ in self.procs:
            rank, what = self.results.get(timeout=timeout_s)
            assert what == "ready", f"pool process {rank}: {what}"
        self.ready = True

    def close(self, force: bool = False):
        for q, p in zip(self.commands, self.procs):
            if not force and p.is_alive():
                q.put(None)
        for p in self.procs:
            p.join(timeout=0 if force else 10)
            if p.is_alive():
                p.kill()
                p.join()


# The pools by implementation ("compiled", "python") and ranks per "host"
# (0: all on this one).
_pools: dict[tuple[str, int], _Pool] = {}


@pytest.fixture(scope="module", autouse=True)
def _pool_lifetime():
    yield
    for pool in _pools.values():
        pool.close()
    _pools.clear()


def run_ranks(fn, world_size: int = 2, timeout_s: float = 20.0, join_s: float = 40.0, impl: str = "compiled",
              per_host: int = 0) -> None:
    """Runs fn(rank, world_size) on world_size ranks of a fresh dfccl default
    process group made by the ``impl`` backend (``per_host`` ranks on each
    "host"; 0: one host); fails with the ranks' tracebacks."""
    pool = _pools.get((impl, per_host))
    if pool is None:
        pool = _pools[impl, per_host] = _Pool(impl, per_host)
    pool.wait_ready()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "store")
        for r in range(world_size):
            pool.commands[r].put((fn, world_size, path, timeout_s))
        errors = {}
        try:
            for _ in range(world_size):
                rank, err = pool.results.get(timeout=join_s)
                if err is not None:
                    errors[rank] = err
        except Exception:
            errors["harness"] = f"a rank did not report within {join_s} s"
    if errors:
        # A failed rank may leave collectives pending: start the next test afresh.
        pool.close(force=True)
        del _pools[impl, per_host]
    assert not errors, "\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(errors.items(), key=str))


# -- tests -------------------------------------------------------------------------------

def test_registered_backend():
    assert "DFCCL" in dist.Backend._plugins
    assert dt.BACKEND_NAME == "dfccl"
    assert set(dt.__all__) <= set(dir(dt))


def test_compiled_backend_where_a_compiler_is():
    """With a C++ compiler and ninja (CI has both), "dfccl" makes the
    compiled backend; its build is cached under dfccl's cache folder."""
    assert dt.implementation() == "compiled"
    assert dt.build_dir().is_dir()


def _compiled_paths(rank, ws):
    """The compiled backend submits the plain forms itself (no Python per
    call) and hands the others to its Python side; both on one group, in
    any mix across ranks, meet: rank 0's contiguous all-reduce meets rank
    1's non-contiguous one of the same shape."""
    pg = dist.group.WORLD
    backend = dt.backend_of(pg, "cpu")
    assert isinstance(backend.group, dt.ProcessGroupDfccl)
    native, handed = backend.counts()
    t = torch.full((6,), float(rank + 1))
    dist.all_reduce(t)
    dist.broadcast(t, src=0)
    out = torch.empty(6 * ws)
    dist.all_gather_into_tensor(out, t)
    assert backend.counts() == (native + 3, handed)
    x = torch.arange(12.0).reshape(3, 4) + rank
    x = x if rank == 0 else x.t().contiguous().t()    # same values, rank 1's not contiguous
    assert x.is_contiguous() == (rank == 0)
    dist.all_reduce(x)
    torch.testing.assert_close(x, sum(torch.arange(12.0).reshape(3, 4) + r for r in range(ws)))
    assert backend.counts()[1] == handed + (rank != 0)


def test_compiled_paths_meet():
    run_ranks(_compiled_paths, 2)


@needs_ucx
@pytest.mark.parametrize("impl", ["compiled", "python"])
def test_hierarchical_all_reduce_across_hosts(impl):
    """Four ranks, two per "host": a large all-reduce runs hierarchically
    (the compiled backend hands its shape to the Python side), the others
    as before."""
    run_ranks(_hierarchical_all_reduce, 4, timeout_s=60.0, join_s=120.0, impl=impl, per_host=2)


@pytest.mark.parametrize("scenario", [_all_reduce_ops, _all_reduce_fast_path, _ddp_hook, _point_to_point,
                                      _timeouts_entry, _graph_capture_sim], ids=lambda f: f.__name__.strip("_"))
def test_python_backend(scenario):
    run_ranks(scenario, 2, impl="python")


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_reduce_every_op(world_size):
    run_ranks(_all_reduce_ops, world_size)


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_reduce_fast_path(world_size):
    run_ranks(_all_reduce_fast_path, world_size)


@pytest.mark.parametrize("world_size", [2, 4])
def test_gather_scatter_broadcast_reduce(world_size):
    run_ranks(_gather_scatter, world_size)


def test_functional_collectives():
    run_ranks(_functional, 2)


def test_async_ops_and_futures():
    run_ranks(_async_and_futures, 3)


def test_overlapping_groups_divergent_order():
    run_ranks(_divergent_groups, 3)


def test_ddp_gradients_match_reference():
    run_ranks(_ddp_default, 2)


def test_ddp_tagged_hook_gradients_match_reference():
    run_ranks(_ddp_hook, 2)


def test_fsdp2_matches_reference():
    run_ranks(_fsdp2, 2)


@pytest.mark.parametrize("world_size", [2, 3])
def test_point_to_point(world_size):
    run_ranks(_point_to_point, world_size)


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_to_all(world_size):
    run_ranks(_all_to_all, world_size)


def test_graph_capture_through_the_c_api():
    """Captured on a simulated stream, without the Python side (docs/torch.md, "CUDA graphs")."""
    run_ranks(_graph_capture_sim, 2)


def test_timeouts_are_typed_and_recoverable():
    run_ranks(_timeouts_entry, 2)


def test_unsupported_operations_are_refused():
    run_ranks(_unsupported, 2)


_CONTEXT_OPTIONS_FIRST = r"""
import torch.distributed as dist
import dfccl, dfccl.torch
from dfccl import runtime
opts = dfccl.DaemonOptions(empty_quit_ns=123_000, idle_quit_ns=30_000_000)
daemon = runtime.get_daemon("sim", 0, opts)            # before the process group
dist.init_process_group("dfccl", store=dist.HashStore(), rank=0, world_size=1)
comm = dfccl.torch.communicator()
assert comm._daemon is daemon and runtime.get_daemon("sim", 0, opts) is daemon
try:
    runtime.get_daemon("sim", 0, dfccl.DaemonOptions())
except dfccl.InvalidArgumentError as exc:
    assert "already runs with" in str(exc)
else:
    raise AssertionError("other options were taken silently")
dist.destroy_process_group()
print("OK")
"""


def test_daemon_options_set_before_the_process_group_are_its_daemons():
    """docs/torch.md, "Daemon options": runtime.get_daemon(kind, device,
    options) before init_process_group sets the daemon options (the quits,
    the blocks) of the process group's communicators."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _CONTEXT_OPTIONS_FIRST], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, CUDA_VISIBLE_DEVICES="", DFCCL_TORCH_BACKEND="sim"))
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout + out.stderr


def test_without_a_compiler_the_python_backend_serves(tmp_path):
    """No C++ compiler (and nothing cached): a warning naming what is
    missing, and the Python backend; with DFCCL_TORCH_IMPL=compiled, an
    error naming it instead."""
    import subprocess
    import sys

    env = dict(os.environ, CXX="no-such-c++-compiler", DFCCL_CACHE_DIR=str(tmp_path), CUDA_VISIBLE_DEVICES="")
    env.pop("DFCCL_TORCH_IMPL", None)
    out = subprocess.run([sys.executable, "-m", "dfccl.torch"], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert "python backend" in out.stdout and "missing a C++ compiler" in out.stderr, out.stdout + out.stderr
    env["DFCCL_TORCH_IMPL"] = "compiled"
    out = subprocess.run([sys.executable, "-c", "import dfccl.torch"], capture_output=True, text=True, timeout=120,
                         env=env)
    assert out.returncode != 0 and "CompiledBackendUnavailable" in out.stderr and "no-such-c++-compiler" in out.stderr
