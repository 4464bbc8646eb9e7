"""The plain call's reader of GPU arrays (buffers.plain_array) on CuPy
arrays and torch tensors: it agrees with the general path on what it takes,
declines what the general path must decide, and a plain all_reduce on each
array type gives the right sum."""

from __future__ import annotations

import numpy as np
import pytest

import dfccl
from dfccl import runtime
from dfccl.buffers import as_buffer, plain_array

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120),
              pytest.mark.skipif(runtime.cuda_device_count() == 0, reason="needs a GPU")]


def _array_types():
    out = []
    try:
        import cupy
        out.append(("cupy", lambda n, dt: cupy.zeros(n, dtype=dt), lambda a: a[::2], cupy.asnumpy,
                    cupy.asarray))
    except ImportError:
        pass
    try:
        import torch
        out.append(("torch", lambda n, dt: torch.zeros(n, dtype=getattr(torch, dt), device="cuda:0"),
                    lambda a: a[::2], lambda a: a.cpu().numpy(), lambda h: torch.from_numpy(h).cuda()))
    except ImportError:
        pass
    return out


ARRAY_TYPES = _array_types()


@pytest.mark.parametrize("array_type", ARRAY_TYPES, ids=[k[0] for k in ARRAY_TYPES])
@pytest.mark.parametrize("dtype", ["int8", "int32", "int64", "float16", "float32", "float64"])
def test_agrees_with_the_general_path(array_type, dtype):
    _, make, strided, _, _ = array_type
    a = make(37, dtype)
    b = as_buffer(a)
    assert plain_array(a, True) == (b.ptr, b.count, b.dtype, b.device)
    assert plain_array(strided(a), True) is None
    assert plain_array(make(0, dtype), True) is None


def test_torch_declines_grad_and_host_tensors():
    torch = pytest.importorskip("torch")
    assert plain_array(torch.zeros(4, device="cuda:0", requires_grad=True), True) is None
    assert plain_array(torch.zeros(4), True) is None


@pytest.mark.parametrize("array_type", ARRAY_TYPES, ids=[k[0] for k in ARRAY_TYPES])
def test_plain_all_reduce_on_each_array_type(array_type):
    _, make, _, to_numpy, from_numpy = array_type
    comms = dfccl.Communicator.for_devices([0, 0], backend="cuda")
    try:
        xs = [make(1000, "float32") for _ in comms]
        rng = np.random.default_rng(5)
        host = [rng.standard_normal(1000).astype(np.float32) for _ in comms]
        for x, h in zip(xs, host):
            x[:] = from_numpy(h)
        for _ in range(3):  # the second call onwards takes the kept descriptor
            works = [c.all_reduce(x) for c, x in zip(comms, xs)]
            for w in works:
                w.synchronize(timeout=60)
            want = host[0] + host[1]
            for x in xs:
                np.testing.assert_allclose(to_numpy(x), want, rtol=1e-6)
            host = [want, want]
    finally:
        for c in comms:
            c.close()
