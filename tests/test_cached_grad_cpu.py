"""The cached call with autograd history (rtkernels.call_cache.GradCall), on the CPU: the chunk method's
kernel path is replaced by a stand-in whose "planned launch" runs the torch path, so the plumbing of
api -> call_cache -> the autograd Function is what is tested. A repeated call with new tensors is
answered from the cache (no second plan) and gives the outputs, final state and gradients of the
fp64 reference. The real kernels run the same check in tests/test_gpu_cached_grad.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import rtkernels
from reference import reference
from rtkernels import api, call_cache
from rtkernels.decay import LogDecay
from rtkernels.methods import chunk as chunk_pkg
from rtkernels.methods._torch_common import run_torch_path
from rtkernels.methods.registry import Method

F64 = torch.float64
GAMMAS = (0.9, 0.99, 0.5)


class _StandIn(Method):
    def uses_kernel(self, q, v):  # the CPU "kernel": a planned launch that runs the torch path
        return True


@pytest.fixture
def planned(monkeypatch):
    """Replace the chunk method by the stand-in; the list of plans made."""
    plans = []

    def prepare(q, k, v, log_decay, scale, out, need_state, fp32_precision="exact"):
        plans.append((q.shape, need_state))
        host = LogDecay(q.device, host=log_decay.host) if log_decay.host is not None else None

        planned_shape = q.shape

        def launch(q, k, v, out, s0=None, decay=None):
            # a kernel launch reads pointers and takes the caller's layout as well as the planned
            # [B, H, N, D] views; the torch path needs the views
            if q.shape != planned_shape:
                q, k, v, out = (t.transpose(1, 2) for t in (q, k, v, out))
            ld = host if decay is None else LogDecay(q.device, raw=decay, kind=log_decay.kind)
            return run_torch_path(chunk_pkg.torch_forward, q, k, v, ld, scale, out, s0, need_state)
        return launch

    real = api.METHODS["chunk"]
    path = dataclasses.replace(real.kernel, supports=lambda q, v: True, prepare=prepare)
    fields = {f.name: getattr(real, f.name) for f in dataclasses.fields(real)}
    monkeypatch.setitem(api.METHODS, "chunk", _StandIn(**{**fields, "kernel": path}))
    call_cache.clear()
    yield plans
    call_cache.clear()


def _inputs(layout: str, seed: int, with_state: bool):
    g = torch.Generator().manual_seed(seed)
    b, h, n, dk, dv = 2, len(GAMMAS), 37, 5, 3
    shape = (b, h, n) if layout == "bhnd" else (b, n, h)
    q, k, v = (torch.randn(*shape, d, generator=g, dtype=F64).requires_grad_() for d in (dk, dk, dv))
    s0 = torch.randn(b, h, dk, dv, generator=g, dtype=F64).requires_grad_() if with_state else None
    return q, k, v, s0


@pytest.mark.parametrize("layout", ("bhnd", "bnhd"))
@pytest.mark.parametrize("with_state", (False, True))
@pytest.mark.parametrize("return_state", (False, True))
def test_repeated_call_with_grad_is_cached_and_exact(planned, layout, with_state, return_state):
    gamma = torch.tensor(GAMMAS, dtype=F64)
    for seed in range(3):  # the first call plans, the next two are answered from the cache
        q, k, v, s0 = _inputs(layout, seed, with_state)
        res = rtkernels.causal_linear_attention(q, k, v, gamma, scale=0.7, method="chunk", layout=layout,
                                                initial_state=s0, return_state=return_state)
        out, state = res if return_state else (res, None)
        ref_out, ref_state = reference(q, k, v, gamma, 0.7, layout, s0)
        assert torch.allclose(out, ref_out, rtol=1e-10, atol=1e-12)
        if return_state:
            assert torch.allclose(state, ref_state, rtol=1e-10, atol=1e-12)
        g = torch.randn_like(out)
        loss = (out * g).sum() + (state.sum() if return_state else 0)
        ref_loss = (ref_out * g).sum() + (ref_state.sum() if return_state else 0)
        leaves = [t for t in (q, k, v, s0) if t is not None]
        got = torch.autograd.grad(loss, leaves)
        want = torch.autograd.grad(ref_loss, leaves)
        for a, b in zip(got, want):
            assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)
    assert len(planned) == 1, planned
    assert call_cache.size() == 1


def test_grad_and_no_grad_calls_are_cached_apart(planned):
    q, k, v, _ = _inputs("bhnd", 0, False)
    first = rtkernels.causal_linear_attention(q, k, v, 0.9, method="chunk")
    assert first.grad_fn is not None
    with torch.no_grad():
        plain = rtkernels.causal_linear_attention(q, k, v, 0.9, method="chunk")
    assert plain.grad_fn is None
    again = rtkernels.causal_linear_attention(q, k, v, 0.9, method="chunk")
    assert again.grad_fn is not None and torch.equal(again.detach(), first.detach())
    assert len(planned) == 2 and call_cache.size() == 2
