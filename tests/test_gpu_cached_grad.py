"""The cached call with autograd history on the GPU (marker ``gpu``): a repeated training call (q, k, v,
a CUDA decay tensor of factors or rates, the initial state requiring grad) is answered from the call
cache, plans once, runs with no host sync, and gives the outputs, final state and gradients of the
fp64 reference (tests/test_cached_grad_cpu.py checks the plumbing on the CPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import rtkernels
from reference import reference
from rtkernels import api, call_cache
from tolerances import assert_close

pytestmark = pytest.mark.gpu

GAMMAS = (1e-6, 0.9, 0.99, 1.0)  # 0.9 and 0.99: where a wrong power of gamma shows


@pytest.fixture
def plans(monkeypatch):
    """Count the chunk method's plans (kernel_prepare calls) in a fresh call cache."""
    made = []
    real = api.METHODS["chunk"]
    prepare = real.kernel.prepare

    def counted(*args, **kwargs):
        made.append(1)
        return prepare(*args, **kwargs)

    monkeypatch.setitem(api.METHODS, "chunk", dataclasses.replace(
        real, kernel=dataclasses.replace(real.kernel, prepare=counted)))
    call_cache.clear()
    yield made
    call_cache.clear()


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32), ids=str)
@pytest.mark.parametrize("form", ("decay", "decay_rate", "float"))
@pytest.mark.parametrize("layout", ("bhnd", "bnhd"))
def test_repeated_training_call_is_cached_and_exact(plans, dtype, form, layout):
    b, h, n, dk, dv = 2, len(GAMMAS), 300, 40, 72
    factors = torch.tensor(GAMMAS, dtype=torch.float64)
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)

        def draw(*shape):
            return torch.randn(*shape, generator=g, dtype=torch.float64)

        shape = (b, h, n) if layout == "bhnd" else (b, n, h)
        q, k, v = ((draw(*shape, d) / d ** 0.25).to("cuda", dtype).requires_grad_() for d in (dk, dk, dv))
        s0 = (draw(b, h, dk, dv) / dk ** 0.5).to("cuda", torch.float32).requires_grad_()
        if form == "float":
            kw, gamma = {"decay": 0.9}, torch.full((h,), 0.9, dtype=torch.float64)
        else:
            raw = factors if form == "decay" else -torch.log(factors)
            d = raw.to("cuda", torch.float32).requires_grad_()
            kw, gamma = {form: d}, factors

        def run(leaves):
            q, k, v, s0, d = leaves
            if d is not None:
                kw[form] = d
            out, state = rtkernels.causal_linear_attention(q, k, v, scale=0.8, method="chunk", layout=layout,
                                                           initial_state=s0, return_state=True,
                                                           fp32_precision="exact", **kw)
            ((out * grad_out).sum() + state.sum()).backward()
            return out, state

        leaves = (q, k, v, s0, kw.get(form))
        grad_out = torch.randn(*shape, dv, generator=g, dtype=torch.float64).to("cuda", dtype)
        torch.cuda.set_sync_debug_mode("error" if seed else 0)  # the cached calls: no host sync
        try:
            out, state = run(leaves)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        # the same call on the full path (no cache): the same bits, gradients included
        fresh = tuple(None if t is None else t.detach().clone().requires_grad_() for t in leaves)
        with pytest.MonkeyPatch.context() as m:
            m.setattr(call_cache, "call_key", lambda *a, **kw_: None)
            out2, state2 = run(fresh)
        assert torch.equal(out, out2) and torch.equal(state, state2)
        for cached, full in zip(leaves, fresh):
            if cached is not None:
                assert torch.equal(cached.grad, full.grad)
        # against the fp64 reference, by autograd from the same (rounded) inputs
        lg = torch.log(gamma).to("cuda").requires_grad_()
        qr, kr, vr, sr = (t.detach().double().requires_grad_() for t in (q, k, v, s0))
        ro, rs = reference(qr, kr, vr, torch.exp(lg), 0.8, layout, sr)
        ((ro * grad_out.double()).sum() + rs.sum()).backward()
        assert_close(out, ro, dtype, "out", n)
        assert_close(state, rs, dtype, "state", n)
        for got, want, what in ((q.grad, qr.grad, "dq"), (k.grad, kr.grad, "dk"), (v.grad, vr.grad, "dv"),
                                (s0.grad, sr.grad, "ds0")):
            assert_close(got, want, dtype, what, n)
        if form != "float":
            # gamma = 1e-6 left out (d/dgamma is scaled by 1e6); 16-bit: a sum of random-sign terms
            # whose 16-bit operands were rounded (tests/test_gpu_decay_grad.py checks it tightly)
            want = (lg.grad / gamma.to("cuda") if form == "decay" else -lg.grad)[1:]
            got = leaves[4].grad.double()[1:]
            assert (got - want).norm() <= (1e-4 if dtype == torch.float32 else 6e-2) * want.norm(), (got, want)
    assert len(plans) == 1 and call_cache.size() == 1, (plans, call_cache.size())
