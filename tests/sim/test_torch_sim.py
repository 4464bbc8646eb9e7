"""The torch.distributed backend (dfccl.torch) on the simulator: 2-4 spawned
processes, CPU tensors, every collective and reduction checked against a
reference computed locally (modelled on PyTorch's test_c10d_pypg.py and
test_c10d_common.py)."""

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

from torch_scenarios import (_all_reduce_fast_path, _all_reduce_ops, _all_to_all, _async_and_futures, _ddp_default,  # noqa: E402
                             _ddp_hook, _divergent_groups, _fsdp2, _functional, _gather_scatter, _point_to_point,
                             _timeouts_entry, _unsupported)

pytestmark = pytest.mark.timeout(60)


# -- harness -------------------------------------------------------------------------
# Importing torch costs seconds per process, so the ranks are a pool of
# processes kept for the whole module; each test initialises a fresh default
# process group in the first world_size of them and destroys it at the end.

POOL_SIZE = 4


def _pool_worker(rank, commands, results):
    os.environ["DFCCL_TORCH_BACKEND"] = "sim"
    import dfccl.torch  # noqa: F401  (registers the backend)

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
    def __init__(self):
        self.ctx = mp.get_context("spawn")
        self.results = self.ctx.Queue()
        self.commands = [self.ctx.Queue() for _ in range(POOL_SIZE)]
        self.procs = [self.ctx.Process(target=_pool_worker, args=(r, self.commands[r], self.results), daemon=True)
                      for r in range(POOL_SIZE)]
        for p in self.procs:
            p.start()

    def close(self, force: bool = False):
        for q, p in zip(self.commands, self.procs):
            if not force and p.is_alive():
                q.put(None)
        for p in self.procs:
            p.join(timeout=0 if force else 10)
            if p.is_alive():
                p.kill()
                p.join()


_pool: _Pool | None = None


@pytest.fixture(scope="module", autouse=True)
def _pool_lifetime():
    global _pool
    if _pool is None:
        _pool = _Pool()
    yield
    if _pool is not None:
        _pool.close()
        _pool = None


def run_ranks(fn, world_size: int = 2, timeout_s: float = 20.0, join_s: float = 40.0) -> None:
    """Runs fn(rank, world_size) on world_size ranks of a fresh dfccl default
    process group; fails with the ranks' tracebacks."""
    global _pool
    if _pool is None:
        _pool = _Pool()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "store")
        for r in range(world_size):
            _pool.commands[r].put((fn, world_size, path, timeout_s))
        errors = {}
        try:
            for _ in range(world_size):
                rank, err = _pool.results.get(timeout=join_s)
                if err is not None:
                    errors[rank] = err
        except Exception:
            errors["harness"] = f"a rank did not report within {join_s} s"
    if errors:
        # A failed rank may leave collectives pending: start the next test afresh.
        _pool.close(force=True)
        _pool = None
    assert not errors, "\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(errors.items(), key=str))


# -- tests -------------------------------------------------------------------------------

def test_registered_backend():
    import dfccl.torch as dt

    assert "DFCCL" in dist.Backend._plugins
    assert dt.BACKEND_NAME == "dfccl"
    assert set(dt.__all__) <= set(dir(dt))


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


def test_timeouts_are_typed_and_recoverable():
    run_ranks(_timeouts_entry, 2)


def test_unsupported_operations_are_refused():
    run_ranks(_unsupported, 2)


_CONTEXT_OPTIONS_FIRST = r"""
import torch.distributed as dist
import dfccl, dfccl.torch
from dfccl import runtime
opts = dfccl.ContextOptions(empty_quit_ns=123_000, idle_quit_ns=30_000_000)
ctx = runtime.get_context("sim", 0, opts)            # before the process group
dist.init_process_group("dfccl", store=dist.HashStore(), rank=0, world_size=1)
comm = dist.group.WORLD.communicator()
assert comm._ctx is ctx and runtime.get_context("sim", 0, opts) is ctx
try:
    runtime.get_context("sim", 0, dfccl.ContextOptions())
except dfccl.InvalidArgumentError as exc:
    assert "already runs with" in str(exc)
else:
    raise AssertionError("other options were taken silently")
dist.destroy_process_group()
print("OK")
"""


def test_context_options_set_before_the_process_group_are_its_daemons():
    """docs/torch.md, "Daemon options": runtime.get_context(kind, device,
    options) before init_process_group sets the daemon options (the quits,
    the blocks) of the process group's communicators."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _CONTEXT_OPTIONS_FIRST], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, CUDA_VISIBLE_DEVICES="", DFCCL_TORCH_BACKEND="sim"))
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout + out.stderr
