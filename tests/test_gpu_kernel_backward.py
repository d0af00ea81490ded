"""The chunk-kernel backward on the GPU (marker ``gpu``): gradients through ``loss.backward()`` with
method="chunk" against autograd through the fp64 reference, the reversed kernel pass against the
kernel on flipped copies, and the backward's peak memory."""

from __future__ import annotations

import functools
import math
from typing import Optional

import pytest
import torch

from inputs import force_chunk

import rtkernels
from rtkernels.autograd import backward_impl
from rtkernels.decay import LogDecay
from rtkernels.methods.chunk.backward import forward_pass, kernel_backward
from rtkernels.methods import chunk

from reference import reference
from test_gpu_grad import _case
from tolerances import assert_close, assert_close_to_magnitude

pytestmark = pytest.mark.gpu

GAMMAS = (1e-6, 0.5, 0.9, 0.99, 0.999)  # 0.9 and 0.99: a wrong power of gamma shows in fp32 and fp16
#: ((B, H, N, Dk, Dv, layout), forced number of sequence segments or None): N in {1, 65, 300,
#: 500, 1000, 4096}, Dk != Dv, D in {16, 37, 64, 128, 200, 256} (37 and 200: rows that are not a
#: multiple of 16 bytes, the element loaders; 200 and 256: KMAX 256), both layouts; N = 4096 and
#: one D = 256 case also split into 3 segments.
CASES = [((2, 2, 1, 16, 64, "bhnd"), None), ((1, 3, 65, 64, 16, "bnhd"), None),
         ((1, 2, 1000, 128, 64, "bhnd"), None), ((2, 1, 1000, 16, 128, "bnhd"), None),
         ((1, 2, 4096, 64, 128, "bhnd"), None), ((1, 2, 4096, 128, 16, "bnhd"), None),
         ((1, 2, 4096, 64, 128, "bhnd"), 3), ((1, 2, 4096, 128, 16, "bnhd"), 3),
         ((1, 2, 300, 256, 256, "bhnd"), None), ((1, 2, 500, 37, 200, "bnhd"), None),
         ((2, 1, 300, 200, 37, "bhnd"), None), ((1, 2, 1000, 256, 200, "bhnd"), 3)]


def _case_id(case) -> str:
    shape, segments = case
    return "x".join(map(str, shape)) + ("" if segments is None else f"-seg{segments}")


@functools.lru_cache(maxsize=8)
def _want_stateless(shape: tuple, dtype: torch.dtype, gamma: float) -> tuple:
    """fp64 reference gradients of sum(W * out) (no initial state, no returned state) with respect
    to q, k, v and the decay, on the inputs of test_gpu_grad's case."""
    (q, k, v, _, decay, w, _), _ = _case(shape, dtype, gamma)
    leaves = [x.detach().to(torch.float64, copy=True).requires_grad_(True) for x in (q, k, v, decay)]
    out, _ = reference(*leaves[:3], leaves[3], 0.8, shape[-1])
    return torch.autograd.grad((out * w.double()).sum(), leaves)


@functools.lru_cache(maxsize=8)
def _decay_magnitude(shape: tuple, dtype: torch.dtype, gamma: float, stateful: bool) -> torch.Tensor:
    """The magnitude of d(decay): its fp64 gradient for the same problem on |q|, |k|, |v|, |S_0| and
    |loss weights|, every term of dlog(gamma) positive. d(decay) sums terms of both signs over every
    pair of tokens; where they nearly cancel (e.g. (1, 2, 500, 37, 200) with a state at gamma 0.999:
    every dtype, fp32 included, then misses by hundreds of its roundings relative to the result),
    its rounding error is bounded by this sum, not by the result."""
    (q, k, v, s0, decay, w, ws), _ = _case(shape, dtype, gamma)
    leaves = [x.detach().double().abs().requires_grad_(True) for x in (q, k, v, s0)] + \
        [decay.detach().double().requires_grad_(True)]
    out, state = reference(*leaves[:3], leaves[4], 0.8, shape[-1], leaves[3] if stateful else None)
    loss = (out * w.double().abs()).sum() + ((state * ws.double().abs()).sum() if stateful else 0)
    return torch.autograd.grad(loss, leaves[4])[0]


@pytest.mark.parametrize("stateful", (True, False), ids=("state", "nostate"))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32), ids=str)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_kernel_backward_matches_fp64(case, dtype, stateful, monkeypatch):
    """dq, dk, dv and dS_0 within the dtype's tolerance (16-bit passes on tensor cores; dS_0 is
    the reversed pass's final state, accumulated from 16-bit products like the forward's state),
    d(decay) too (the dlog(gamma) kernel: 16-bit operands, fp32 accumulation; an fp32 emulation of
    its roundings stays within 0.4 of the tolerance on these cases). ``stateful``: an initial state
    and a loss on the returned final state too (the G terms), else the output alone."""
    shape, segments = case
    force_chunk(monkeypatch, segments=segments)
    b, h, n, dk, dv, layout = shape
    for gamma in GAMMAS:
        (q, k, v, s0, decay, w, ws), want = _case(shape, dtype, gamma)
        if not stateful:
            want = _want_stateless(shape, dtype, gamma)
        leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v, *([s0] if stateful else []), decay.float())]
        qv, vv = (x if layout == "bhnd" else x.transpose(1, 2) for x in (leaves[0], leaves[2]))
        assert backward_impl(qv, vv) is kernel_backward
        res = rtkernels.causal_linear_attention(*leaves[:3], leaves[-1], scale=0.8, method="chunk", layout=layout,
                                                initial_state=leaves[3] if stateful else None,
                                                return_state=stateful)
        out, state = res if stateful else (res, None)
        loss = (out.float() * w.float()).sum() + ((state * ws).sum() if stateful else 0)
        loss.backward()
        names = ("q", "k", "v", *(["initial_state"] if stateful else []), "decay")
        for name, x, r in zip(names, leaves, want):
            assert x.grad.dtype == x.dtype, f"d{name}: {x.grad.dtype}"
            what = f"d{name} {dtype} {case} gamma={gamma}"
            if name == "decay":  # a sum over every token pair that can nearly cancel: see _decay_magnitude
                assert_close_to_magnitude(x.grad, r, _decay_magnitude(shape, dtype, gamma, stateful), dtype, what, n=n)
            else:
                assert_close(x.grad, r, dtype, what, n=n)


#: (B, H, N, Dk, Dv, layout): 16-byte rows (the cp.async loader) and rows of 20 / 12 elements
#: (the element loader), one and several chunks, a partial last chunk.
REVERSE_SHAPES = [(2, 3, 200, 64, 32, "bhnd"), (1, 2, 4096, 128, 128, "bnhd"), (2, 2, 200, 20, 12, "bnhd"),
                  (1, 1, 1, 16, 16, "bhnd")]


@pytest.mark.parametrize("segments", (None, 3))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32), ids=str)
@pytest.mark.parametrize("shape", REVERSE_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_reverse_pass_is_the_kernel_on_flipped_copies(shape, dtype, segments, monkeypatch):
    """The reversed kernel pass (pointers of row N-1, negated token strides) gives bit for bit the
    kernel's output on flipped copies, flipped back, and the same final state, with and without an
    initial state and with the split-sequence strategy forced."""
    force_chunk(monkeypatch, segments=segments)
    b, h, n, dk, dv, layout = shape
    g = torch.Generator(device="cuda").manual_seed(n)
    dims = (lambda d: (b, h, n, d)) if layout == "bhnd" else (lambda d: (b, n, h, d))
    q, k, v = (torch.randn(dims(d), generator=g, device="cuda").to(dtype) for d in (dk, dk, dv))
    if layout == "bnhd":
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    s0 = torch.randn(b, h, dk, dv, generator=g, device="cuda")
    ld = LogDecay(q.device, host=tuple(math.log(x) for x in torch.linspace(0.5, 0.999, h).tolist()))
    for init in (None, s0):
        out = torch.empty_like(v)
        state = forward_pass(q, k, v, ld, 0.7, out, init, True, True)
        flipped = torch.empty(b, h, n, dv, dtype=dtype, device="cuda")
        want_state = chunk.kernel_forward(*(x.flip(2).contiguous() for x in (q, k, v)), ld, 0.7, flipped, init, True)
        assert torch.equal(out, flipped.flip(2)), f"{shape} {dtype} segments={segments} init={init is not None}"
        assert torch.equal(state, want_state)


@pytest.mark.parametrize("gamma", (0.9, 0.99))
def test_fp32_backward_in_tf32_mode(gamma):
    """fp32_precision="tf32": the float32 backward's kernel passes run in TF32 too (error about 1e-3,
    within the bf16 tolerance), and the exact mode is closer to fp64 than TF32 is."""
    shape = (1, 2, 1000, 128, 64, "bhnd")
    (q, k, v, s0, decay, w, ws), want = _case(shape, torch.float32, gamma)
    errs = {}
    for mode in ("tf32", "exact"):
        leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
        out = rtkernels.causal_linear_attention(*leaves, decay.float(), scale=0.8, method="chunk", fp32_precision=mode)
        (out * w).sum().backward()
        want_q = _want_stateless(shape, torch.float32, gamma)
        assert_close(leaves[0].grad, want_q[0], torch.bfloat16, f"dq {mode}")
        errs[mode] = float((leaves[0].grad.double() - want_q[0]).norm() / want_q[0].norm())
    assert errs["exact"] < errs["tf32"] / 10, errs


def _peak_backward_bytes(out: torch.Tensor, grad: torch.Tensor, state: Optional[torch.Tensor] = None,
                         grad_state: Optional[torch.Tensor] = None) -> int:
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.autograd.backward([out] + ([state] if state is not None else []),
                            [grad] + ([grad_state] if grad_state is not None else []))
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


@pytest.mark.parametrize("stateful", (False, True), ids=("nostate", "state"))
def test_backward_peak_memory(stateful):
    """At (4, 32, 4096, 128) bf16 the backward allocates less than q + k + v + out + grad together
    (5 x 128 MiB): its three gradients (3 x 128 MiB) and small temporaries, no per-token state and no
    fp32 copies (torch_backward needs several GiB here). With an initial state and a gradient on the
    final state the G terms' fp32 token blocks (3 x 32 MiB) fit in the same bound."""
    b, h, n, d = 4, 32, 4096, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, generator=g, device="cuda").div_(d ** 0.5).to(torch.bfloat16)
               .requires_grad_(True) for _ in range(3))
    s0 = torch.randn(b, h, d, d, generator=g, device="cuda").requires_grad_(True) if stateful else None
    res = rtkernels.causal_linear_attention(q, k, v, 0.99, method="chunk", initial_state=s0, return_state=stateful)
    out, state = res if stateful else (res, None)
    grad = torch.randn(out.shape, generator=g, device="cuda").to(out.dtype)
    grad_state = torch.randn(b, h, d, d, generator=g, device="cuda") if stateful else None
    peak = _peak_backward_bytes(out, grad, state, grad_state)
    bound = sum(x.numel() * x.element_size() for x in (q, k, v, out, grad))
    print(f"backward peak {peak / 2 ** 20:.1f} MiB, bound {bound / 2 ** 20:.1f} MiB")
    assert peak < bound, f"backward allocated {peak / 2 ** 20:.1f} MiB, bound {bound / 2 ** 20:.1f} MiB"
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))
