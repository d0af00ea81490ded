"""The torch.library ops on the GPU (marker ``gpu``): torch.compile(fullgraph=True) of the two-layer
model of tests/test_compile_op_cpu.py on CUDA equals eager and the fp64 reference (forward and
backward), with inductor and with mode="reduce-overhead" (CUDA graph trees), and a manual
torch.cuda.graph capture of the op's forward and backward replays equal to the eager call."""

from __future__ import annotations

import copy

import pytest
import torch

import rtkernels
from rtkernels import ops
from graphs import capture
from reference import reference
from test_compile_op_cpu import Model, _inputs, _reference_attention, _run
from tolerances import assert_close

pytestmark = pytest.mark.gpu

SIZES = (2, 300, 256, 4, 64)  # B, N (not a multiple of 64), E, H, D: the chunk kernel's shapes
B, N, E, H, D = SIZES


def _models(trainable: bool, attention_dtype):
    torch.manual_seed(0)
    eager = Model(trainable, sizes=(E, H, D), attention_dtype=attention_dtype).cuda()
    return eager, copy.deepcopy(eager)


def _close(got, want, dtype, what):
    """Every output and gradient of ``got`` within ``dtype``'s tolerance of ``want``."""
    for name, a, b in (("y", got[0], want[0]), ("state", got[1], want[1])):
        assert_close(a, b.double(), dtype, f"{what}: {name}", N)
    for name in want[2]:
        a, b = got[2][name].double(), want[2][name].double()
        if name.endswith("decay"):  # a sum over every token pair of terms of both signs: its norm's tolerance
            tol = 1e-4 if dtype == torch.float32 else 6e-2  # (as tests/test_gpu_cached_grad.py)
            assert (a - b).norm() <= tol * b.norm(), f"{what}: d{name} {a} vs {b}"
        else:
            assert_close(a, b, dtype, f"{what}: d{name}", N)


@pytest.mark.parametrize("attention_dtype", (torch.float32, torch.bfloat16), ids=str)
def test_compiled_model_on_cuda_equals_eager(attention_dtype):
    eager_model, compiled_model = _models(True, attention_dtype)
    x, s0 = _inputs(SIZES, "cuda")
    explained = torch._dynamo.explain(compiled_model)(x, s0)
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
    eager = _run(eager_model, eager_model, x, s0)
    compiled = _run(compiled_model, torch.compile(compiled_model, fullgraph=True), x, s0)
    _close(compiled, eager, attention_dtype, "compiled vs eager")
    if attention_dtype == torch.float32:  # and the fp64 reference model
        reference_model = copy.deepcopy(eager_model).double()
        ref = _run(reference_model, lambda x, s0: reference_model(x, s0, _reference_attention), x.double(),
                   s0.double())
        _close(compiled, ref, torch.float32, "compiled vs fp64")


def test_reduce_overhead_equals_eager():
    """mode="reduce-overhead": CUDA graph trees record the forward and the backward, then replay
    them for new inputs."""
    eager_model, compiled_model = _models(True, torch.bfloat16)
    compiled = torch.compile(compiled_model, fullgraph=True, mode="reduce-overhead")
    for seed in range(4):  # warm-up, recording, replays
        torch.compiler.cudagraph_mark_step_begin()
        x, s0 = _inputs(SIZES, "cuda", seed)
        got = _run(compiled_model, compiled, x, s0)
        _close(got, _run(eager_model, eager_model, x, s0), torch.bfloat16, f"step {seed}")


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32), ids=str)
@pytest.mark.parametrize("layout", ("bhnd", "bnhd"))
def test_cuda_graph_capture_of_forward_and_backward(dtype, layout):
    """The op's forward and backward (outputs, state and the gradients of q, k, v, a CUDA decay
    tensor and the initial state) captured in one torch.cuda.graph, replayed after new values are
    written into its inputs: equal to the eager call and to the fp64 reference."""
    shape = (B, H, N) if layout == "bhnd" else (B, N, H)
    g = torch.Generator().manual_seed(0)

    def draw(*s, scale=1.0, dt=dtype):
        return (torch.randn(*s, generator=g) * scale).to("cuda", dt)

    q, k, v = (draw(*shape, D, scale=D ** -0.5).requires_grad_() for _ in range(3))
    s0 = draw(B, H, D, D, scale=D ** -0.5, dt=torch.float32).requires_grad_()
    decay = torch.tensor([0.5, 0.9, 0.99, 1.0], device="cuda", requires_grad=True)
    grad_out, grad_state = draw(*shape, D), draw(B, H, D, D, dt=torch.float32)
    leaves = (q, k, v, decay, s0)

    def step(call, leaves):
        q, k, v, decay, s0 = leaves
        out, state = call(q, k, v, decay, scale=0.5, layout=layout, initial_state=s0, return_state=True)
        loss = (out.float() * grad_out.float()).sum() + (state * grad_state).sum()
        return (out, state, *torch.autograd.grad(loss, leaves))

    # two warm-ups: compile, plan and cache outside the capture
    graph, captured = capture(lambda: step(ops.causal_linear_attention, leaves), warmup=2)
    for seed in (1, 2):
        g.manual_seed(seed)
        with torch.no_grad():
            for x in (q, k, v):
                x.copy_(draw(*shape, D, scale=D ** -0.5))
            s0.copy_(draw(B, H, D, D, scale=D ** -0.5, dt=torch.float32))
            decay.copy_(torch.tensor([0.3, 0.95, 0.999, 1.0]))
        graph.replay()
        fresh = tuple(t.detach().clone().requires_grad_() for t in leaves)
        eager = step(rtkernels.causal_linear_attention, fresh)
        torch.cuda.synchronize()
        names = ("out", "state", "dq", "dk", "dv", "ddecay", "ds0")
        for name, a, b in zip(names, captured, eager):  # the same kernels on the same values
            assert_close(a, b.double(), dtype, f"replay {seed}: {name} vs eager", N)
        # the replayed output and state against the fp64 reference from the same rounded inputs
        ro, rs = reference(q.detach(), k.detach(), v.detach(), decay.detach(), 0.5, layout, s0.detach())
        assert_close(captured[0], ro, dtype, f"replay {seed}: out", N)
        assert_close(captured[1], rs, dtype, f"replay {seed}: state", N)
