"""CUDA streams and graphs through cuda-python's driver bindings, for the GPU
tests and probes of collectives captured in graphs (dfccl's own API under
``cuStreamBeginCapture``): a stream, a capture into an executable graph,
launches, and destruction."""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["Stream", "Graph", "capture", "close_all"]


def _driver():
    from cuda.bindings import driver
    return driver


def _check(result: Any, what: str) -> Any:
    """The values of a cuda-python call after its CUresult, or RuntimeError."""
    driver = _driver()
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what} failed: {err}")
    return rest[0] if len(rest) == 1 else rest


class Stream:
    """A non-blocking CUDA stream of the current context."""

    def __init__(self) -> None:
        driver = _driver()
        self.cu = _check(driver.cuStreamCreate(driver.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        self.handle = int(self.cu)

    def synchronize(self) -> None:
        _check(_driver().cuStreamSynchronize(self.cu), "cuStreamSynchronize")

    def close(self) -> None:
        if self.cu is not None:
            _check(_driver().cuStreamDestroy(self.cu), "cuStreamDestroy")
            self.cu = None


class Graph:
    """An executable graph captured from a stream (capture())."""

    def __init__(self, graph: Any, exe: Any) -> None:
        self.graph, self.exe = graph, exe

    def launch(self, stream: Stream) -> None:
        _check(_driver().cuGraphLaunch(self.exe, stream.cu), "cuGraphLaunch")

    def close(self) -> None:
        """Destroys the executable graph and the graph (CUDA releases what
        they hold once their launches have finished)."""
        driver = _driver()
        if self.exe is not None:
            _check(driver.cuGraphExecDestroy(self.exe), "cuGraphExecDestroy")
            _check(driver.cuGraphDestroy(self.graph), "cuGraphDestroy")
            self.exe = self.graph = None


def capture(stream: Stream, body: Callable[[], Any], *, mode: str = "global") -> tuple[Graph, Any]:
    """Captures what ``body()`` issues on ``stream`` (``mode``: CUDA's capture
    mode, global as torch's default) into an instantiated graph; returns
    (graph, what body returned)."""
    driver = _driver()
    modes = {"global": driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL,
             "thread_local": driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
             "relaxed": driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED}
    _check(driver.cuStreamBeginCapture(stream.cu, modes[mode]), "cuStreamBeginCapture")
    try:
        out = body()
    finally:
        graph = _check(driver.cuStreamEndCapture(stream.cu), "cuStreamEndCapture")
    exe = _check(driver.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
    return Graph(graph, exe), out


def close_all(graphs: list, streams: list, comms: list) -> None:
    """Destroys ``graphs``, then, once their streams have run what was
    queued, the streams, then closes ``comms`` (in that order: what a
    captured collective holds is released after its graph's launches)."""
    for g in graphs:
        g.close()
    for s in streams:
        s.synchronize()
        s.close()
    for c in comms:
        c.close()
