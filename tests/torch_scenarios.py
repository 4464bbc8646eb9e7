"""The torch.distributed scenarios every rank runs, shared by the simulator
tests (test_torch_sim.py: CPU tensors, dfccl's simulator) and the GPU tests
(test_torch_gpu.py: CUDA tensors as torch's default device).  Each is a
function of (rank, world_size) run inside an initialised default process
group; references are computed locally."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

__all__ = ["_all_reduce_fast_path", "_all_reduce_ops", "_all_to_all", "_async_and_futures", "_ddp_default", "_ddp_hook", "_divergent_groups",
           "_fsdp2", "_functional", "_gather_scatter", "_graph_capture_sim", "_hierarchical_all_reduce",
           "_point_to_point", "_timeouts_entry", "_unsupported"]


def _inputs(rank: int, n: int, dtype):
    # Distinct per rank and per element; small enough for PRODUCT to stay exact.
    base = torch.arange(n, dtype=torch.float64) % 3 + 1 + rank
    return base.to(dtype)


def _reference(world_size: int, n: int, dtype, op: str):
    xs = torch.stack([_inputs(r, n, dtype).to(torch.float64) for r in range(world_size)])
    ref = {"sum": xs.sum(0), "prod": xs.prod(0), "min": xs.min(0).values, "max": xs.max(0).values,
           "avg": xs.mean(0)}[op]
    return ref


# -- scenarios (run in every rank) -----------------------------------------------------

def _general_path_counter(pg):
    """(count, restore): count() is how many calls took the general path
    so far: those the compiled backend handed to its Python side, or,
    in the Python backend, those that skipped its plain-call path."""
    import dfccl.torch as dt

    backend = dt.backend_of(pg, torch.get_default_device())
    if not isinstance(backend, dt.ProcessGroupDfccl):
        start = backend.counts()[1]
        return (lambda: backend.counts()[1] - start), (lambda: None)
    general = []
    orig = backend._all_reduce

    def spy(tensors, *a, **k):
        general.append(tensors[0].shape)
        return orig(tensors, *a, **k)

    backend._all_reduce = spy

    def restore():
        del backend._all_reduce
    return (lambda: len(general)), restore


def _all_reduce_fast_path(rank, ws):
    """pg.allreduce of one contiguous tensor (DDP's bucket call) takes the
    plain path (the compiled backend's plans; the Python backend's
    plain-call path once the group has run on the device and seen the
    dtype): fresh tensors of several sizes, dtypes and ops, waited for
    through wait() and through futures, all right; a non-contiguous tensor
    and PREMUL_SUM still take the general path."""
    import dfccl.torch as dt

    pg = dist.group.WORLD
    dtypes = (torch.float32, torch.bfloat16, torch.int64)
    for dtype in dtypes:
        dist.all_reduce(torch.ones(3, dtype=dtype))
    general, restore = _general_path_counter(pg)
    try:
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
               "avg": dist.ReduceOp.AVG}
        for it in range(24):
            dtype = dtypes[it % 3]
            n = (1, 37, 4096, 37)[it % 4]
            name = list(ops)[it % 4]
            if name == "avg" and not dtype.is_floating_point:
                name = "sum"
            # Every rank's input, drawn from seeds all ranks know: the reference.
            xs = [torch.randint(-50, 50, (n,), generator=torch.Generator().manual_seed(1000 * it + r), device="cpu")
                  .to(torch.float64)
                  for r in range(ws)]
            ref = _reduce_all(xs, name)
            t = xs[rank].to(dtype).to(torch.get_default_device())
            opts = dist.AllreduceOptions()
            opts.reduceOp = ops[name]
            work = pg.allreduce([t], opts)
            if it % 2:
                work.get_future().wait()
            else:
                work.wait()
            torch.testing.assert_close(t.cpu().to(torch.float64), ref.to(dtype).to(torch.float64),
                                       msg=f"call {it}: {name} {dtype} n={n}")
        assert general() == 0, f"{general()} plain calls took the general path"
        t = (torch.arange(12, dtype=torch.float32).reshape(3, 4) + rank).t()
        dist.all_reduce(t)
        torch.testing.assert_close(t, sum((torch.arange(12, dtype=torch.float32).reshape(3, 4) + r).t()
                                         for r in range(ws)))
        assert general() == 1
        if dt.premul_sum_supported():
            t = torch.full((8,), float(rank + 1))
            dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5))
            torch.testing.assert_close(t, torch.full((8,), 0.5 * sum(range(1, ws + 1))))
            assert general() == 2
    finally:
        restore()


def _hierarchical_all_reduce(rank, ws):
    """Ranks on two "hosts", two on each (the harness sets DFCCL_HOST_ID):
    an all-reduce of hierarchy_min_bytes or more runs as three parts
    (dfccl.hierarchy), through pg.allreduce (DDP's call) and through a
    tagged all-reduce, in place, exact; with the compiled backend each such
    call is handed to the Python side, and the smaller ones still are not."""
    import dfccl.torch as dt
    from dfccl.options import DEFAULT_HIERARCHY_MIN_BYTES

    pg = dist.group.WORLD
    comm = dt.backend_of(pg, torch.get_default_device())
    group = comm if isinstance(comm, dt.ProcessGroupDfccl) else comm.group
    info = group.communicator(torch.get_default_device()).hierarchy
    assert info is not None and (info.hosts, info.per_host) == (2, 2), info
    before = info.all_reduces
    n = DEFAULT_HIERARCHY_MIN_BYTES // 4
    general, restore = _general_path_counter(pg)
    try:
        for it in range(2):
            t = _inputs(rank, n, torch.float32) * (it + 1)
            work = pg.allreduce([t], dist.AllreduceOptions())
            work.wait()
            torch.testing.assert_close(t.to(torch.float64), _reference(ws, n, torch.float32, "sum") * (it + 1),
                                       msg=f"call {it}")
        small = _inputs(rank, 4096, torch.float32)
        dist.all_reduce(small)
        torch.testing.assert_close(small.to(torch.float64), _reference(ws, 4096, torch.float32, "sum"))
        # One tag, both ways, not waited for in between: in order.
        t = _inputs(rank, n, torch.float32)
        works = [dt.tagged_allreduce(t, "grads", group=pg), dt.tagged_allreduce(t[:4096], "grads", group=pg),
                 dt.tagged_allreduce(t, "grads", group=pg)]
        for w in works:
            w.wait()
        want = _reference(ws, n, torch.float32, "sum") * ws
        want[:4096] *= ws
        torch.testing.assert_close(t.to(torch.float64), want)
        # A reduce-scatter and an all-gather whose ws blocks hold the
        # threshold run hierarchically too (each host's ranks contiguous).
        blk = n // ws
        x = _inputs(rank, ws * blk, torch.float32)
        out = torch.full((blk,), -1.0)
        dist.reduce_scatter_tensor(out, x)
        torch.testing.assert_close(out.to(torch.float64),
                                   _reference(ws, ws * blk, torch.float32, "sum")[rank * blk:(rank + 1) * blk])
        gathered = torch.full((ws * blk,), -1.0)
        dist.all_gather_into_tensor(gathered, _inputs(rank, blk, torch.float32))
        torch.testing.assert_close(gathered, torch.cat([_inputs(q, blk, torch.float32) for q in range(ws)]))
        info = group.communicator(torch.get_default_device()).hierarchy
        assert info.all_reduces == before + 4 and (info.reduce_scatters, info.all_gathers) == (1, 1), info
        if not isinstance(comm, dt.ProcessGroupDfccl):
            # The large shape's pg.allreduce calls, every tagged one, the
            # reduce-scatter and the all-gather.
            assert general() == 7, general()
    finally:
        restore()
    # A group's communicators take the CommOptions given as pg_options.
    import dfccl

    g = dist.new_group(backend="dfccl", pg_options=dfccl.CommOptions(hierarchy_min_bytes=1 << 20))
    device = torch.get_default_device()
    assert dt.communicator(g, device).hierarchy.min_bytes == 1 << 20
    t = _inputs(rank, (1 << 20) // 4, torch.float32)
    dist.all_reduce(t, group=g)
    torch.testing.assert_close(t.to(torch.float64), _reference(ws, (1 << 20) // 4, torch.float32, "sum"))
    assert dt.communicator(g, device).hierarchy.all_reduces == 1
    dist.destroy_process_group(g)
    with pytest.raises(dfccl.InvalidArgumentError, match="pg_options must be a dfccl.CommOptions"):
        dt.ProcessGroupDfccl(dist.HashStore(), rank, ws, options={"hierarchy_min_bytes": 1 << 20})


def _reduce_all(xs, name):
    x = torch.stack(xs)
    return {"sum": x.sum(0), "max": x.max(0).values, "min": x.min(0).values, "avg": x.mean(0)}[name]


def _all_reduce_ops(rank, ws):
    import dfccl.torch as dt

    pg = dist.group.WORLD
    assert dist.get_backend() == "dfccl"
    assert pg.group_name  # torch set it through setGroupName
    # The GPU tests run these scenarios with CUDA as torch's default device.
    assert dt.communicator().backend == ("cuda" if torch.get_default_device().type == "cuda" else "sim")
    ops = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN,
           "max": dist.ReduceOp.MAX, "avg": dist.ReduceOp.AVG}
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32, torch.int64):
        for name, op in ops.items():
            if name == "avg" and not dtype.is_floating_point:
                continue
            t = _inputs(rank, 37, dtype)
            dist.all_reduce(t, op=op)
            ref = _reference(ws, 37, dtype, name).to(dtype)
            torch.testing.assert_close(t, ref, msg=f"{name} {dtype}")
    # PREMUL_SUM: each input multiplied by the factor, then summed (or a
    # clear refusal where torch hides the factor from Python backends).
    t = _inputs(rank, 16, torch.float32)
    if dt.premul_sum_supported():
        dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5))
        torch.testing.assert_close(t, (_reference(ws, 16, torch.float32, "sum") * 0.5).float())
    else:
        with pytest.raises(dt.NotSupportedError, match="ReduceOp.factor"):
            dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5))
    # Bitwise reductions are refused with a dfccl error on every rank.
    for op in (dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR):
        with pytest.raises(dt.NotSupportedError, match="BAND/BOR/BXOR"):
            dist.all_reduce(torch.ones(4, dtype=torch.int32), op=op)
    # Non-contiguous tensors go through a contiguous temporary and come back.
    t = (torch.arange(12, dtype=torch.float32).reshape(3, 4) + rank).t()
    assert not t.is_contiguous()
    expect = sum((torch.arange(12, dtype=torch.float32).reshape(3, 4) + r).t() for r in range(ws))
    dist.all_reduce(t)
    torch.testing.assert_close(t, expect)
    # Zero-dim and empty tensors.
    s = torch.tensor(float(rank + 1))
    dist.all_reduce(s, op=dist.ReduceOp.MAX)
    assert s.item() == ws
    e = torch.empty(0)
    dist.all_reduce(e)
    # Coalesced all-reduce (one torch call, several tensors).
    a, b = torch.full((5,), float(rank)), torch.full((3,), 2.0 * rank, dtype=torch.float64)
    pg.allreduce_coalesced([a, b], dist.AllreduceCoalescedOptions()).wait()
    total = sum(range(ws))
    assert torch.equal(a, torch.full((5,), float(total))) and torch.equal(b, torch.full((3,), 2.0 * total,
                                                                                       dtype=torch.float64))
    # An unsupported dtype is a clear dfccl error, not a crash.
    with pytest.raises(dt.InvalidArgumentError, match="torch.bool"):
        dist.all_reduce(torch.ones(3, dtype=torch.bool))


def _gather_scatter(rank, ws):
    n = 6
    # all_gather (list), all_gather_into_tensor, non-contiguous output.
    inp = torch.arange(n, dtype=torch.float32) + 100 * rank
    outs = [torch.empty(n) for _ in range(ws)]
    dist.all_gather(outs, inp)
    for r in range(ws):
        assert torch.equal(outs[r], torch.arange(n, dtype=torch.float32) + 100 * r)
    flat = torch.empty(ws * n)
    dist.all_gather_into_tensor(flat, inp)
    assert torch.equal(flat, torch.cat(outs))
    out2d = torch.empty(n, ws).t()  # (ws, n), non-contiguous
    dist.all_gather_into_tensor(out2d, inp)
    assert torch.equal(out2d, torch.stack(outs))
    # reduce_scatter (list) and reduce_scatter_tensor, with SUM, AVG, MAX and PREMUL_SUM.
    full = [torch.arange(ws * n, dtype=torch.float64) + 10 * r for r in range(ws)]
    mine = slice(rank * n, (rank + 1) * n)
    o = torch.empty(n, dtype=torch.float64)
    dist.reduce_scatter_tensor(o, full[rank].clone())
    assert torch.equal(o, sum(full)[mine])
    dist.reduce_scatter_tensor(o, full[rank].clone(), op=dist.ReduceOp.AVG)
    torch.testing.assert_close(o, (sum(full) / ws)[mine])
    src = full[rank].clone()
    import dfccl.torch as dt
    if dt.premul_sum_supported():
        dist.reduce_scatter_tensor(o, src, op=dist._make_nccl_premul_sum(0.25))
        torch.testing.assert_close(o, (sum(full) * 0.25)[mine])
    else:
        with pytest.raises(dt.NotSupportedError, match="ReduceOp.factor"):
            dist.reduce_scatter_tensor(o, src, op=dist._make_nccl_premul_sum(0.25))
    assert torch.equal(src, full[rank])  # the premultiplied copy is a temporary
    dist.reduce_scatter(o, list(full[rank].clone().chunk(ws)), op=dist.ReduceOp.MAX)
    assert torch.equal(o, full[ws - 1][mine])
    # broadcast from every root; reduce to every root.
    for root in range(ws):
        t = torch.full((4,), float(rank), dtype=torch.int64)
        dist.broadcast(t, src=root)
        assert torch.equal(t, torch.full((4,), root, dtype=torch.int64))
        t = torch.full((4,), float(rank + 1))
        dist.reduce(t, dst=root, op=dist.ReduceOp.SUM)
        if rank == root:
            assert torch.equal(t, torch.full((4,), float(sum(range(1, ws + 1)))))
    # all_gather_coalesced: lists[r][i] receives input i of rank r.
    lists = [[torch.empty(2), torch.empty(3)] for _ in range(ws)]
    dist.all_gather_coalesced(lists, [torch.full((2,), float(rank)), torch.full((3,), -float(rank))])
    for r in range(ws):
        assert torch.equal(lists[r][0], torch.full((2,), float(r)))
        assert torch.equal(lists[r][1], torch.full((3,), -float(r)))
    # Coalesced forms through the coalescing manager.
    a_out, b_out = torch.empty(ws * 2), torch.empty(ws * 3)
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.all_gather_into_tensor(a_out, torch.full((2,), float(rank)))
        dist.all_gather_into_tensor(b_out, torch.full((3,), float(-rank)))
    cm.wait()
    assert torch.equal(a_out, torch.arange(ws, dtype=torch.float32).repeat_interleave(2))
    assert torch.equal(b_out, -torch.arange(ws, dtype=torch.float32).repeat_interleave(3))
    a_in, b_in = torch.ones(ws * 2) * (rank + 1), torch.ones(ws) * (rank + 1)
    a_o, b_o = torch.empty(2), torch.empty(1)
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.reduce_scatter_tensor(a_o, a_in)
        dist.reduce_scatter_tensor(b_o, b_in)
    cm.wait()
    s = float(sum(range(1, ws + 1)))
    assert torch.equal(a_o, torch.full((2,), s)) and torch.equal(b_o, torch.full((1,), s))
    dist.barrier()


def _functional(rank, ws):
    import torch.distributed._functional_collectives as funcol

    group = dist.group.WORLD
    t = torch.full((4,), float(rank + 1))
    r = funcol.all_reduce(t, "sum", group)
    assert torch.equal(funcol.wait_tensor(r), torch.full((4,), float(sum(range(1, ws + 1)))))
    g = funcol.all_gather_tensor(torch.full((2,), float(rank)), 0, group)
    assert torch.equal(funcol.wait_tensor(g), torch.arange(ws, dtype=torch.float32).repeat_interleave(2))
    rs = funcol.reduce_scatter_tensor(torch.ones(ws * 2) * (rank + 1), "sum", 0, group)
    assert torch.equal(funcol.wait_tensor(rs), torch.full((2,), float(sum(range(1, ws + 1)))))


def _async_and_futures(rank, ws):
    works, tensors = [], []
    for i in range(8):
        t = torch.full((1000,), float(rank + i))
        works.append(dist.all_reduce(t, async_op=True))
        tensors.append(t)
    for i in reversed(range(8)):  # waited in the opposite order
        assert works[i].wait()
        if tensors[i].is_cuda:  # wait() made the stream wait; the host catches up here
            torch.cuda.current_stream().synchronize()
        assert works[i].is_completed() and works[i].is_success()
        assert torch.equal(tensors[i], torch.full((1000,), float(sum(r + i for r in range(ws)))))
    t = torch.full((3,), float(rank))
    w = dist.all_reduce(t, async_op=True)
    fut = w.get_future().then(lambda f: f.value()[0] * 2)
    assert torch.equal(fut.wait(), torch.full((3,), 2.0 * sum(range(ws))))
    outs = [torch.empty(2) for _ in range(ws)]
    w = dist.all_gather(outs, torch.full((2,), float(rank)), async_op=True)
    value = w.get_future().wait()
    assert torch.equal(value[0][ws - 1], torch.full((2,), float(ws - 1)))
    w = dist.barrier(async_op=True)
    w.wait()


def _divergent_groups(rank, ws):
    """Three overlapping groups; every rank submits its two groups' collectives
    in a different order (a cycle: NCCL would hang), then waits for both."""
    assert ws == 3
    # new_group is collective over the world: every rank creates every group
    # (non-members get a placeholder).
    groups = {name: dist.new_group(ranks) for name, ranks in (("A", [0, 1]), ("B", [1, 2]), ("C", [2, 0]))}
    groups = {n: g for n, g in groups.items() if isinstance(g, dist.ProcessGroup)}
    assert len({g.group_name for g in groups.values()}) == 2
    order = {0: ["A", "C"], 1: ["B", "A"], 2: ["C", "B"]}[rank]
    for step in range(5):
        tensors, works = {}, []
        for name in order:
            t = torch.full((257,), float(rank + 1 + step))
            tensors[name] = t
            works.append(dist.all_reduce(t, group=groups[name], async_op=True))
        for w in reversed(works):
            w.wait()
        for name in order:
            members = {"A": [0, 1], "B": [1, 2], "C": [2, 0]}[name]
            assert torch.equal(tensors[name], torch.full((257,), float(sum(m + 1 + step for m in members))))
    # Tagged all-reduces in one group, issued in opposite orders.
    pg = groups["A"] if rank in (0, 1) else None
    if pg is not None:
        x, y = torch.full((4,), 1.0 + rank), torch.full((4,), 10.0 + rank)
        order = [("x", x), ("y", y)] if rank == 0 else [("y", y), ("x", x)]
        import dfccl.torch as dt

        ws_ = [dt.tagged_allreduce(t, name, group=pg) for name, t in order]
        for w in ws_:
            w.wait()
        assert torch.equal(x, torch.full((4,), 3.0)) and torch.equal(y, torch.full((4,), 21.0))


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 16)
        self.c = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def _batch(rank):
    g = torch.Generator().manual_seed(100 + rank)
    x, y = torch.randn(6, 8, generator=g, device="cpu"), torch.randn(6, 4, generator=g, device="cpu")
    return x.to(torch.get_default_device()), y.to(torch.get_default_device())


def _ddp(rank, ws, hook: bool):
    import dfccl.torch as dt
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    ref = _Net()
    torch.manual_seed(rank)  # different initial weights: DDP must broadcast rank 0's
    net = _Net()
    model = DDP(net, bucket_cap_mb=0.0005)  # tiny buckets: several per step
    state = dt.TaggedAllreduceState()
    if hook:
        model.register_comm_hook(state, dt.tagged_allreduce_hook)
    for p, q in zip(model.module.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        x, y = _batch(rank)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        # Single-process reference: the mean of the ranks' gradients.
        ref_opt.zero_grad()
        for r in range(ws):
            xr, yr = _batch(r)
            (torch.nn.functional.mse_loss(ref(xr), yr) / ws).backward()
        for p, q in zip(model.module.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
        opt.step()
        ref_opt.step()
    # The hook counted the steps (the last bucket of each step ends it).
    assert state.step == (3 if hook else 0)


def _ddp_default(rank, ws):
    _ddp(rank, ws, hook=False)


def _ddp_hook(rank, ws):
    _ddp(rank, ws, hook=True)


def _fsdp2(rank, ws):
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard

    torch.manual_seed(0)
    ref = _Net()
    torch.manual_seed(0)
    model = _Net()
    for layer in (model.a, model.b, model.c):
        fully_shard(layer)
    fully_shard(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        x, y = _batch(rank)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        ref_opt.zero_grad()
        for r in range(ws):
            xr, yr = _batch(r)
            (torch.nn.functional.mse_loss(ref(xr), yr) / ws).backward()
        ref_opt.step()
    # Parameters are sharded DTensors: gather them (all-gather) and compare.
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.full_tensor(), q, rtol=1e-5, atol=1e-6)


def _timeouts(rank, ws):
    import dfccl
    import dfccl.torch as dt

    store = dist.distributed_c10d._get_default_store()
    t = torch.ones(8)
    t2 = torch.ones(2)
    if rank == 0:
        # Rank 1 joins only after "go": both waits run out first.
        w = dist.all_reduce(t, async_op=True)
        with pytest.raises(dt.TorchCollectiveTimeoutError, match="did not complete within 0.3 s") as info:
            w.wait(timeout=timedelta(seconds=0.3))
        assert isinstance(info.value, dist.DistBackendError)
        assert isinstance(info.value, dfccl.CollectiveTimeoutError)
        if dt.implementation() == "python":
            # The Python backend's Work names whom it waits for.
            assert "waiting for rank 1" in str(info.value) and info.value.waiting_on == 1
        assert not w.is_completed()
        # The group's timeout (1 s here) applies to a blocking call.
        with pytest.raises(dt.TorchCollectiveTimeoutError):
            dist.all_reduce(t2, group=_timeouts.group)
        store.set("go", "1")
        w.wait()  # the collective stayed pending and completes now
        assert torch.equal(t, torch.full((8,), 2.0))
    else:
        store.wait(["go"])
        dist.all_reduce(t)
        assert torch.equal(t, torch.full((8,), 2.0))
        dist.all_reduce(t2, group=_timeouts.group)
        assert torch.equal(t2, torch.full((2,), 2.0))
    dist.barrier(group=_timeouts.group)


def _timeouts_entry(rank, ws):
    _timeouts.group = dist.new_group([0, 1], timeout=timedelta(seconds=1))
    _timeouts(rank, ws)


def _unsupported(rank, ws):
    import dfccl.torch as dt

    with pytest.raises(dt.NotSupportedError, match="any source"):
        dist.recv(torch.ones(2))
    with pytest.raises(dt.NotSupportedError, match="gather"):
        dist.gather(torch.ones(2), [torch.ones(2), torch.ones(2)] if rank == 0 else None, dst=0)
    with pytest.raises(dt.InvalidArgumentError, match="one tensor per rank"):
        dist.group.WORLD.allreduce([torch.ones(1), torch.ones(1)], dist.AllreduceOptions())
    # The group still works after refusals (nothing was submitted).
    t = torch.ones(2)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((2,), 2.0))


def _point_to_point(rank, ws):
    peer_next, peer_prev = (rank + 1) % ws, (rank - 1) % ws
    # The group has a backend for the device types it serves (newer torch's
    # batch_isend_irecv asks for it), the same for both, and for no other.
    import dfccl.torch as dt

    pg = dist.distributed_c10d._get_default_group()
    assert dt.backend_of(pg, "cpu") is dt.backend_of(pg, "cuda:0")
    assert not pg._get_backend(torch.device("cpu")).supports_coalescing
    try:
        pg._get_backend(torch.device("meta"))
    except RuntimeError:
        pass
    else:
        raise AssertionError("a backend for device type meta")
    # Blocking send / recv, the lower rank sending first.
    x = torch.arange(10, dtype=torch.float32) + 100 * rank
    y = torch.empty(10)
    if rank % 2 == 0:
        dist.send(x, dst=peer_next)
        dist.recv(y, src=peer_prev)
    else:
        dist.recv(y, src=peer_prev)
        dist.send(x, dst=peer_next)
    assert torch.equal(y, torch.arange(10, dtype=torch.float32) + 100 * peer_prev)
    # Every rank posts its recv before its send (hangs without matching).
    y = torch.empty(7, dtype=torch.int64)
    reqs = [dist.irecv(y, src=peer_prev), dist.isend(torch.full((7,), rank, dtype=torch.int64), dst=peer_next)]
    for r in reqs:
        r.wait()
    assert torch.equal(y, torch.full((7,), peer_prev, dtype=torch.int64))
    # Tags: sent in one order, received in the other.
    a, b = torch.empty(3), torch.empty(5)
    sends = [dist.isend(torch.full((3,), 1.0 + rank), dst=peer_next, tag=1),
             dist.isend(torch.full((5,), 2.0 + rank), dst=peer_next, tag=2)]
    dist.recv(b, src=peer_prev, tag=2)
    dist.recv(a, src=peer_prev, tag=1)
    for s in sends:
        s.wait()
    assert torch.equal(a, torch.full((3,), 1.0 + peer_prev)) and torch.equal(b, torch.full((5,), 2.0 + peer_prev))
    # batch_isend_irecv, several messages per pair, non-contiguous recv.
    outs = [torch.empty(4, 2).t() for _ in range(3)]
    ops = [dist.P2POp(dist.irecv, o, peer_prev) for o in outs]
    ops += [dist.P2POp(dist.isend, torch.arange(8.0).view(2, 4) * (k + 1) + rank, peer_next) for k in range(3)]
    for r in dist.batch_isend_irecv(ops):
        r.wait()
    for k, o in enumerate(outs):
        assert torch.equal(o, torch.arange(8.0).view(2, 4) * (k + 1) + peer_prev)


def _all_to_all(rank, ws):
    # Equal splits.
    inp = torch.arange(4 * ws, dtype=torch.float32) + 1000 * rank
    out = torch.empty(4 * ws)
    dist.all_to_all_single(out, inp)
    want = torch.cat([torch.arange(4 * rank, 4 * rank + 4, dtype=torch.float32) + 1000 * p for p in range(ws)])
    assert torch.equal(out, want)
    # Uneven splits in rows of 3 (rank r sends r + p rows to rank p, none to itself when r == p == 0).
    rows = lambda r, p: (r + p) % 3  # noqa: E731
    send_rows = [rows(rank, p) for p in range(ws)]
    recv_rows = [rows(p, rank) for p in range(ws)]
    inp = torch.cat([torch.full((rows(rank, p), 3), float(10 * rank + p)) for p in range(ws)])
    out = torch.empty(sum(recv_rows), 3)
    dist.all_to_all_single(out, inp, output_split_sizes=recv_rows, input_split_sizes=send_rows)
    want = torch.cat([torch.full((rows(p, rank), 3), float(10 * p + rank)) for p in range(ws)])
    assert torch.equal(out, want)
    # Lists, sizes per peer, bfloat16.
    inputs = [torch.full((p + 1,), float(rank * 10 + p), dtype=torch.bfloat16) for p in range(ws)]
    outputs = [torch.empty(rank + 1, dtype=torch.bfloat16) for _ in range(ws)]
    dist.all_to_all(outputs, inputs)
    for p, o in enumerate(outputs):
        assert torch.equal(o, torch.full((rank + 1,), float(p * 10 + rank), dtype=torch.bfloat16))
    # Asynchronous, with a wrong split on one rank: both sides of the pair fail.
    import dfccl

    if ws == 2:
        bad = [2, 2] if rank == 0 else [3, 2]
        inp = torch.zeros(sum(bad))
        out = torch.empty(4)
        work = dist.all_to_all_single(out, inp, output_split_sizes=[2, 2], input_split_sizes=bad, async_op=True)
        # A timeout makes wait() block the host (on CUDA a plain wait() only
        # orders the current stream, and the error shows once it is known).
        with pytest.raises(dfccl.MismatchError):
            work.wait(timeout=timedelta(seconds=30))
        # Older torch binds Work.exception() with no conversion of a C++
        # Work's exception_ptr (a TypeError for every compiled backend, NCCL's too).
        if "exception_ptr" not in (dist.Work.exception.__doc__ or ""):
            assert isinstance(work.exception(), dfccl.MismatchError)
        with pytest.raises(dfccl.MismatchError):
            work.wait()
        # Neither rank closes before both have seen the failure: a rank that
        # closes first withdraws its record, and its peer, which has not read
        # it yet, then reports PeerAbortedError instead (a race the test lost
        # now and then).
        done = torch.ones(1)
        dist.all_reduce(done)
        assert done.item() == ws


def _graph_capture_sim(rank, ws):
    """Collectives captured on a simulated stream (dfccl.torch.cpu_stream,
    SimStream.begin_capture: the simulator's torch.cuda.graph) run at each
    replay and not at capture: two all-reduces issued in opposite orders on
    the two ranks and waited for at the end of the capture, a broadcast, an
    all-gather into a tensor and a barrier, replayed with fresh inputs and
    an eager all-reduce of the first one's shape in between.  Host waits on a
    captured work are refused; destroying the graph gives back what the
    capture held.  The compiled backend captures every one of them through
    the C API: none reaches its Python side."""
    import time

    import dfccl.torch as dt
    from dfccl import runtime

    comm = dt.communicator()
    daemon = comm._daemon
    backend = dt.backend_of(None, "cpu")
    compiled = not isinstance(backend, dt.ProcessGroupDfccl)
    stream = runtime.get_device("sim", comm.device).create_stream()
    a, b = torch.zeros(1000), torch.zeros(3000)
    c = torch.zeros(64, dtype=torch.float64)
    part, gathered = torch.zeros(8), torch.zeros(8 * ws)
    eager = torch.ones(1000)
    dist.all_reduce(eager)                        # outside capture: binds the shape's plan
    handed = backend.counts()[1] if compiled else 0
    with dt.cpu_stream(stream):
        stream.begin_capture()
        try:
            first, second = (a, b) if rank == 0 else (b, a)
            works = [dist.all_reduce(first, async_op=True), dist.all_reduce(second, async_op=True)]
            for w in works:
                w.wait()                          # captured: the stream waits at each replay
            dist.broadcast(c, src=1)
            dist.all_gather_into_tensor(gathered, part)
            dist.barrier()
            with pytest.raises(dt.NotSupportedError, match="no completion on the host"):
                works[0].wait(timeout=timedelta(seconds=1))
            with pytest.raises(dt.NotSupportedError, match="no completion on the host"):
                works[0].is_completed()
        finally:
            graph = stream.end_capture()
    if compiled:
        assert backend.counts()[1] == handed, f"{backend.counts()[1] - handed} captured calls went to the Python side"
    assert len(daemon.captured) == 5, daemon.captured
    assert bool((a == 0).all()) and bool((gathered == 0).all()), "a captured collective ran at capture"
    ramp = torch.arange(3000, dtype=torch.float32)
    try:
        for k in range(1, 21):
            a.fill_(float(rank + k))
            b.copy_(ramp * (rank + 1) + k)
            c.fill_(float(100 * rank + k))
            part.fill_(float(10 * rank + k))
            graph.launch(stream)
            eager.fill_(1.0)
            dist.all_reduce(eager)                # an eager collective of a's shape between replays
            assert stream.synchronize(timeout=30.0), f"replay {k} did not complete"
            assert bool((a == 2 * k + 1).all()), k
            assert bool((b == ramp * 3 + 2 * k).all()), k
            assert bool((c == 100 + k).all()), k
            assert bool((gathered == torch.cat([torch.full((8,), float(10 * r + k)) for r in range(ws)])).all()), k
            assert bool((eager == ws).all()), k
    finally:
        graph.close()
        stream.synchronize(timeout=30.0)
        stream.close()
    deadline = time.monotonic() + 10.0
    while daemon.captured and time.monotonic() < deadline:
        time.sleep(0.01)
    assert daemon.captured == []
