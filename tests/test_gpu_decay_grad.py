"""The dlog(gamma) kernel of the kernel backward on the GPU (marker ``gpu``;
cuda_src/chunk/decay_grad.cu through rtkernels.methods.chunk.decay_grad.kernel_log_decay_grad): against autograd
through the fp64 reference, on odd shapes and both 16-bit dtypes, with transposed and unaligned
views, NaN, determinism, and ``loss.backward()`` reaching it."""

from __future__ import annotations

import math

import pytest
import torch

import rtkernels
import rtkernels.methods.chunk.backward as kb
from reference import reference
from rtkernels.methods.chunk import decay_grad
from rtkernels.decay import LogDecay
from tolerances import REL_FRO

pytestmark = pytest.mark.gpu

F64 = torch.float64
#: One head per decay: forgets at once, halves, keeps almost everything, keeps everything.
GAMMAS = (1e-6, 0.5, 0.9, 0.99, 0.999999, 1.0)  # 0.9 and 0.99: where a wrong power of gamma shows
NS = (1, 63, 65, 1000)
#: (Dk, Dv): one value tile of 32 columns, a second tile of 8 columns (KMAX 64), 64 x 64, KMAX 128
#: with two tiles, four tiles of 64, KMAX 256 (BV 32) with a partial second tile
SIZES = [(16, 16), (40, 72), (64, 64), (128, 128), (96, 256), (200, 40)]
DTYPES = (torch.bfloat16, torch.float16)
SCALE = 0.8


def _log_decay() -> LogDecay:
    return LogDecay(torch.device("cuda"), host=tuple(math.log(x) for x in GAMMAS))


def _inputs(n: int, dk: int, dv: int, dtype: torch.dtype, positive: bool, seed: int, b: int = 2):
    """``[B, H, N, D]`` q, k, v, dL/do in ``dtype`` on the GPU, fp32 initial state and dL/d(final state);
    ``positive``: uniform [0, 1) values (no term of dlog(gamma) cancels another), else normal."""
    h = len(GAMMAS)
    g = torch.Generator().manual_seed(seed)

    def draw(*shape):
        return torch.rand(shape, generator=g, dtype=F64) if positive else torch.randn(shape, generator=g, dtype=F64)

    q = (draw(b, h, n, dk) / dk ** 0.5).to("cuda", dtype)
    k = (draw(b, h, n, dk) / dk ** 0.5).to("cuda", dtype)
    v = draw(b, h, n, dv).to("cuda", dtype)
    grad = draw(b, h, n, dv).to("cuda", dtype)
    s0 = (draw(b, h, dk, dv) / dk ** 0.5).to("cuda", torch.float32)
    g_state = draw(b, h, dk, dv).to("cuda", torch.float32)
    return q, k, v, grad, s0, g_state


def _want(q, k, v, grad, s0, g_state, gammas=GAMMAS) -> torch.Tensor:
    """dL/dlog(gamma) by autograd through the fp64 reference (L = sum(grad * out) + sum(G * state)),
    one head per gamma of ``gammas``."""
    lg = torch.log(torch.tensor(gammas, dtype=F64, device="cuda")).requires_grad_(True)
    out, state = reference(q, k, v, torch.exp(lg), SCALE, initial_state=s0)
    loss = (out * grad.double()).sum() + ((state * g_state.double()).sum() if g_state is not None else 0)
    return torch.autograd.grad(loss, lg)[0]


def _kernel(q, k, v, grad, s0, g_state) -> torch.Tensor:
    out = decay_grad.kernel_log_decay_grad(q, k, v, _log_decay(), SCALE, s0, grad, g_state)
    assert out.dtype == torch.float32 and out.shape == (len(GAMMAS),) and out.is_cuda
    return out


@pytest.mark.parametrize("few_ctas", [False, True], ids=["wide-tiles", "narrow-tiles"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sizes", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("n", NS)
def test_matches_fp64_autograd(monkeypatch, n, sizes, dtype, few_ctas):
    """With an initial state and a gradient of the final state. Non-negative inputs (no term
    cancels another): every head, gamma = 1e-6 included, within the dtype's relative tolerance
    (an fp32 emulation of the kernel's roundings gives about 1e-4). Normal inputs (the exact sum
    may cancel down to 1e-6 of its terms): each head within the tolerance of its value plus 1e-4 of
    the sum of the terms' magnitudes (the same formula on |inputs|; the emulation gives < 1e-5)."""
    dk, dv = sizes
    # the value tile follows how full the GPU is: both choices, whatever this GPU's SM count
    monkeypatch.setattr(decay_grad, "_sm_count", lambda dev: 1 << 20 if few_ctas else 0)
    for positive in (True, False):
        x = _inputs(n, dk, dv, dtype, positive, 1000 * n + dk)
        got, want = _kernel(*x).double(), _want(*x)
        err = (got - want).abs()
        if positive:
            bound = REL_FRO[dtype] * want.abs()
        else:
            q, k, v, grad, s0, g_state = x
            mag = decay_grad.torch_w_recurrence(q.abs(), k.abs(), v.abs(), torch.log(torch.tensor(GAMMAS, dtype=F64,
                                                device="cuda")), SCALE, s0.abs(), grad.abs(), g_state.abs())
            bound = REL_FRO[dtype] * want.abs() + 1e-4 * mag
        assert torch.isfinite(got).all() and (err <= bound).all(), \
            f"n={n} {sizes} {dtype} positive={positive}: got {got.tolist()}, want {want.tolist()}"


@pytest.mark.parametrize("states", [(False, False), (True, False), (False, True)],
                         ids=lambda s: f"s0={int(s[0])}-G={int(s[1])}")
@pytest.mark.parametrize("n", (64, 200))
def test_without_states(n, states):
    """No initial state and/or no gradient of the final state (null pointers)."""
    q, k, v, grad, s0, g_state = _inputs(n, 24, 48, torch.bfloat16, True, n)
    s0 = s0 if states[0] else None
    g_state = g_state if states[1] else None
    got, want = _kernel(q, k, v, grad, s0, g_state).double(), _want(q, k, v, grad, s0, g_state)
    assert ((got - want).abs() <= REL_FRO[torch.bfloat16] * want.abs()).all(), (got.tolist(), want.tolist())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_transposed_and_unaligned_views(dtype):
    """[B, N, H, D] storage (the bnhd layout's views) gives bit for bit the result of contiguous
    copies (same kernel, other strides); a view whose rows are not 16-byte aligned (the element
    loader) gives bit for bit the cp.async loader's result."""
    q, k, v, grad, s0, g_state = _inputs(300, 40, 72, dtype, False, 7)
    base = _kernel(q, k, v, grad, s0, g_state)
    tq, tk, tv, tg = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v, grad))
    assert tq.stride(1) == q.shape[-1] and not tq.is_contiguous()
    assert torch.equal(_kernel(tq, tk, tv, tg, s0, g_state), base)

    def unaligned(x):  # the same values at an odd element offset
        buf = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)
        y = buf[1:].view(x.shape)
        y.copy_(x)
        return y

    uq, uk, uv, ug = (unaligned(x) for x in (q, k, v, grad))
    assert uq.data_ptr() % 16 != 0
    assert torch.equal(_kernel(uq, uk, uv, ug, s0, g_state), base)
    assert torch.equal(_kernel(uq, k, v, grad, s0, g_state), base)  # one unaligned operand suffices


@pytest.mark.parametrize("which", ("q", "k", "v", "grad"))
def test_nan_reaches_its_head_only(which):
    """A NaN in q, k, v or dL/do of head 1 (in the middle of the second chunk, or for k and v at
    the last token, reached only through a product with weight 0) makes head 1 NaN; the other
    heads keep their values bit for bit."""
    x = list(_inputs(150, 32, 64, torch.bfloat16, False, 3))
    clean = _kernel(*x)
    i = ("q", "k", "v", "grad").index(which)
    x[i] = x[i].clone()
    x[i][1, 1, 149 if which in ("k", "v") else 70, 5] = float("nan")
    got = _kernel(*x)
    assert torch.isnan(got[1]) and torch.equal(torch.cat([got[:1], got[2:]]), torch.cat([clean[:1], clean[2:]]))


def test_deterministic():
    """Two runs give the same bits (fixed-order reductions, no atomics)."""
    x = _inputs(1000, 128, 128, torch.bfloat16, False, 5, b=3)
    assert torch.equal(_kernel(*x), _kernel(*x))


def test_long_sequence_stays_accurate():
    """16k tokens, gamma = 1 included (W grows like N^2): finite and within bf16's tolerance on
    non-negative inputs (against the W recurrence in fp64, which the CPU tests check against
    autograd: the N x N reference would need tens of GB here)."""
    x = _inputs(16384, 64, 64, torch.bfloat16, True, 9, b=1)
    q, k, v, grad, s0, g_state = x
    lg = torch.log(torch.tensor(GAMMAS, dtype=F64, device="cuda"))
    got, want = _kernel(*x).double(), decay_grad.torch_w_recurrence(q, k, v, lg, SCALE, s0, grad, g_state)
    assert torch.isfinite(got).all()
    assert ((got - want).abs() <= REL_FRO[torch.bfloat16] * want.abs()).all(), (got.tolist(), want.tolist())


@pytest.mark.parametrize("form", ("decay", "decay_rate"))
def test_backward_uses_the_kernel(monkeypatch, form):
    """loss.backward() through causal_linear_attention (fp16 on CUDA with Dv = 160, a decay tensor
    that requires grad, the final state in the loss) computes dlog(gamma) with this kernel, never
    the torch formula, and the decay gets the fp64 gradient. (With Dv <= 128 on Hopper, fp16 and
    bf16 sum it in the dq pass instead: test_gpu_dq_pass_dlog.py.)"""
    calls = []

    def torch_formula(*args, **kwargs):
        raise AssertionError("the torch dlog(gamma) formula ran on the kernel path")

    def counted(*args, **kwargs):
        calls.append(1)
        return decay_grad.kernel_log_decay_grad(*args, **kwargs)

    monkeypatch.setattr(kb, "log_decay_grad", torch_formula)
    monkeypatch.setattr(kb, "kernel_log_decay_grad", counted)
    q, k, v, grad, s0, g_state = _inputs(200, 64, 160, torch.float16, True, 1)
    factors = torch.tensor(GAMMAS, dtype=torch.float32, device="cuda")
    d = (factors if form == "decay" else -torch.log(factors)).requires_grad_(True)
    out, state = rtkernels.causal_linear_attention(q, k, v, scale=SCALE, method="chunk", initial_state=s0,
                                                   return_state=True, **{form: d})
    ((out.float() * grad.float()).sum() + (state * g_state).sum()).backward()
    assert calls == [1]
    want = _want(q, k, v, grad, s0, g_state)  # d/dlog(gamma); d/dgamma = that / gamma, d/drate = -that
    want = want / factors.double() if form == "decay" else -want
    assert ((d.grad.double() - want).abs() <= REL_FRO[torch.bfloat16] * want.abs()).all(), (d.grad, want)


@pytest.mark.parametrize("kind", ("factor", "rate"))
@pytest.mark.parametrize("decay_dtype", (torch.float32, torch.float64, torch.bfloat16), ids=str)
def test_sum_kernel_applies_the_chain_rule_of_the_source(kind, decay_dtype):
    """rtk_chunk_decay_grad_sum with a CUDA decay tensor of factors or rates (strided, any float
    dtype) gives what LogDecay.source_grad computes from the plain dlog(gamma) sum: the gradient of
    the caller's tensor, 0 where a rate is clamped, NaN outside the domain."""
    from rtkernels.decay import KIND_FACTOR, KIND_RATE

    if kind == "factor":
        values = [1e-6, 0.5, 0.9, 0.99, 1.5, 1.0]  # 1.5: outside the domain
    else:
        values = [-math.log(x) for x in (1e-6, 0.5, 0.9, 0.99)] + [2e4, -1.0]  # 2e4 clamped, -1 invalid
    raw = torch.tensor([x for x in values for _ in range(2)], dtype=decay_dtype, device="cuda")[::2]
    ld = LogDecay(torch.device("cuda"), raw=raw, kind=KIND_FACTOR if kind == "factor" else KIND_RATE)
    ld.source_kind = ld.kind
    q, k, v, grad, s0, g_state = _inputs(130, 40, 72, torch.bfloat16, False, 7)
    plain = decay_grad.kernel_log_decay_grad(q, k, v, ld, SCALE, s0, grad, g_state)
    got = decay_grad.kernel_log_decay_grad(q, k, v, ld, SCALE, s0, grad, g_state, for_source=True)
    want = ld.source_grad(plain)
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.isnan(got).sum() == 1, (got, want)
    ok = ~torch.isnan(want)
    assert torch.allclose(got[ok], want[ok], rtol=1e-6, atol=0), (got, want)
    if kind == "rate":
        assert got[4] == 0
