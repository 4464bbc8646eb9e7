"""bfloat16 on GPUs, through torch tensors (numpy, which the other GPU tests
use for their inputs, has no bfloat16): every kind, op and path, small
enough for LL and larger, checked exactly against torch.  With two ranks
every reduction has two sources, which the daemon accumulates in float32
and rounds once, as torch does for ``(a.float() + b.float()).bfloat16()``.
Each collective is waited for with a timeout, so one that never completes
fails here with the rank it waits for instead of hanging."""

from __future__ import annotations

import pytest

import dfccl
from dfccl import runtime

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU visible to torch")]

COUNTS = (1, 37, 1000, (1 << 16) + 3)
OPS = ("sum", "prod", "min", "max", "avg")


def _devices() -> list[int]:
    n = runtime.cuda_device_count()
    return [0, 1 % n]


def _inputs(count: int) -> list:
    g = torch.Generator().manual_seed(count)
    # Small integers and halves: products and sums stay representable.
    return [(torch.randint(-4, 5, (count,), generator=g).float() / 2 + r).to(torch.bfloat16) for r in range(2)]


def _reduce(xs: list, op: str):
    a, b = (x.float() for x in xs)
    out = {"sum": a + b, "prod": a * b, "min": torch.minimum(a, b), "max": torch.maximum(a, b),
           "avg": (a + b) / 2}[op]
    return out.to(torch.bfloat16)


@pytest.fixture(scope="module", params=["direct", "ring"])
def comms(request):
    cs = dfccl.Communicator.for_devices(_devices(), backend="cuda", options=dfccl.CommOptions(path=request.param))
    yield cs
    for c in cs:
        c.close()


def _run(works) -> None:
    for w in works:
        w.synchronize(timeout=30)


@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize("op", OPS)
def test_all_reduce_bfloat16(comms, count, op):
    xs = _inputs(count)
    bufs = [x.to(f"cuda:{c.device}") for x, c in zip(xs, comms)]
    _run([c.all_reduce(b, op=op, tag=("bf16-ar", op, count)) for c, b in zip(comms, bufs)])
    want = _reduce(xs, op)
    for b in bufs:
        assert torch.equal(b.cpu(), want), f"all_reduce {op} count={count}"


@pytest.mark.parametrize("count", COUNTS)
def test_gather_scatter_bfloat16(comms, count):
    xs = _inputs(count)
    sends = [x.to(f"cuda:{c.device}") for x, c in zip(xs, comms)]
    gathered = [torch.full((2 * count,), float("nan"), dtype=torch.bfloat16, device=f"cuda:{c.device}")
                for c in comms]
    _run([c.all_gather(s, g, tag=("bf16-ag", count)) for c, s, g in zip(comms, sends, gathered)])
    for g in gathered:
        assert torch.equal(g.cpu(), torch.cat(xs))
    # reduce_scatter of the gathered buffers: rank r gets the sum of slice r.
    outs = [torch.full((count,), float("nan"), dtype=torch.bfloat16, device=f"cuda:{c.device}") for c in comms]
    _run([c.reduce_scatter(g, o, op="max", tag=("bf16-rs", count)) for c, g, o in zip(comms, gathered, outs)])
    for r, o in enumerate(outs):
        assert torch.equal(o.cpu(), xs[r]), f"reduce_scatter max count={count} rank {r}"
    # broadcast from rank 1 and reduce to rank 0.
    bufs = [x.to(f"cuda:{c.device}") for x, c in zip(xs, comms)]
    _run([c.broadcast(b, root=1, tag=("bf16-bc", count)) for c, b in zip(comms, bufs)])
    for b in bufs:
        assert torch.equal(b.cpu(), xs[1])
    bufs = [x.to(f"cuda:{c.device}") for x, c in zip(xs, comms)]
    _run([c.reduce(b, op="sum", root=0, tag=("bf16-rd", count)) for c, b in zip(comms, bufs)])
    assert torch.equal(bufs[0].cpu(), _reduce(xs, "sum"))
