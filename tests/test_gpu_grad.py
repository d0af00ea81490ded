"""Gradients on the GPU (marker ``gpu``): every method and dtype against autograd through the fp64
reference, on odd shapes; the kernel forwards with the backward rtkernels.autograd picks (the
chunk-kernel backward for fp16/bf16, the torch chunked backward for fp32)."""

from __future__ import annotations

import functools

import pytest
import torch

import rtkernels
from rtkernels.methods import METHODS

import fp64_models as fm
from reference import reference
from tolerances import assert_close

pytestmark = pytest.mark.gpu

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: (B, H, N, Dk, Dv, layout): N in {1, 65, 1000}, Dk != Dv, D in {16, 64, 128}.
SHAPES = [(2, 2, 1, 16, 64, "bhnd"), (1, 3, 65, 64, 16, "bnhd"), (1, 2, 1000, 128, 64, "bhnd"),
          (2, 1, 1000, 16, 128, "bnhd")]
GAMMAS = (1e-6, 0.5, 0.999, 1.0)  # 1: no decay at all, a gradient summed over every pair of tokens
NAMES = ("q", "k", "v", "initial_state", "decay")


def _heads(gamma: float, h: int) -> torch.Tensor:
    """Per-head factors around gamma (gamma itself at the ends of the range)."""
    t = torch.full((h,), gamma, dtype=torch.float64)
    return t * torch.linspace(0.8, 1.0, h, dtype=torch.float64) if 1e-6 < gamma < 0.99 else t


@functools.lru_cache(maxsize=48)
def _case(shape: tuple, dtype: torch.dtype, gamma: float):
    """Inputs (rounded to dtype, in the shape's layout), loss weights, and the fp64 reference
    gradients of sum(W * out) + sum(WS * final_state) with respect to q, k, v, S_0 and decay."""
    b, h, n, dk, dv, layout = shape
    g = torch.Generator().manual_seed(n + dk)
    dims = (lambda d: (b, h, n, d)) if layout == "bhnd" else (lambda d: (b, n, h, d))
    q = (torch.randn(dims(dk), generator=g) / dk ** 0.5).to("cuda", dtype)
    k = (torch.randn(dims(dk), generator=g) / dk ** 0.5).to("cuda", dtype)
    v = torch.randn(dims(dv), generator=g).to("cuda", dtype)
    s0 = (torch.randn(b, h, dk, dv, generator=g) / dk ** 0.5).cuda()
    w = torch.randn(dims(dv), generator=g).to("cuda", dtype)
    ws = torch.randn(b, h, dk, dv, generator=g).cuda()
    decay = _heads(gamma, h).cuda()
    leaves = [x.double().requires_grad_(True) for x in (q, k, v, s0, decay)]
    out, state = reference(*leaves[:3], leaves[4], 0.8, layout, leaves[3])
    grads = torch.autograd.grad((out * w.double()).sum() + (state * ws.double()).sum(), leaves)
    return (q, k, v, s0, decay, w, ws), grads


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("method", rtkernels.METHOD_NAMES)
def test_gradients_match_fp64(method, dtype, shape):
    """dq, dk, dv within the dtype's tolerance (they are rounded to it), dS_0 within the dtype's: for
    fp16/bf16 the chunk-kernel backward makes it the final state of a 16-bit tensor-core pass (like
    the forward's state); d(decay) within the dtype's too: for fp16/bf16 the dlog(gamma) kernel
    (16-bit operands, fp32 accumulation), for fp32 the torch formula (fp32's tolerance)."""
    b, h, n, dk, dv, layout = shape
    for gamma in GAMMAS:
        (q, k, v, s0, decay, w, ws), want = _case(shape, dtype, gamma)
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v, s0, decay.float())]
        out, state = rtkernels.causal_linear_attention(*leaves[:3], leaves[4], scale=0.8, method=method,
                                                       layout=layout, initial_state=leaves[3], return_state=True)
        assert out.dtype == dtype and out.shape == v.shape and out.is_contiguous()
        loss = (out.float() * w.float()).sum() + (state * ws).sum()
        got = torch.autograd.grad(loss, leaves)
        for name, g, r, x in zip(NAMES, got, want, leaves):
            assert g.dtype == x.dtype and g.device == x.device, f"d{name}: {g.dtype} on {g.device}"
            assert_close(g, r, dtype, f"d{name} {method} {dtype} {shape} gamma={gamma}", n=n)


@pytest.mark.parametrize("method", ("chunk", "scan"))
def test_cpu_decay_with_cuda_inputs(method):
    """A trainable decay on the CPU next to CUDA inputs gets its gradient on the CPU, equal to the
    fp64 gradient (autograd through the reference with the same initial state and loss)."""
    (q, k, v, s0, decay, w, ws), _ = _case(SHAPES[1], torch.bfloat16, 0.5)
    d = decay.cpu().requires_grad_(True)
    out = rtkernels.causal_linear_attention(q, k, v, d, scale=0.8, method=method, layout="bnhd", initial_state=s0)
    (dd,) = torch.autograd.grad((out.float() * w.float()).sum(), d)
    ref_decay = decay.detach().double().requires_grad_(True)
    ref, _ = reference(q, k, v, ref_decay, 0.8, "bnhd", s0)
    (want,) = torch.autograd.grad((ref * w.double()).sum(), ref_decay)
    assert dd.device.type == "cpu" and dd.dtype == d.dtype
    assert_close(dd, want, torch.bfloat16, f"d(decay) on the CPU, {method}")


def test_long_sequence_gradients_match_fp64():
    """The bf16 chunk kernel forward and the kernel backward under grad on 16k tokens, gamma = 1
    (no decay) and 1e-6: every gradient (q, k, v, decay) against autograd through an fp64
    blockwise recurrence on the GPU (tests/fp64_models.py; the N x N reference would need tens of GB)."""
    g = torch.Generator().manual_seed(12)
    q, k, v = ((torch.randn(1, 4, 16384, 128, generator=g) / 11).to("cuda", torch.bfloat16).requires_grad_(True)
               for _ in range(3))
    assert METHODS["chunk"].uses_kernel(q, v)
    for gamma in (1.0, 1e-6):
        d = torch.full((4,), gamma, device="cuda", requires_grad=True)
        out = rtkernels.causal_linear_attention(q, k, v, d, method="chunk")
        grads = torch.autograd.grad(out.float().sum(), (q, k, v, d))
        leaves = [x.detach().double().requires_grad_(True) for x in (q, k, v, d)]
        ref, _ = fm.blockwise(*leaves[:3], leaves[3], block=512)
        want = torch.autograd.grad(ref.sum(), leaves)
        for name, x, r in zip("qkvd", grads, want):
            assert_close(x, r, torch.bfloat16, f"gamma={gamma}: d{name}", n=16384)


def test_cupy_inputs_never_detach_a_grad_tensor():
    """CuPy inputs give a CuPy output, which carries no gradient: an initial state or a decay that
    requires grad next to them is a TypeError (and without grad it runs as before)."""
    cupy = pytest.importorskip("cupy")
    (q, k, v, s0, decay, _, _), _ = _case(SHAPES[0], torch.float32, 0.5)
    qc, kc, vc = (cupy.asarray(x) for x in (q, k, v))
    with pytest.raises(TypeError, match="^initial_state requires grad, but q, k and v are CUDA arrays"):
        rtkernels.causal_linear_attention(qc, kc, vc, 0.5, initial_state=s0.clone().requires_grad_(True))
    with pytest.raises(TypeError, match="^the decay tensor requires grad"):
        rtkernels.causal_linear_attention(qc, kc, vc, decay.clone().requires_grad_(True))
    out = rtkernels.causal_linear_attention(qc, kc, vc, decay.detach(), initial_state=s0.detach())
    assert isinstance(out, cupy.ndarray)


@pytest.mark.parametrize("method", ["chunk", "scan"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fp32_exact_gradients_within_1e5(shape, method):
    """Issue 5's fp32 figure: in the exact mode every gradient (q, k, v, S_0, decay) is within
    1e-5 relative (Frobenius) of the fp64 autograd gradient."""
    for gamma in GAMMAS:
        (q, k, v, s0, decay, w, ws), want = _case(shape, torch.float32, gamma)
        leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v, s0, decay)]
        out, state = rtkernels.causal_linear_attention(*leaves[:3], leaves[4], scale=0.8, method=method,
                                                       layout=shape[-1], initial_state=leaves[3],
                                                       return_state=True, fp32_precision="exact")
        ((out * w).sum() + (state * ws).sum()).backward()
        for name, x, r in zip(NAMES, leaves, want):
            err = ((x.grad.double() - r).norm() / r.norm().clamp(min=1e-300)).item()
            assert err <= 1e-5, f"d{name} rel. error {err:.2e} ({method}, {shape}, gamma={gamma})"
