"""The start-up warning for ranks of different processes sharing one GPU
(hardware queues shared; lazy module loading; docs/torch.md, "Known
problems")."""

from __future__ import annotations

from dfccl.sharing import shared_gpu_warning


def _peer(pid, bus, backend="cuda", host="h"):
    return {"pid": pid, "host": host, "bus_id": bus, "backend": backend}


def test_two_processes_on_one_gpu_with_lazy_loading():
    peers = [_peer(1, "0000:19:00.0"), _peer(2, "0000:19:00.0")]
    why = shared_gpu_warning(peers, 0, environ={})
    assert why is not None and "hardware queues" in why and "CUDA_MODULE_LOADING=EAGER" in why and "ranks [1]" in why
    assert "CUDA_MODULE_LOADING=EAGER" in shared_gpu_warning(peers, 1, environ={"CUDA_MODULE_LOADING": "LAZY"})


def test_two_processes_on_one_gpu_with_eager_loading():
    shared = [_peer(1, "0000:19:00.0"), _peer(2, "0000:19:00.0")]
    why = shared_gpu_warning(shared, 0, environ={"CUDA_MODULE_LOADING": "eager"})
    assert why is not None and "hardware queues" in why and "CUDA_MODULE_LOADING" not in why


def test_one_gpu_each_same_process_or_simulator():
    one_each = [_peer(1, "0000:19:00.0"), _peer(2, "0000:3b:00.0")]
    assert shared_gpu_warning(one_each, 0, environ={}) is None
    one_process = [_peer(1, "0000:19:00.0"), _peer(1, "0000:19:00.0")]
    assert shared_gpu_warning(one_process, 0, environ={}) is None
    sim = [_peer(1, None, "sim"), _peer(2, None, "sim")]
    assert shared_gpu_warning(sim, 0, environ={}) is None
