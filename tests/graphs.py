"""CUDA-graph capture shared by the GPU tests."""

from __future__ import annotations

from typing import Callable, TypeVar

import torch

from inputs import no_host_sync

T = TypeVar("T")


def capture(fn: Callable[[], T], warmup: int = 1) -> tuple[torch.cuda.CUDAGraph, T]:
    """Capture ``fn()`` after ``warmup`` calls on a side stream, so that lazy initialisation and
    allocator state stay out of the graph; returns the graph and what ``fn`` returned in it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = fn()
    return graph, result


def assert_replays_like_eager(step: Callable[[], tuple], change: Callable[[], None]) -> tuple:
    """A step that must be free of host syncs and capturable: run it once (planning), once more with
    no host sync allowed, capture it, apply ``change()`` (new input values, in place), replay, and
    assert that the captured tensors equal a fresh eager step's bit for bit. Returns the eager ones."""
    step()
    with no_host_sync():
        step()
    graph, captured = capture(step)
    with torch.no_grad():
        change()
    graph.replay()
    eager = step()
    torch.cuda.synchronize()
    for a, b in zip(captured, eager):
        assert torch.equal(a, b)
    return eager
