"""The float32 dlog(gamma) kernel (marker ``gpu``; cuda_src/chunk/decay_grad_f32.cu through
rtkernels.methods.chunk.decay_grad.kernel_log_decay_grad with float32 views) in both
``fp32_precision`` modes: against autograd through the fp64 reference on odd shapes and every gamma
(0.9 and 0.99, where a wrong power of gamma shows, held to fp32's tolerance in the "exact" mode),
states in and out, large and tiny magnitudes, both loaders and layouts, NaN, determinism, a long
sequence, the backward taking it, no host sync and a CUDA graph of a training step."""

from __future__ import annotations

import math

import pytest
import torch

import rtkernels
import rtkernels.methods.chunk.backward as kb
import fp64_models as fm
from graphs import assert_replays_like_eager
from rtkernels.decay import LogDecay
from rtkernels.methods.chunk import override
from rtkernels.methods.chunk import plan as chunk_plan
from rtkernels.methods.chunk import decay_grad
from test_gpu_decay_grad import _want as _want_of
from tolerances import REL_FRO

pytestmark = pytest.mark.gpu

F64, F32 = torch.float64, torch.float32
GAMMAS = (1e-6, 0.5, 0.9, 0.99, 0.999, 1.0)
SCALE = 0.8
MODES = ("exact", "tf32")
#: Relative to the value: 3xTF32 keeps about 20 bits of every product ("exact": fp32's tolerance);
#: one TF32 product has fp16's 10-bit significand ("tf32": fp16's).
TOL = {"exact": REL_FRO[F32], "tf32": REL_FRO[torch.float16]}
#: Relative to the sum of the terms' magnitudes, for inputs whose terms cancel.
TOL_MAG = {"exact": 2e-6, "tf32": 1e-4}
#: (Dk, Dv): KMAX 64 with one live warp row and a half tile, KMAX 64 with a last tile of 8
#: columns, 64 x 64, KMAX 128 with a partial last tile (64 or 32 wide), KMAX 128 with full tiles,
#: KMAX 256 (one stage) with a partial tile, 256 x 32
SIZES = [(16, 16), (40, 72), (64, 64), (100, 72), (128, 128), (200, 37), (256, 32)]


def _inputs(n: int, dk: int, dv: int, positive: bool, seed: int, b: int = 2, mags=(1.0, 1.0, 1.0, 1.0)):
    """float32 q, k, v, dL/do ``[B, H, N, D]`` times ``mags``, initial state and dL/d(final state);
    ``positive``: uniform [0, 1) values (no term cancels another), else normal."""
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


def _log_decay() -> LogDecay:
    return LogDecay(torch.device("cuda"), host=tuple(math.log(x) for x in GAMMAS))


def _got(mode, q, k, v, grad, s0, g_state) -> torch.Tensor:
    out = decay_grad.kernel_log_decay_grad(q, k, v, _log_decay(), SCALE, s0, grad, g_state, fp32_precision=mode)
    assert out.dtype == F32 and out.shape == (len(GAMMAS),) and out.is_cuda
    return out.double()


def _magnitude(q, k, v, grad, s0, g_state) -> torch.Tensor:
    """The same sum over |inputs|: the scale of its terms, for inputs whose sum may cancel."""
    lg = torch.log(torch.tensor(GAMMAS, dtype=F64, device="cuda"))
    return decay_grad.torch_w_recurrence(q.abs(), k.abs(), v.abs(), lg, SCALE, s0.abs(),
                                         grad.abs(), None if g_state is None else g_state.abs())


def _check(mode, got, want, mag=None, what=""):
    bound = TOL[mode] * want.abs() + (0 if mag is None else TOL_MAG[mode] * mag)
    worst = float(((got - want).abs() / bound).max())
    assert torch.isfinite(got).all() and worst <= 1, \
        f"{mode} {what}: {worst:.3g} tolerances off; got {got.tolist()}, want {want.tolist()}"


@pytest.mark.parametrize("fill", ["wide-tiles", "narrow-tiles", "row-slices"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("sizes", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("n", (1, 63, 64, 65, 1000))
def test_matches_fp64(monkeypatch, n, sizes, mode, fill):
    """Non-negative inputs (no term cancels): every head within the mode's relative tolerance.
    Normal inputs: within that of the value plus a fraction of the terms' magnitudes. Every
    layout the choice by how full the GPU is can take (forced through the SM count the kernel
    sees): 64-wide tiles, 32-wide ones, 32-wide ones with the state's rows in two slices."""
    dk, dv = sizes
    ctas64 = 2 * len(GAMMAS) * -(-dv // 64)  # batch 2
    sms = {"wide-tiles": 0, "narrow-tiles": 2 * ctas64, "row-slices": 1 << 20}[fill]
    monkeypatch.setattr(decay_grad, "_sm_count", lambda dev: sms)
    for positive in (True, False):
        x = _inputs(n, dk, dv, positive, 100 * n + dk)
        _check(mode, _got(mode, *x), _want_of(*x, gammas=GAMMAS), None if positive else _magnitude(*x),
               f"n={n} {sizes} positive={positive}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("sizes", [(128, 128), (200, 37)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_matches_fp64_at_4096_tokens(sizes, mode):
    """64 chunks (the issue's N = 4096), one batch: as test_matches_fp64."""
    dk, dv = sizes
    for positive in (True, False):
        x = _inputs(4096, dk, dv, positive, 4096 + dk, b=1)
        _check(mode, _got(mode, *x), _want_of(*x, gammas=GAMMAS), None if positive else _magnitude(*x),
               f"n=4096 {sizes} positive={positive}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("states", [(False, False), (True, False), (False, True)],
                         ids=lambda s: f"s0={int(s[0])}-G={int(s[1])}")
def test_without_states(mode, states):
    """No initial state and/or no gradient of the final state (null pointers)."""
    q, k, v, grad, s0, g_state = _inputs(130, 24, 48, True, 4)
    s0 = s0 if states[0] else None
    g_state = g_state if states[1] else None
    _check(mode, _got(mode, q, k, v, grad, s0, g_state), _want_of(q, k, v, grad, s0, g_state, gammas=GAMMAS))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("mags", [(1e6, 1e-6, 3e5, 2e-5), (1e-7, 1e-7, 1e-7, 1e-7), (4e4, 4e4, 4e4, 4e4)],
                         ids=("mixed", "tiny", "large"))
def test_magnitudes(mode, mags):
    """Magnitudes far from 1 (beyond fp16's range, or near its subnormals): fp32 operands need no
    scaling."""
    x = _inputs(300, 64, 48, True, 11, mags=mags)
    _check(mode, _got(mode, *x), _want_of(*x, gammas=GAMMAS), what=str(mags))


@pytest.mark.parametrize("mode", MODES)
def test_layouts_and_loaders_give_the_same_bits(mode):
    """[B, N, H, D] storage gives bit for bit the result of contiguous copies (other strides, same
    kernel); views whose rows are not 16-byte aligned (the element loader) give bit for bit the
    cp.async loader's result."""
    q, k, v, grad, s0, g_state = _inputs(300, 40, 72, False, 7)
    base = _got(mode, q, k, v, grad, s0, g_state)
    tq, tk, tv, tg = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v, grad))
    assert not tq.is_contiguous()
    assert torch.equal(_got(mode, tq, tk, tv, tg, s0, g_state), base)

    def unaligned(x):  # the same values at an odd element offset
        buf = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)
        y = buf[1:].view(x.shape)
        y.copy_(x)
        return y

    uq = unaligned(q)
    assert uq.data_ptr() % 16 != 0
    if mode == "tf32" and _wgmma():
        # aligned rows take the wgmma kernel, unaligned ones the mma.sync kernel: the same loader
        # and bits where wgmma is off, the mode's tolerance between the two kernels
        _check(mode, _got(mode, uq, k, v, grad, s0, g_state), base, _magnitude(q, k, v, grad, s0, g_state))
        with override(wgmma=False):
            base = _got(mode, q, k, v, grad, s0, g_state)
    assert torch.equal(_got(mode, uq, k, v, grad, s0, g_state), base)
    assert torch.equal(_got(mode, *(unaligned(x) for x in (q, k, v, grad)), s0, g_state), base)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("which", ("q", "k", "v", "grad", "inf", "q-", "k-", "v-", "grad-"))
def test_nan_reaches_its_head_only(mode, which):
    """A NaN in q, k, v or dL/do of head 1 (for k and v at the last token, reached only through a
    product with weight 0) makes head 1 NaN, an Inf in its q non-finite; the other heads keep
    their bits. ``x-``: the NaN is 0xFFFFFFFF (sign and every payload bit set), which a TF32
    rounding by an integer add of half an ulp would turn into +0."""
    x = list(_inputs(150, 32, 64, False, 3))
    clean = _got(mode, *x)
    name = which.rstrip("-")
    i = ("q", "k", "v", "grad", "inf").index(name) % 4
    x[i] = x[i].clone()
    at = (1, 1, 149 if name in ("k", "v") else 70, 5)
    if which.endswith("-"):
        x[i].view(torch.int32)[at] = -1
    else:
        x[i][at] = float("inf") if which == "inf" else float("nan")
    got = _got(mode, *x)
    others = torch.tensor([h != 1 for h in range(len(GAMMAS))], device="cuda")
    assert (not torch.isfinite(got[1])) if which == "inf" else torch.isnan(got[1])
    assert torch.equal(got[others], clean[others])


def _wgmma() -> bool:
    """Whether this GPU runs the "tf32" mode's wgmma kernel (rtk_chunk_decay_grad_tf32)."""
    return chunk_plan._wgmma_ok(torch.cuda.current_device(), chunk_plan.current_overrides())


@pytest.mark.parametrize("kernel", ["wgmma", "mma.sync"])
@pytest.mark.parametrize("sizes", [(40, 72), (64, 200), (128, 128), (100, 37)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("n", (65, 1000))
def test_tf32_mode_both_kernels(n, sizes, kernel):
    """The "tf32" mode with aligned rows and Dk <= 128: on Hopper the wgmma kernel (KMAX 64 with 128
    value columns a CTA, KMAX 128 with 64; partial tiles) and, with wgmma off, the mma.sync kernel
    that other GPUs run; both against fp64, non-negative and normal inputs, states in and out."""
    if kernel == "wgmma" and not _wgmma():
        pytest.skip("the wgmma kernel needs compute capability 9.0")
    dk, dv = sizes
    with override(wgmma=kernel == "wgmma"):
        for positive in (True, False):
            x = _inputs(n, dk, dv, positive, 7 * n + dk)
            _check("tf32", _got("tf32", *x), _want_of(*x, gammas=GAMMAS), None if positive else _magnitude(*x),
                   f"{kernel} n={n} {sizes} positive={positive}")


#: Split against one walk of the same kernel: the chunks' TF32 products are the same, so only the
#: fp32 rounding of the carries differs (relative to the value, plus the terms' magnitude).
SPLIT_TOL = 2e-5


@pytest.mark.parametrize("sizes", [(128, 128), (40, 72), (100, 37)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("n,segments", [(65, 2), (1000, 3), (4096, 2), (4100, 5)])
def test_tf32_wgmma_split_segments(n, segments, sizes):
    """The wgmma kernel with the sequence split (forced segments; the last one shorter, down to one
    token): its states pass leaves each segment its own S and W and the walk folds them. Against
    fp64 with states in and out, and against the unsplit walk within fp32 rounding, which a fold
    carrying S and W by gamma^(L+1) would exceed (with three segments or more: shown on the fp64
    model of that slip, non-negative inputs)."""
    if not _wgmma():
        pytest.skip("the wgmma kernel needs compute capability 9.0")
    dk, dv = sizes
    seg_len = fm.segment_length(n, segments)
    for positive in (True, False):
        x = _inputs(n, dk, dv, positive, 13 * n + dk)
        with override(segments=segments):
            got = _got("tf32", *x)
        one = _got("tf32", *x)
        mag = None if positive else _magnitude(*x)
        what = f"split {segments} n={n} {sizes} positive={positive}"
        _check("tf32", got, _want_of(*x, gammas=GAMMAS), mag, what)
        bound = SPLIT_TOL * (one.abs() + (0 if mag is None else mag))
        worst = float(((got - one).abs() / bound).max())
        assert worst <= 1, f"{what}: {worst:.3g} tolerances from the unsplit walk"
        if positive and -(-n // seg_len) >= 3:
            q, k, v, grad = (t.double() for t in x[:4])
            lg = torch.tensor(GAMMAS, dtype=F64, device="cuda")
            right = fm.masked_log_decay_grad(q, k, v, grad, lg, SCALE)
            wrong = fm.masked_log_decay_grad(q, k, v, grad, lg, SCALE, fm.segment_carry(n, seg_len)[0])
            caught = float(((wrong - right).abs() / bound).max())  # the slip's effect without the states
            assert caught >= 2, f"{what}: a wrong fold carry would be only {caught:.3g} tolerances off"


@pytest.mark.parametrize("which", ("k", "grad"))
def test_tf32_wgmma_split_nan_reaches_later_segments(which):
    """With the sequence split, a NaN in k or dL/do of head 1 (in segment 0, whose S and W the
    later segments fold) makes head 1 NaN; the other heads keep the bits they have without it."""
    if not _wgmma():
        pytest.skip("the wgmma kernel needs compute capability 9.0")
    x = list(_inputs(700, 64, 64, False, 8))
    with override(segments=3):
        clean = _got("tf32", *x)
        i = ("q", "k", "v", "grad").index(which)
        x[i] = x[i].clone()
        x[i][1, 1, 10, 3] = float("nan")
        got = _got("tf32", *x)
    others = torch.tensor([h != 1 for h in range(len(GAMMAS))], device="cuda")
    assert torch.isnan(got[1]) and torch.equal(got[others], clean[others])


def test_tf32_name_is_the_tf32_mode():
    """kernel_log_decay_grad_tf32 (session 18's name) is the float32 kernel in the "tf32" mode."""
    x = _inputs(100, 32, 40, False, 2)
    ld = _log_decay()
    want = decay_grad.kernel_log_decay_grad(*x[:3], ld, SCALE, x[4], x[3], x[5], fp32_precision="tf32")
    assert torch.equal(decay_grad.kernel_log_decay_grad_tf32(*x[:3], ld, SCALE, x[4], x[3], x[5]), want)


@pytest.mark.parametrize("mode", MODES)
def test_deterministic(mode):
    """Two runs give the same bits (fixed-order reductions, no atomics)."""
    x = _inputs(1000, 128, 128, False, 5, b=3)
    assert torch.equal(_got(mode, *x), _got(mode, *x))


def test_long_sequence_stays_accurate():
    """16k tokens, gamma = 1 included (W grows like N^2): within fp32's tolerance on non-negative
    inputs in the "exact" mode (against the W recurrence in fp64, which the CPU tests check
    against autograd: the N x N reference would need tens of GB here)."""
    x = _inputs(16384, 64, 64, True, 9, b=1)
    q, k, v, grad, s0, g_state = x
    lg = torch.log(torch.tensor(GAMMAS, dtype=F64, device="cuda"))
    want = decay_grad.torch_w_recurrence(q, k, v, lg, SCALE, s0, grad, g_state)
    _check("exact", _got("exact", *x), want, what="N=16384")


@pytest.mark.parametrize("mode", MODES)
def test_backward_takes_the_kernel(monkeypatch, mode):
    """loss.backward() with float32 inputs, a trainable decay and the final state in the loss
    computes dlog(gamma) with the float32 kernel in the forward's mode (once), never the torch
    formula, and the decay gets the fp64 gradient."""
    calls = []

    def torch_formula(*args, **kwargs):
        raise AssertionError("the torch dlog(gamma) formula ran on the kernel path")

    def counted(*args, **kwargs):
        calls.append(kwargs.get("fp32_precision"))
        return decay_grad.kernel_log_decay_grad(*args, **kwargs)

    monkeypatch.setattr(kb, "log_decay_grad", torch_formula)
    monkeypatch.setattr(kb, "kernel_log_decay_grad", counted)
    q, k, v, grad, s0, g_state = _inputs(200, 64, 96, True, 1)
    factors = torch.nn.Parameter(torch.tensor(GAMMAS, dtype=F32, device="cuda"))
    out, state = rtkernels.causal_linear_attention(q, k, v, factors, scale=SCALE, method="chunk", initial_state=s0,
                                                   return_state=True, fp32_precision=mode)
    ((out * grad).sum() + (state * g_state).sum()).backward()
    assert calls == [mode]
    want = _want_of(q, k, v, grad, s0, g_state, gammas=GAMMAS) / factors.detach().double()
    _check(mode, factors.grad.double(), want, what="backward")


@pytest.mark.parametrize("mode", MODES)
def test_training_step_has_no_host_sync_and_replays_in_a_cuda_graph(mode):
    """A float32 training step with a trainable decay: no host sync once planned, and forward plus
    backward captured in a CUDA graph replay equal to eager on new values."""
    q, k, v, grad, _, _ = _inputs(500, 128, 128, True, 5)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    factors = torch.tensor(GAMMAS, dtype=F32, device="cuda", requires_grad=True)

    def step():
        out = rtkernels.causal_linear_attention(*leaves, factors, scale=SCALE, method="chunk", fp32_precision=mode)
        return torch.autograd.grad((out * grad).sum(), (*leaves, factors))

    def change():
        for x in leaves:
            x.mul_(0.5)
        factors.copy_(torch.tensor([0.3, 0.6, 0.95, 0.999, 0.9999, 1.0]))

    eager = assert_replays_like_eager(step, change)
    assert torch.isfinite(eager[3]).all()
