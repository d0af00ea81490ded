"""Property tests on the GPU (marker ``gpu``): hypothesis draws problems -- B, H, N, Dk, Dv,
dtype, layout, memory layout, per-head gamma (1e-6 to 1, log-uniform and close to 1), decay form,
scale, method (``auto`` included) -- and every answer is held against the fp64 reference
(tests/reference.py, computed on the GPU). Sizes are bounded (N <= 600, D <= 256, B <= 3, H <= 4)
so that the 500 forward and 100 gradient examples together take about a minute on an H100 once the
kernels are compiled. ``derandomize=True``: the same examples on every run; a failure prints the
drawn problem (seed included), the ``note`` below, and a ``@reproduce_failure`` blob.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import rtkernels
from rtkernels.methods import METHODS, auto_method

from inputs import DECAY_FORMS, LAYOUTS, MEMORY, Problem, gamma_values, head_dims, seq_lens, with_memory
from reference import reference
from tolerances import assert_close, assert_close_to_magnitude

pytestmark = pytest.mark.gpu

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: Head sizes on and next to the kernels' KMAX / BV boundaries (32, 64, 128, 256), besides inputs.py's.
WIDE_D = (95, 96, 97, 127, 128, 129, 160, 200, 255, 256)
#: Sequence lengths around the chunk kernels' 64-token chunks and the torch paths' blocks.
LONG_N = (191, 192, 193, 255, 256, 257, 511, 512, 513, 600)


@st.composite
def gpu_problems(draw, max_n: int = 600, max_b: int = 3, max_h: int = 4) -> tuple[Problem, bool]:
    """(a :class:`inputs.Problem` with head sizes up to 256, whether a decay tensor goes on the GPU)."""
    h = draw(st.integers(1, max_h))
    dims = st.one_of(head_dims(80), st.sampled_from(WIDE_D), st.integers(1, 256))
    p = Problem(
        b=draw(st.integers(1, max_b)), h=h,
        n=draw(st.one_of(seq_lens(300), st.sampled_from(LONG_N), st.integers(1, max_n))),
        dk=draw(dims), dv=draw(dims),
        layout=draw(st.sampled_from(LAYOUTS)), form=draw(st.sampled_from(DECAY_FORMS)),
        gammas=tuple(draw(st.lists(gamma_values(), min_size=h, max_size=h))),
        decay_dtype=draw(st.sampled_from([torch.float64, torch.float32])),
        scale=draw(st.one_of(st.just(1.0), st.floats(0.1, 3.0))),
        memory=draw(st.sampled_from(MEMORY)), seed=draw(st.integers(0, 2 ** 31 - 1)))
    return p, draw(st.booleans())


def _build(p: Problem, dtype: torch.dtype, decay_on_gpu: bool):
    """The problem's inputs on the GPU (memory layout kept), its keyword arguments, fp64 factors."""
    case = p.build(dtype)
    q, k, v = (with_memory(x.cuda(), p.memory) for x in (case.q, case.k, case.v))
    kwargs = dict(case.kwargs)
    for key in ("decay", "decay_rate"):
        if decay_on_gpu and isinstance(kwargs.get(key), torch.Tensor):
            kwargs[key] = kwargs[key].cuda()
    return q, k, v, kwargs, case.gamma.cuda()


_SETTINGS = dict(deadline=None, derandomize=True, print_blob=True,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])


@settings(max_examples=500, **_SETTINGS)
@given(drawn=gpu_problems(), dtype=st.sampled_from(DTYPES), method=st.sampled_from(rtkernels.METHOD_NAMES),
       return_state=st.booleans())
def test_forward_matches_fp64(drawn, dtype, method, return_state):
    """Output (and final state) of any method on any drawn problem within the dtype's tolerance."""
    p, decay_on_gpu = drawn
    q, k, v, kwargs, gamma = _build(p, dtype, decay_on_gpu)
    note(f"problem {p}, dtype {dtype}, method {method}, decay on GPU {decay_on_gpu}, kwargs {sorted(kwargs)}")
    res = rtkernels.causal_linear_attention(q, k, v, method=method, return_state=return_state, **kwargs)
    out, state = res if return_state else (res, None)
    ref, ref_state = reference(q, k, v, gamma, p.scale, p.layout)
    assert out.dtype == dtype and out.shape == ref.shape and out.is_contiguous()
    assert_close(out, ref, dtype, f"{method} {p} {dtype}", n=p.n)
    if return_state:
        qb = q if p.layout == "bhnd" else q.transpose(1, 2)
        vb = v if p.layout == "bhnd" else v.transpose(1, 2)
        name = auto_method(qb, vb) if method == "auto" else method
        # the chunk kernel's state takes 16-bit operands; every other path accumulates in fp32
        tol = dtype if name == "chunk" and METHODS["chunk"].uses_kernel(qb, vb) else torch.float32
        assert state.dtype == torch.float32
        assert_close(state, ref_state, tol, f"{method} {p} {dtype} state", n=p.n)


@settings(max_examples=100, **_SETTINGS)
@given(drawn=gpu_problems(max_n=400, max_b=2, max_h=3), dtype=st.sampled_from(DTYPES),
       method=st.sampled_from(("chunk", "scan", "auto")))
def test_gradients_match_fp64(drawn, dtype, method):
    """dq, dk, dv and the gradient of a decay tensor (on the GPU or the CPU, factors or rates)
    against autograd through the fp64 reference."""
    p, decay_on_gpu = drawn
    q, k, v, kwargs, _ = _build(p, dtype, decay_on_gpu)
    note(f"problem {p}, dtype {dtype}, method {method}, decay on GPU {decay_on_gpu}, kwargs {sorted(kwargs)}")
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    decay_key = next((key for key in ("decay", "decay_rate") if isinstance(kwargs.get(key), torch.Tensor)), None)
    if decay_key is not None:
        kwargs[decay_key] = kwargs[decay_key].detach().clone().float().requires_grad_(True)
    out = rtkernels.causal_linear_attention(*leaves, method=method, **kwargs)
    w = torch.randn(out.shape, generator=torch.Generator(device="cuda").manual_seed(p.seed % 1000), device="cuda")
    (out.float() * w).sum().backward()
    # the reference (the same decay argument in fp64, mapped to factors as the library documents),
    # and the magnitude of each gradient: the same problem on |q|, |k|, |v|, |dL/do| (every term of
    # every sum positive), the scale a sum's rounding error is bounded by. Gradients are sums of
    # terms of both signs (a drawn problem can cancel to a tiny dq of one element), so they are
    # held to the dtype's tolerance relative to that magnitude.
    def fp64_grads(sign):
        leaves64 = [sign(x.detach().double()).requires_grad_(True) for x in (q, k, v)]
        extra = []
        if decay_key is None:
            gamma = _build(p, dtype, decay_on_gpu)[4]
        else:
            src = kwargs[decay_key].detach().double().cuda().requires_grad_(True)
            gamma, extra = (src if decay_key == "decay" else torch.exp(-src)), [src]
        ref, _ = reference(*leaves64, gamma, abs(p.scale) if sign is torch.abs else p.scale, p.layout)
        return torch.autograd.grad((ref * sign(w.double())).sum(), leaves64 + extra)

    grads, magnitude = fp64_grads(lambda x: x), fp64_grads(torch.abs)
    got = [x.grad for x in leaves] + ([kwargs[decay_key].grad] if decay_key is not None else [])
    for name, g, r, m in zip(("dq", "dk", "dv", "d" + str(decay_key)), got, grads, magnitude):
        assert g is not None, f"{name} missing"
        assert_close_to_magnitude(g, r, m, dtype, f"{name} {method} {p} {dtype}", n=p.n)
