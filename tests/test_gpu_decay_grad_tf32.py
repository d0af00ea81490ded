"""dlog(gamma) for float32 operands in the "tf32" mode (marker ``gpu``): the dlog(gamma) kernel on
fp16 copies scaled by powers of two (rtkernels.methods.chunk.decay_grad.kernel_log_decay_grad_tf32),
against autograd through the fp64 reference on odd shapes and every gamma, with magnitudes far
outside fp16's range, states in and out, NaN, the backward taking it (and the "exact" mode not),
no host sync and a CUDA graph of a training step."""

from __future__ import annotations

import math

import pytest
import torch

import rtkernels
import rtkernels.methods.chunk.backward as kb
from graphs import assert_replays_like_eager
from rtkernels.decay import LogDecay
from rtkernels.methods.chunk import decay_grad
from test_gpu_decay_grad import _want as _want_of
from tolerances import REL_FRO

pytestmark = pytest.mark.gpu

F64, F32 = torch.float64, torch.float32
GAMMAS = (1e-6, 0.5, 0.9, 0.99, 0.999, 1.0)  # 0.9 and 0.99: where a wrong power of gamma shows
SCALE = 0.8
#: fp16 operands (TF32's significand), fp32 sums: the fp16 kernel's tolerance.
TOL = REL_FRO[torch.float16]


def _inputs(n: int, dk: int, dv: int, positive: bool, seed: int, b: int = 2, mags=(1.0, 1.0, 1.0, 1.0)):
    """float32 q, k, v, dL/do ``[B, H, N, D]`` times ``mags``, initial state and dL/d(final state)."""
    h = len(GAMMAS)
    g = torch.Generator().manual_seed(seed)

    def draw(*shape):
        return torch.rand(shape, generator=g, dtype=F64) if positive else torch.randn(shape, generator=g, dtype=F64)

    q, k = (draw(b, h, n, dk) / dk ** 0.5 for _ in range(2))
    v, grad = (draw(b, h, n, dv) for _ in range(2))
    q, k, v, grad = (x * m for x, m in zip((q, k, v, grad), mags))
    s0 = draw(b, h, dk, dv) * (mags[1] * mags[2] / dk ** 0.5)
    g_state = draw(b, h, dk, dv) * (mags[0] * mags[3])
    return tuple(x.to("cuda", F32) for x in (q, k, v, grad, s0, g_state))


def _got(q, k, v, grad, s0, g_state) -> torch.Tensor:
    ld = LogDecay(torch.device("cuda"), host=tuple(math.log(x) for x in GAMMAS))
    out = decay_grad.kernel_log_decay_grad_tf32(q, k, v, ld, SCALE, s0, grad, g_state)
    assert out.dtype == F32 and out.shape == (len(GAMMAS),)
    return out.double()


def _magnitude(q, k, v, grad, s0, g_state) -> torch.Tensor:
    """The same sum over |inputs|: the scale of its terms, for inputs whose sum may cancel."""
    lg = torch.log(torch.tensor(GAMMAS, dtype=F64, device="cuda"))
    return decay_grad.torch_w_recurrence(q.abs(), k.abs(), v.abs(), lg, SCALE, s0.abs(), grad.abs(), g_state.abs())


@pytest.mark.parametrize("sizes", [(16, 16), (40, 72), (128, 128), (200, 37)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("n", (1, 63, 64, 65, 1000))
def test_matches_fp64(n, sizes):
    """Non-negative inputs (no term cancels): every head within fp16's relative tolerance. Normal
    inputs: within that of the value plus 1e-4 of the terms' magnitudes."""
    dk, dv = sizes
    for positive in (True, False):
        x = _inputs(n, dk, dv, positive, 100 * n + dk)
        got, want = _got(*x), _want_of(*x, gammas=GAMMAS)
        bound = TOL * want.abs() + (0 if positive else 1e-4 * _magnitude(*x))
        assert torch.isfinite(got).all() and ((got - want).abs() <= bound).all(), \
            f"n={n} {sizes} positive={positive}: got {got.tolist()}, want {want.tolist()}"


@pytest.mark.parametrize("mags", [(1e6, 1e-6, 3e5, 2e-5), (1e-7, 1e-7, 1e-7, 1e-7), (4e4, 4e4, 4e4, 4e4)],
                         ids=("mixed", "tiny", "large"))
def test_operands_outside_fp16_range(mags):
    """Operands whose plain fp16 copies would overflow (|x| > 65504) or fall into fp16's
    subnormals: each copy has its own power of two, undone at the end, states scaled to match."""
    x = _inputs(300, 64, 48, True, 11, mags=mags)
    got, want = _got(*x), _want_of(*x, gammas=GAMMAS)
    assert torch.isfinite(got).all() and ((got - want).abs() <= TOL * want.abs()).all(), (got.tolist(), want.tolist())


@pytest.mark.parametrize("which", ("q", "k", "v", "grad"))
def test_nan_makes_its_head_nan(which):
    """A NaN in q, k, v or dL/do of head 1 makes its dlog(gamma) NaN; the other heads stay finite and
    accurate (the copy keeps its unscaled values then)."""
    x = list(_inputs(150, 32, 64, True, 3))
    want = _want_of(*x, gammas=GAMMAS)
    i = ("q", "k", "v", "grad").index(which)
    x[i] = x[i].clone()
    x[i][1, 1, 149 if which in ("k", "v") else 70, 5] = float("nan")
    got = _got(*x)
    others = torch.tensor([h != 1 for h in range(len(GAMMAS))], device="cuda")
    assert torch.isnan(got[1]) and torch.isfinite(got[others]).all()
    assert ((got - want).abs()[others] <= TOL * want.abs()[others]).all(), (got.tolist(), want.tolist())


@pytest.mark.parametrize("mode", ("tf32", "exact"))
def test_backward_takes_it_in_tf32_mode_only(monkeypatch, mode):
    """loss.backward() with float32 inputs, a trainable decay and the final state in the loss:
    "tf32" computes dlog(gamma) with the fp16-copy kernel (once), never the torch formula;
    "exact" keeps the torch formula (fp32 accuracy). Both give the fp64 gradient."""
    calls = []

    def count(name, fn):
        def counted(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)
        return counted

    monkeypatch.setattr(kb, "log_decay_grad", count("torch", kb.log_decay_grad))
    monkeypatch.setattr(kb, "kernel_log_decay_grad_tf32", count("tf32", kb.kernel_log_decay_grad_tf32))
    q, k, v, grad, s0, g_state = _inputs(200, 64, 96, True, 1)
    factors = torch.nn.Parameter(torch.tensor(GAMMAS, dtype=F32, device="cuda"))
    out, state = rtkernels.causal_linear_attention(q, k, v, factors, scale=SCALE, method="chunk", initial_state=s0,
                                                   return_state=True, fp32_precision=mode)
    ((out * grad).sum() + (state * g_state).sum()).backward()
    assert calls == ["tf32" if mode == "tf32" else "torch"]
    want = _want_of(q, k, v, grad, s0, g_state, gammas=GAMMAS) / factors.detach().double()
    tol = TOL if mode == "tf32" else REL_FRO[F32]
    assert ((factors.grad.double() - want).abs() <= tol * want.abs()).all(), (factors.grad, want)


def test_training_step_has_no_host_sync_and_replays_in_a_cuda_graph():
    """A tf32-mode training step with a trainable decay: no host sync once planned, and forward plus
    backward captured in a CUDA graph replay equal to eager on new values."""
    q, k, v, grad, _, _ = _inputs(500, 128, 128, True, 5)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    factors = torch.tensor(GAMMAS, dtype=F32, device="cuda", requires_grad=True)

    def step():
        out = rtkernels.causal_linear_attention(*leaves, factors, scale=SCALE, method="chunk", fp32_precision="tf32")
        return torch.autograd.grad((out * grad).sum(), (*leaves, factors))

    def change():
        for x in leaves:
            x.mul_(0.5)
        factors.copy_(torch.tensor([0.3, 0.6, 0.95, 0.999, 0.9999, 1.0]))

    eager = assert_replays_like_eager(step, change)
    assert torch.isfinite(eager[3]).all()
