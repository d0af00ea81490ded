"""Gradients on the CPU: every method, through ``rtkernels.autograd`` (forward of the method, the
chunked backward), against ``torch.autograd.gradcheck`` and against autograd through the fp64
reference of tests/reference.py.

Losses are linear in the outputs, ``sum(W * out) + sum(WS * final_state)`` with fixed random
weights, so the incoming gradients are W and WS (finite) and every check sees every entry.
"""

from __future__ import annotations


import pytest
import torch

import rtkernels
import rtkernels.autograd as rk_autograd
from inputs import (GAMMA_MIN, LAYOUTS, METHOD_NAMES, compute_state_dtype, make_qkv, make_state, randn)
from reference import reference
from tolerances import assert_close

attention = rtkernels.causal_linear_attention
F64 = torch.float64
FORMS = ("decay", "decay_rate")
#: Boundary factors (not perturbable by a central difference: 1 + eps and 1e-6 - 1e-6 are invalid),
#: and interior values that gradcheck can perturb in both forms.
EDGE_GAMMAS = (GAMMA_MIN, 0.5, 1.0)
INNER_GAMMAS = (0.01, 0.5, 0.97)


def decay_tensor(form: str, gammas, dtype: torch.dtype = F64) -> torch.Tensor:
    """A leaf [H] tensor of factors (form "decay") or rates (form "decay_rate") requiring grad."""
    g = torch.tensor(gammas, dtype=F64)
    return (g if form == "decay" else -torch.log(g)).to(dtype).requires_grad_(True)


def factors(form: str, decay: torch.Tensor) -> torch.Tensor:
    """The factors gamma the reference needs, differentiably from ``decay``."""
    return decay.to(F64) if form == "decay" else torch.exp(-decay.to(F64))


def leaves(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().clone().requires_grad_(True) for t in tensors]


def weights(seed: int, out_shape, state_shape, dtype: torch.dtype, state_dtype: torch.dtype):
    """Loss weights, rounded to the dtypes of the output and the state (so that the incoming
    gradients the library sees are exactly those the fp64 reference sees)."""
    gen = torch.Generator().manual_seed(seed)
    return randn(gen, tuple(out_shape), dtype), randn(gen, tuple(state_shape), state_dtype)


def loss(out: torch.Tensor, state: torch.Tensor, w: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    return (out.to(F64) * w.to(F64)).sum() + (state.to(F64) * ws.to(F64)).sum()


def grads_of(fn, inputs: list[torch.Tensor], w, ws) -> list[torch.Tensor]:
    out, state = fn(*inputs)
    return list(torch.autograd.grad(loss(out, state, w, ws), inputs))


def problem(seed: int, b: int, h: int, n: int, dk: int, dv: int, dtype: torch.dtype, layout: str):
    q, k, v = make_qkv(seed, b, h, n, dk, dv, dtype, layout)
    s0 = make_state(seed + 1, b, h, dk, dv, compute_state_dtype(dtype))
    return q, k, v, s0


def library(method: str, form: str, layout: str, scale: float):
    def fn(q, k, v, s0, decay):
        return attention(q, k, v, method=method, layout=layout, initial_state=s0, return_state=True,
                         scale=scale, **{form: decay})
    return fn


def referenced(form: str, layout: str, scale: float):
    def fn(q, k, v, s0, decay):
        return reference(q, k, v, factors(form, decay), scale, layout, s0)
    return fn


# ------------------------------------------------------------------------------------ gradcheck

@pytest.mark.parametrize("n", (1, 5, 17))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("method", METHOD_NAMES)
def test_gradcheck(method, form, layout, n):
    """gradcheck (fp64, fast mode) of (output, final state) with respect to q, k, v, the initial
    state and the decay, at interior decays; then at the boundary decays gamma in {1e-6, 0.5, 1}
    (which a central difference cannot perturb) with respect to q, k, v and the initial state, the
    decay gradient there checked against autograd through the reference."""
    fn = library(method, form, layout, 0.7)
    q, k, v, s0 = leaves(*problem(n, 1, 3, n, 3, 2, F64, layout))
    decay = decay_tensor(form, INNER_GAMMAS)
    assert torch.autograd.gradcheck(fn, (q, k, v, s0, decay), fast_mode=True)

    edge = decay_tensor(form, EDGE_GAMMAS)
    assert torch.autograd.gradcheck(lambda *x: fn(*x, edge), (q, k, v, s0), fast_mode=True)
    w, ws = weights(n, q.shape[:-1] + (2,), s0.shape, F64, F64)
    got = grads_of(fn, [q, k, v, s0, edge], w, ws)
    want = grads_of(referenced(form, layout, 0.7), [q, k, v, s0, edge], w, ws)
    assert torch.isfinite(got[4]).all(), f"decay gradient at {EDGE_GAMMAS}: {got[4]}"
    for name, g, r in zip(("q", "k", "v", "initial_state", form), got, want):
        assert_close(g, r, F64, f"d{name} at gammas {EDGE_GAMMAS}")


@pytest.mark.parametrize("method", METHOD_NAMES)
def test_gradcheck_full_mode(method):
    """The full (element by element) gradcheck once per method: odd sizes, two batches."""
    fn = library(method, "decay", "bnhd", 1.3)
    q, k, v, s0 = leaves(*problem(3, 2, 2, 4, 3, 1, F64, "bnhd"))
    decay = decay_tensor("decay", (0.3, 0.9))
    assert torch.autograd.gradcheck(fn, (q, k, v, s0, decay))


@pytest.mark.parametrize("method", METHOD_NAMES)
def test_gradcheck_output_only(method):
    """No initial state and no returned state: the output alone, its gradient including the decay."""
    q, k, v = leaves(*make_qkv(4, 1, 2, 17, 2, 3, F64))
    decay = decay_tensor("decay", (0.6, 0.9))
    assert torch.autograd.gradcheck(lambda q, k, v, d: attention(q, k, v, d, method=method), (q, k, v, decay),
                                    fast_mode=True)


@pytest.mark.parametrize("used", ("output", "state"))
def test_unused_result_gets_no_gradient_work(monkeypatch, used):
    """return_state=True with only one of (output, state) in the loss: the backward sees None for the
    other's incoming gradient where it is the state (no final-state terms), zeros where it is the
    output; the gradients match autograd through the fp64 reference."""
    seen = []
    real = rk_autograd.call_gradients

    def spy(call, q, k, v, s0, grad_out, grad_state, *rest):
        seen.append((grad_out is None, grad_state is None))
        return real(call, q, k, v, s0, grad_out, grad_state, *rest)

    monkeypatch.setattr(rk_autograd, "call_gradients", spy)
    q, k, v = leaves(*make_qkv(5, 2, 2, 70, 3, 4, F64))
    decay = decay_tensor("decay", (0.5, 0.9))
    out, state = attention(q, k, v, decay, method="chunk", return_state=True)
    w = randn(torch.Generator().manual_seed(6), tuple(out.shape), F64)
    ((out * w).sum() if used == "output" else (state * 1.5).sum()).backward()
    assert seen == [(False, used == "output")]
    ref = [x.detach().requires_grad_() for x in (q, k, v, decay)]
    r_out, r_state = reference(*ref[:3], ref[3], 1.0)
    ((r_out * w).sum() if used == "output" else (r_state * 1.5).sum()).backward()
    for name, got, want in zip(("dq", "dk", "dv", "ddecay"), (q, k, v, decay), ref):
        if want.grad is None:  # the state does not depend on q
            assert got.grad is None or not got.grad.any(), name
        else:
            assert_close(got.grad, want.grad, F64, name)


# --------------------------------------------------------------------- against the fp64 reference

@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("method", METHOD_NAMES)
def test_long_sequence_matches_reference(method, layout, form):
    """N = 300 crosses the chunk boundaries of every torch path and of the backward (64) and ends
    in a partial chunk; one head keeps everything (gamma = 1), one forgets at once (1e-6)."""
    n = 300
    q, k, v, s0 = leaves(*problem(21, 2, 3, n, 9, 5, F64, layout))
    decay = decay_tensor(form, (1.0, 0.97, GAMMA_MIN))
    w, ws = weights(22, q.shape[:-1] + (5,), s0.shape, F64, F64)
    got = grads_of(library(method, form, layout, 0.6), [q, k, v, s0, decay], w, ws)
    want = grads_of(referenced(form, layout, 0.6), [q, k, v, s0, decay], w, ws)
    for name, g, r in zip(("q", "k", "v", "initial_state", form), got, want):
        assert g.dtype == F64 and g.shape == r.shape
        assert_close(g, r, F64, f"d{name}, {method} {layout}", n=n)


@pytest.mark.parametrize("n", (64, 128, 129))
def test_chunk_multiples(n):
    """Sequences of exactly one, two chunks and one token more (no partial chunk / a last chunk of 1)."""
    q, k, v, s0 = leaves(*problem(n, 1, 2, n, 4, 6, F64, "bhnd"))
    decay = decay_tensor("decay", (0.999, 0.8))
    w, ws = weights(n, q.shape[:-1] + (6,), s0.shape, F64, F64)
    got = grads_of(library("chunk", "decay", "bhnd", 1.0), [q, k, v, s0, decay], w, ws)
    want = grads_of(referenced("decay", "bhnd", 1.0), [q, k, v, s0, decay], w, ws)
    for name, g, r in zip(("q", "k", "v", "initial_state", "decay"), got, want):
        assert_close(g, r, F64, f"d{name}, n={n}", n=n)


@pytest.mark.parametrize("cut", (1, 64, 100, 299))
@pytest.mark.parametrize("methods", [("chunk", "chunk"), ("scan", "vanilla"), ("fleet", "auto"),
                                     ("recursion", "block")])
def test_two_pieces_equal_the_whole(methods, cut):
    """A sequence in two pieces, the state handed over: the gradients that flow through the
    handed-over state into the first piece make the two-piece gradients equal the whole's."""
    n, layout = 300, "bnhd"
    q, k, v, s0 = leaves(*problem(31, 2, 2, n, 6, 7, F64, layout))
    decay = decay_tensor("decay", (0.99, 0.5))
    w, ws = weights(32, q.shape[:-1] + (7,), s0.shape, F64, F64)

    def pieces(q, k, v, s0, decay):
        o1, s1 = attention(q[:, :cut], k[:, :cut], v[:, :cut], decay, method=methods[0], layout=layout,
                           initial_state=s0, return_state=True)
        o2, s2 = attention(q[:, cut:], k[:, cut:], v[:, cut:], decay, method=methods[1], layout=layout,
                           initial_state=s1, return_state=True)
        return torch.cat([o1, o2], dim=1), s2

    got = grads_of(pieces, [q, k, v, s0, decay], w, ws)
    whole = grads_of(library(methods[0], "decay", layout, 1.0), [q, k, v, s0, decay], w, ws)
    for name, g, r in zip(("q", "k", "v", "initial_state", "decay"), got, whole):
        assert_close(g, r, F64, f"d{name}, cut at {cut}", n=n)
    # the first piece's gradients really come through the state: without it they differ
    o1 = attention(q[:, :cut], k[:, :cut], v[:, :cut], decay, method=methods[0], layout=layout, initial_state=s0)
    alone = torch.autograd.grad((o1 * w[:, :cut]).sum(), k)[0]
    assert (alone[:, :cut] - got[1][:, :cut]).abs().max() > 1e-3 * got[1].abs().max()


LOW = (torch.float32, torch.float16, torch.bfloat16)


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("method", METHOD_NAMES)
def test_low_precision_gradients(method, dtype):
    """fp32 and 16-bit inputs: gradients in the input dtypes, within the dtype's tolerance of the
    fp64 gradients of the same rounded inputs (the initial state and decay gradients are fp32
    accumulations of exact products, so they get the fp32 tolerance)."""
    n = 150
    q, k, v, s0 = leaves(*problem(41, 2, 3, n, 12, 10, dtype, "bhnd"))
    decay = decay_tensor("decay", (1.0, 0.95, GAMMA_MIN), torch.float32)
    w, ws = weights(42, q.shape[:-1] + (10,), s0.shape, dtype, s0.dtype)
    fn = library(method, "decay", "bhnd", 0.5)
    out, state = fn(q, k, v, s0, decay)
    assert out.dtype == dtype and state.dtype == torch.float32
    got = grads_of(fn, [q, k, v, s0, decay], w, ws)
    want = grads_of(referenced("decay", "bhnd", 0.5), [q, k, v, s0, decay], w, ws)
    for name, g, r, x in zip(("q", "k", "v", "initial_state", "decay"), got, want, (q, k, v, s0, decay)):
        assert g.dtype == x.dtype, f"d{name} is {g.dtype}, its input {x.dtype}"
        tol = dtype if name in "qkv" else torch.float32
        assert_close(g, r, tol, f"d{name}, {method} {dtype}", n=n)


# -------------------------------------------------------------------------------- decay details

def test_rate_and_factor_gradients_agree():
    """gamma = exp(-r): dL/dr = -gamma dL/dgamma, per head; float32 decay tensors get float32 grads."""
    q, k, v = make_qkv(5, 2, 3, 90, 4, 4, F64)
    g = decay_tensor("decay", (0.3, 0.9, 1.0), torch.float32)
    r = decay_tensor("decay_rate", (0.3, 0.9, 1.0), torch.float32)
    dg = torch.autograd.grad(attention(q, k, v, g).sum(), g)[0]
    dr = torch.autograd.grad(attention(q, k, v, decay_rate=r).sum(), r)[0]
    assert dg.dtype == dr.dtype == torch.float32
    assert torch.allclose(dr.double(), -g.detach().double() * dg.double(), rtol=1e-5)
    assert (dg.abs() > 1e-3).all()


def test_extreme_decays_give_finite_gradients():
    """gamma = 1 over a long sequence, gamma = 1e-6 and 1e-30, a rate beyond the clamp of log(gamma)
    at -1e4 (the gradient of the clamped operator: 0) and a rate of 0."""
    q, k, v = leaves(*make_qkv(6, 1, 3, 2000, 8, 8, torch.float32))
    for form, values in (("decay", (1.0, GAMMA_MIN, 1e-30)), ("decay_rate", (1e5, 0.0, 50.0))):
        d = torch.tensor(values, dtype=F64, requires_grad=True)
        out = attention(q, k, v, method="chunk", **{form: d})
        grads = torch.autograd.grad(out.sum(), (q, k, v, d))
        for name, g in zip("qkvd", grads):
            assert torch.isfinite(g).all(), f"{form}={values}: d{name} is not finite"
        if form == "decay_rate":
            assert grads[3][0] == 0.0 and grads[3][1] != 0.0


def test_decay_without_grad_mode_is_plain():
    """Under no_grad a decay (or q) that requires grad builds no graph; a decay that does not require
    grad gets no gradient and leaves the others as they are."""
    q, k, v = make_qkv(7, 1, 2, 30, 3, 3, F64)
    d = decay_tensor("decay", (0.5, 0.7))
    ql = q.clone().requires_grad_(True)
    with torch.no_grad():
        out = attention(ql, k, v, d)
    assert not out.requires_grad and out.grad_fn is None
    out = attention(ql, k, v, d.detach())
    (dq,) = torch.autograd.grad(out.sum(), ql)
    ref = reference(ql, k, v, d.detach())[0]
    assert_close(dq, torch.autograd.grad(ref.sum(), ql)[0], F64, "dq with a constant decay")


# ------------------------------------------------------------------------------ the Function

@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("method", METHOD_NAMES)
def test_forward_is_the_methods_forward(method, layout):
    """With grad the output is bit for bit the output without grad (the method's own forward ran),
    in the same format; only q, k, v and the initial state are kept for the backward."""
    q, k, v, s0 = problem(8, 2, 2, 70, 5, 3, torch.float32, layout)
    plain, plain_state = attention(q, k, v, 0.9, method=method, layout=layout, initial_state=s0, return_state=True)
    ql, kl, vl, sl = leaves(q, k, v, s0)
    out, state = attention(ql, kl, vl, 0.9, method=method, layout=layout, initial_state=sl, return_state=True)
    assert out.requires_grad and state.requires_grad
    assert torch.equal(out, plain) and torch.equal(state, plain_state)
    assert out.is_contiguous() and out.dtype == q.dtype and out.shape == plain.shape
    saved = out.grad_fn.saved_tensors
    assert len(saved) == 4
    for kept, x in zip(saved, (ql, kl, vl, sl)):
        assert kept.data_ptr() == x.data_ptr(), "the backward keeps the inputs themselves, nothing larger"


def test_backward_impl_is_pluggable(monkeypatch):
    """BACKWARD_IMPLS is asked in order: an implementation in front that takes the inputs runs, one
    that declines does not."""
    calls = []

    def spy(*args):
        calls.append(args[0].shape)
        return rk_autograd.torch_backward(*args)

    def never(*args):
        raise AssertionError("an implementation that declined the inputs ran")

    monkeypatch.setattr(rk_autograd, "BACKWARD_IMPLS",
                        [(lambda q, v: False, never), (lambda q, v: q.shape[-1] == 4, spy)]
                        + rk_autograd.BACKWARD_IMPLS)
    q, k, v = leaves(*make_qkv(9, 1, 2, 20, 4, 3, F64))
    out = attention(q, k, v, 0.8, method="scan")
    (dq,) = torch.autograd.grad(out.sum(), q)
    assert calls == [torch.Size([1, 2, 20, 4])]
    assert_close(dq, torch.autograd.grad(reference(q, k, v, torch.full((2,), 0.8, dtype=F64))[0].sum(), q)[0],
                 F64, "dq through the spy")


def test_unused_outputs_and_repeated_backward():
    """A loss on the state alone, or on the output alone, gives the right gradients; backward twice
    through a retained graph gives the same gradients twice."""
    q, k, v, s0 = leaves(*problem(10, 1, 2, 80, 3, 4, F64, "bhnd"))
    gam = torch.tensor([0.9, 0.6], dtype=F64)
    out, state = attention(q, k, v, gam, initial_state=s0, return_state=True)
    ref_out, ref_state = reference(q, k, v, gam, initial_state=s0)
    for mine, theirs in ((state.sum(), ref_state.sum()), (out.sum(), ref_out.sum())):
        got = torch.autograd.grad(mine, (q, k, v, s0), retain_graph=True, allow_unused=True)
        want = torch.autograd.grad(theirs, (q, k, v, s0), retain_graph=True, allow_unused=True)
        for g, r in zip(got, want):
            assert_close(g, torch.zeros_like(g) if r is None else r, F64, "one output only")
    first = torch.autograd.grad(out.sum(), q, retain_graph=True)[0]
    assert torch.equal(first, torch.autograd.grad(out.sum(), q)[0])


# -------------------------------------------------------------------------------------- NaN

B, H, N, DK, DV = 2, 2, 150, 5, 4
AT_B, AT_H, AT_C = 1, 0, 2


def expected_nan(which: str, pos: int) -> dict[str, torch.Tensor]:
    """Masks of the gradient entries a NaN at ``which[AT_B, AT_H, pos, AT_C]`` reaches (autograd.py's
    docstring): through the sums dq_i = do_i S_i^T, dk_i = v_i U_i^T, dv_i = k_i U_i, dS_0 = gamma U_0."""
    m = {"q": torch.zeros(B, H, N, DK, dtype=torch.bool), "k": torch.zeros(B, H, N, DK, dtype=torch.bool),
         "v": torch.zeros(B, H, N, DV, dtype=torch.bool), "s0": torch.zeros(B, H, DK, DV, dtype=torch.bool)}
    if which == "q":
        m["k"][AT_B, AT_H, :pos + 1, AT_C] = True
        m["v"][AT_B, AT_H, :pos + 1, :] = True
        m["s0"][AT_B, AT_H, AT_C, :] = True
    elif which == "k":
        m["q"][AT_B, AT_H, pos:, AT_C] = True
        m["v"][AT_B, AT_H, pos, :] = True
    else:
        m["q"][AT_B, AT_H, pos:, :] = True
        m["k"][AT_B, AT_H, pos, :] = True
    return m


@pytest.mark.parametrize("gamma", (GAMMA_MIN, 0.9))
@pytest.mark.parametrize("pos", (0, 63, 64, 70, N - 1))
@pytest.mark.parametrize("which", ("q", "k", "v"))
@pytest.mark.parametrize("method", ("chunk", "scan", "vanilla"))
def test_nan_reaches_exactly_its_gradient_rows(method, which, pos, gamma):
    """NaN in an input gives NaN in exactly the gradient entries it reaches, elsewhere the gradient
    of the input with that entry set to zero (the backward is shared by every method; three
    forwards here)."""
    q, k, v, s0 = problem(pos, B, H, N, DK, DV, torch.float32, "bhnd")
    tensors = dict(q=q, k=k, v=v)
    tensors[which] = tensors[which].clone()
    clean = {name: t.clone() for name, t in tensors.items()}
    tensors[which][AT_B, AT_H, pos, AT_C] = float("nan")
    clean[which][AT_B, AT_H, pos, AT_C] = 0.0
    decay = torch.tensor([gamma, 0.5], dtype=F64)
    w, ws = weights(pos, (B, H, N, DV), s0.shape, torch.float32, torch.float32)

    def run(src):
        x = leaves(src["q"], src["k"], src["v"], s0)
        return grads_of(library(method, "decay", "bhnd", 1.0), [*x, decay.clone().requires_grad_(True)], w, ws)

    got, ref = run(tensors), run(clean)
    want = expected_nan(which, pos)
    for name, g, r in zip(("q", "k", "v", "s0"), got, ref):
        nan = torch.isnan(g)
        assert torch.equal(nan, want[name]), (f"NaN at {which}[.., {pos}, {AT_C}]: d{name} has NaN at "
                                              f"{nan.nonzero().tolist()[:6]}, expected {want[name].nonzero().tolist()[:6]}")
        assert torch.isfinite(g[~want[name]]).all()
        assert_close(g[~want[name]], r[~want[name]], torch.float32, f"d{name} where the NaN does not reach", n=N)
    assert torch.isnan(got[4][0]) and torch.isfinite(got[4][1]), "the decay gradient of the NaN's head only"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_output_given_or_allocated_by_the_function(layout):
    """attention_with_grad with ``out`` None (the API's call: the Function allocates the output,
    contiguous in the layout) and with an empty output given (filled in place, returned, marked
    dirty): the same values and gradients. The Function is applied through the C entry point where
    this torch has it (the cached call's host time), and that gives the same graph."""
    q, k, v, s0 = problem(11, 2, 3, 37, 5, 7, F64, layout)
    w, ws = weights(12, v.shape, s0.shape, F64, F64)
    gamma = torch.tensor([0.5, 0.9, 0.99], dtype=F64)
    log_decay = rtkernels.decay.LogDecay(q.device, host=tuple(torch.log(gamma).tolist()))

    def run(out_given: bool):
        def fn(q, k, v, s0):
            out = torch.empty_like(v) if out_given else None
            res, state = rk_autograd.attention_with_grad("chunk", q, k, v, log_decay, 0.5, out, layout, s0, True)
            assert out is None or res is out
            assert res.is_contiguous() and res.shape == v.shape
            return res, state
        return fn

    ins = leaves(q, k, v, s0)
    given, allocated = (grads_of(run(flag), ins, w, ws) for flag in (True, False))
    expect = grads_of(referenced("decay", layout, 0.5), leaves(q, k, v, s0, gamma), w, ws)[:4]
    for a, b, e in zip(given, allocated, expect):
        assert torch.equal(a, b)
        assert_close(a, e, F64, "gradient", 37)
    assert rk_autograd._apply_attention is not rk_autograd.CausalLinearAttentionFunction.apply
