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


def assert_training_step_replays(shape: tuple[int, int, int, int], seed: int, decay: torch.Tensor,
                                 new_decay: torch.Tensor,
                                 inspect: Callable[..., None] | None = None) -> tuple:
    """:func:`assert_replays_like_eager` for a bf16 chunk training step with a trainable CUDA
    ``decay``: q, k, v of ``shape`` (B, H, N, D) and the output's gradient drawn from ``seed``, the
    gradients of q, k, v and the decay computed; before the replay, new q, k, v and the decay's
    values ``new_decay``. ``inspect(q, k, v, grad)`` runs first (a check of the plan)."""
    import rtkernels

    b, h, n, d = shape
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def draw() -> torch.Tensor:
        return torch.randn(b, h, n, d, generator=gen, device="cuda").div_(d ** 0.5).bfloat16()

    leaves = [draw().requires_grad_() for _ in range(3)]
    grad = draw()
    if inspect is not None:
        inspect(*leaves, grad)

    def step() -> tuple:
        out = rtkernels.causal_linear_attention(*leaves, decay, method="chunk")
        return torch.autograd.grad((out.float() * grad.float()).sum(), (*leaves, decay))

    def change() -> None:
        for x in leaves:
            x.copy_(draw())
        decay.copy_(new_decay)

    return assert_replays_like_eager(step, change)
