"""CUDA-graph capture shared by the GPU tests."""

from __future__ import annotations

from typing import Callable, TypeVar

import torch

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
