"""The start-up warning for ranks of different processes sharing one GPU
while CUDA loads modules lazily (docs/torch.md, "Known problems")."""

from __future__ import annotations

from dfccl.communicator import shared_gpu_lazy_loading


def _peer(pid, bus, backend="cuda", host="h"):
    return {"pid": pid, "host": host, "bus_id": bus, "backend": backend}


def test_two_processes_on_one_gpu_with_lazy_loading():
    peers = [_peer(1, "0000:19:00.0"), _peer(2, "0000:19:00.0")]
    why = shared_gpu_lazy_loading(peers, 0, environ={})
    assert why is not None and "CUDA_MODULE_LOADING=EAGER" in why and "ranks [1]" in why
    assert shared_gpu_lazy_loading(peers, 1, environ={"CUDA_MODULE_LOADING": "LAZY"}) is not None


def test_eager_loading_one_gpu_each_same_process_or_simulator():
    shared = [_peer(1, "0000:19:00.0"), _peer(2, "0000:19:00.0")]
    assert shared_gpu_lazy_loading(shared, 0, environ={"CUDA_MODULE_LOADING": "eager"}) is None
    one_each = [_peer(1, "0000:19:00.0"), _peer(2, "0000:3b:00.0")]
    assert shared_gpu_lazy_loading(one_each, 0, environ={}) is None
    one_process = [_peer(1, "0000:19:00.0"), _peer(1, "0000:19:00.0")]
    assert shared_gpu_lazy_loading(one_process, 0, environ={}) is None
    sim = [_peer(1, None, "sim"), _peer(2, None, "sim")]
    assert shared_gpu_lazy_loading(sim, 0, environ={}) is None
