"""The planned kernel backward on the GPU (marker ``gpu``): a backward repeated with the signature of
an earlier one (no initial state, no final-state gradient) repeats that call's launches
(rtkernels.methods.chunk.backward's plans). Its gradients are those of the general path bit for
bit, on new data too; they match autograd through the fp64 reference; it runs without a host sync;
and calls the plan does not cover never take it."""

from __future__ import annotations

import pytest
import torch

import rtkernels
import rtkernels.methods.chunk.backward as kb
from reference import reference
from tolerances import assert_close

pytestmark = pytest.mark.gpu

GAMMAS = (1e-6, 0.5, 0.9, 0.99, 0.999, 1.0)  # 0.9 and 0.99: where a wrong power of gamma shows
SCALE = 0.8


def _leaves(shape, dk, dv, dtype, seed, layout):
    """q, k, v requiring grad in ``layout`` and dL/do, from a seeded fp64 draw."""
    g = torch.Generator().manual_seed(seed)
    b, h, n = shape
    lead = (b, h, n) if layout == "bhnd" else (b, n, h)
    q, k, v = ((torch.randn(*lead, d, generator=g, dtype=torch.float64) / d ** 0.25).to("cuda", dtype)
               for d in (dk, dk, dv))
    grad = torch.randn(*lead, dv, generator=g, dtype=torch.float64).to("cuda", dtype)
    return [x.requires_grad_() for x in (q, k, v)], grad


def _step(leaves, grad, decay, layout, precision):
    """One forward and backward; (dq, dk, dv, d decay or None)."""
    for x in (*leaves, decay):
        x.grad = None
    out = rtkernels.causal_linear_attention(*leaves, decay, scale=SCALE, method="chunk", layout=layout,
                                            fp32_precision=precision)
    out.backward(grad)
    return tuple(x.grad for x in leaves) + (decay.grad,)


CASES = [  # (dtype, Dk, Dv, N, trainable): the fused dlog pass (16-bit, aligned, Dv <= 128), partial tiles,
    # a key-piece split of the Dv-wide passes (Dv 200), fp16 and fp32 (no decay gradient: planned), N = 1
    (torch.bfloat16, 128, 128, 300, True), (torch.bfloat16, 64, 64, 1, True), (torch.float16, 128, 96, 300, True),
    (torch.bfloat16, 40, 72, 200, False),
    (torch.bfloat16, 64, 200, 130, False), (torch.float16, 48, 64, 257, False), (torch.float32, 32, 40, 150, False),
]


@pytest.mark.parametrize("layout", ("bhnd", "bnhd"))
@pytest.mark.parametrize("dtype, dk, dv, n, trainable", CASES, ids=lambda x: str(x).replace("torch.", ""))
def test_planned_backward_repeats_the_general_path(dtype, dk, dv, n, trainable, layout):
    """First call: the general path plans; second call (new data, same signature): the plan, under
    sync-debug mode "error", gives the bits of the general path on that data (plans cleared) and
    the fp64 reference's gradients."""
    kb.clear_plans()
    h = len(GAMMAS)
    decay = torch.tensor(GAMMAS, dtype=torch.float32, device="cuda").requires_grad_(trainable)
    precision = "exact" if dtype == torch.float32 else None
    leaves, grad = _leaves((2, h, n), dk, dv, dtype, 1, layout)
    _step(leaves, grad, decay, layout, precision)
    assert len(kb._plans) == 1
    leaves, grad = _leaves((2, h, n), dk, dv, dtype, 2, layout)
    torch.cuda.set_sync_debug_mode("error")
    try:
        planned = _step(leaves, grad, decay, layout, precision)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    kb.clear_plans()
    general = _step(leaves, grad, decay, layout, precision)
    for a, b in zip(planned, general):
        assert (a is None and b is None) or torch.equal(a, b)
    bh = (lambda t: t) if layout == "bhnd" else (lambda t: t.transpose(1, 2))
    ref = [x.detach().double().requires_grad_() for x in leaves]
    gam = torch.tensor(GAMMAS, dtype=torch.float64, device="cuda").requires_grad_(trainable)
    out, _ = reference(*(bh(x) for x in ref), gam, SCALE)
    out.backward(bh(grad.double()))
    for name, got, want in zip(("dq", "dk", "dv"), planned, ref):
        assert_close(bh(got), bh(want.grad), dtype, f"{name} {dtype} {layout}", n=n)
    if trainable:
        err = (planned[3].double() - gam.grad).abs()
        assert (err <= 2e-2 * gam.grad.abs() + 1e-3 * gam.grad.abs().max()).all(), (planned[3], gam.grad)


def test_calls_outside_the_plan_never_plan():
    """An initial state, a gradient of the final state, or a trainable decay with Dv > 128 (the
    separate dlog(gamma) kernel): no plan is made, and repeating the call gives the same bits."""
    h = len(GAMMAS)
    for kind in ("initial_state", "final_state", "wide_trainable"):
        kb.clear_plans()
        dtype = torch.float16 if kind == "wide_trainable" else torch.bfloat16
        decay = torch.tensor(GAMMAS, dtype=torch.float32, device="cuda").requires_grad_(kind == "wide_trainable")
        results = []
        for _ in range(2):
            (q, k, v), grad = _leaves((1, h, 100), 64, 160 if kind == "wide_trainable" else 64, dtype, 3, "bhnd")
            s0 = torch.ones(1, h, 64, 64, device="cuda") if kind == "initial_state" else None
            res = rtkernels.causal_linear_attention(q, k, v, decay, method="chunk", initial_state=s0,
                                                    return_state=kind == "final_state")
            out, state = res if kind == "final_state" else (res, None)
            loss = (out.float() * grad.float()).sum() + (state.sum() if state is not None else 0)
            loss.backward()
            results.append([x.grad for x in (q, k, v, decay) if x.grad is not None])
        assert not kb._plans, kind
        assert all(torch.equal(a, b) for a, b in zip(*results)), kind


def test_unused_returned_state_takes_the_plan():
    """return_state=True with the state left out of the loss: its gradient is None (not zeros), so
    the backward plans as without the state, and the gradients equal those of return_state=False."""
    h = len(GAMMAS)
    decay = torch.tensor(GAMMAS, dtype=torch.float32, device="cuda").requires_grad_()
    grads = []
    for return_state in (True, False, True):
        kb.clear_plans()
        (q, k, v), grad = _leaves((2, h, 190), 64, 64, torch.bfloat16, 4, "bhnd")
        decay.grad = None
        res = rtkernels.causal_linear_attention(q, k, v, decay, method="chunk", return_state=return_state)
        (res[0] if return_state else res).backward(grad)
        assert len(kb._plans) == 1
        grads.append([x.grad for x in (q, k, v, decay)])
    assert all(torch.equal(a, b) for g in grads[1:] for a, b in zip(grads[0], g))
