"""dlog(gamma) summed inside the backward's dq pass (marker ``gpu``; the DLOG instance of
cuda_src/chunk/fwd16.cu, bf16 and fp16 on a GPU that runs the wgmma kernel): against autograd
through the fp64 reference on odd shapes, gamma from 1e-6 to 1 (0.9 and 0.99 in fp16 too, where a
wrong power of gamma shows); dq, dk, dv as the plain passes give them; strides, determinism, NaN,
and a training step reaching it."""

from __future__ import annotations

import math

import pytest
import torch

import rtkernels
import rtkernels.methods.chunk.backward as kb
from rtkernels.decay import LogDecay
from graphs import assert_training_step_replays
from rtkernels.methods.chunk import decay_grad, plan
from test_gpu_decay_grad import F64, GAMMAS, SCALE, _inputs, _log_decay, _want
from tolerances import REL_FRO

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16
#: fp16 carries W scaled by a power of two and scales its W copy as its S copy (fwd16.cu's header)
DTYPES = (torch.bfloat16, torch.float16)
NS = (1, 63, 64, 65, 1000, 4096)
#: (Dk, Dv): partial value tiles (16, 40, 112, 200 columns of Dk in tiles of 64), KMAX 64 and 128
#: (Dv 96: rows of S past Dv), Dk != Dv
SIZES = [(16, 16), (40, 72), (64, 64), (128, 128), (200, 40), (256, 128), (112, 96)]


@pytest.fixture(autouse=True)
def _needs_wgmma():
    if not plan._wgmma_ok(torch.cuda.current_device(), plan.current_overrides()):
        pytest.skip("the dq pass sums dlog(gamma) on the wgmma kernel only (compute capability 9.0)")


def _refuse(*args, **kwargs):
    raise AssertionError("the separate dlog(gamma) kernel ran")


def _grads(q, k, v, grad, s0, monkeypatch=None, fused=True, g_state=None):
    """kernel_backward's (dq, dk, dv, dlog gamma), ``g_state`` the final state's gradient; ``fused``:
    the dq pass must sum dlog(gamma) (the separate kernel raises), else the separate kernel must.
    Plans are cleared first: a planned backward would repeat the passes of an earlier call of the
    same shapes whatever is patched."""
    kb.clear_plans()
    if monkeypatch is not None:
        if fused:
            monkeypatch.setattr(kb, "kernel_log_decay_grad", _refuse)
        else:
            monkeypatch.setattr(kb, "dq_pass_sums", lambda *a: False)
    g = kb.kernel_backward(q, k, v, _log_decay(), SCALE, s0, grad, g_state, False, True)
    return g.q, g.k, g.v, g.log_decay


def _bound(x, want, positive, g_state=None):
    q, k, v, grad, s0 = x
    if positive:
        return REL_FRO[q.dtype] * want.abs()
    lg = torch.log(torch.tensor(GAMMAS, dtype=F64, device="cuda"))
    mag = decay_grad.torch_w_recurrence(q.abs(), k.abs(), v.abs(), lg, SCALE, None if s0 is None else s0.abs(),
                                        grad.abs(), None if g_state is None else g_state.abs())
    return REL_FRO[q.dtype] * want.abs() + 1e-4 * mag


def _check(monkeypatch, x, positive, what, segments=None, g_state=None):
    """The fused dq pass against fp64 autograd (within ``_bound``) and against the plain passes:
    dk and dv bit for bit (the same kernels), dq to 16-bit rounding; ``segments``: both split so
    (and the partial sums one row of CTAs per segment); ``g_state``: a final-state gradient."""
    q, k, v, grad, s0 = x
    with plan.override(segments=segments):
        if segments is not None:
            assert decay_grad.dq_pass_partials(q, v).shape[0] == plan.split(q.shape[2], segments)[1] * q.shape[0]
        with monkeypatch.context() as m:
            dq, dk_, dv_, got = _grads(q, k, v, grad, s0, m, fused=True, g_state=g_state)
        with monkeypatch.context() as m:
            pq, pk, pv, _ = _grads(q, k, v, grad, s0, m, fused=False, g_state=g_state)
    want = _want(q, k, v, grad, s0, g_state)
    err = (got.double() - want).abs()
    assert torch.isfinite(got).all() and (err <= _bound(x, want, positive, g_state)).all(), \
        f"{what} positive={positive}: got {got.tolist()}, want {want.tolist()}"
    assert torch.equal(dk_, pk) and torch.equal(dv_, pv)
    scale = pq.float().abs().max().clamp(min=1e-30)
    assert ((dq.float() - pq.float()).abs().max() / scale) <= 2 ** -7, "dq differs from the plain pass"


@pytest.mark.parametrize("with_s0", [True, False], ids=["s0", "no-s0"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sizes", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("n", NS)
def test_matches_fp64_autograd(monkeypatch, n, sizes, dtype, with_s0):
    """Non-negative inputs (no term cancels): every head within the dtype's relative tolerance,
    gamma = 1e-6 .. 1 (0.9 and 0.99 included); normal inputs: within it plus 1e-4 of the terms'
    magnitudes (as the separate kernel's test). dq, dk, dv agree with the plain passes' to 16-bit
    rounding."""
    dk, dv = sizes
    for positive in (True, False):
        q, k, v, grad, s0, _ = _inputs(n, dk, dv, dtype, positive, 1000 * n + dk + dv, b=2 if n < 4096 else 1)
        _check(monkeypatch, (q, k, v, grad, s0 if with_s0 else None), positive, f"n={n} {sizes} {dtype}")


@pytest.mark.parametrize("with_s0", [True, False], ids=["s0", "no-s0"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n, sizes, segments", [(65, (40, 72), 2), (1000, (128, 128), 3), (1000, (200, 40), 7),
                                                (4096, (256, 128), 5), (777, (64, 64), 4), (4096, (128, 128), 2),
                                                (3000, (40, 72), 2)], ids=str)
def test_split_sequence(monkeypatch, n, sizes, segments, dtype, with_s0):
    """The dq pass split into segments (the states pass carrying W beside S, each segment's CTAs
    folding both; with 2 segments of 2048 and 1536 tokens, over 4 slots of 512 and 6 of 256 tokens
    per segment on an H100): as test_matches_fp64_autograd, against the plain passes split the
    same way."""
    dk, dv = sizes
    for positive in (True, False):
        q, k, v, grad, s0, _ = _inputs(n, dk, dv, dtype, positive, 7 * n + dk + segments, b=2)
        _check(monkeypatch, (q, k, v, grad, s0 if with_s0 else None), positive,
               f"n={n} {sizes} {dtype} segments={segments}", segments)


@pytest.mark.parametrize("with_s0", [True, False], ids=["s0", "no-s0"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n, sizes, segments", [(1, (64, 64), None), (65, (40, 72), None), (1000, (128, 128), None),
                                                (4096, (200, 40), None), (3000, (64, 64), 3), (4096, (128, 128), 2)],
                         ids=str)
def test_final_state_gradient(monkeypatch, n, sizes, segments, dtype, with_s0):
    """A gradient G of the final state: the CTA that ends the sequence (split: of the last segment)
    adds <G, W_end> over its tile. Against fp64 autograd of sum(grad * out) + sum(G * state), and
    the plain passes with the separate kernel, as test_matches_fp64_autograd."""
    dk, dv = sizes
    for positive in (True, False):
        q, k, v, grad, s0, g_state = _inputs(n, dk, dv, dtype, positive, 11 * n + dk, b=2 if n < 4096 else 1)
        _check(monkeypatch, (q, k, v, grad, s0 if with_s0 else None), positive,
               f"n={n} {sizes} {dtype} segments={segments} with G", segments, g_state)


@pytest.mark.parametrize("with_g", [False, True], ids=["no-G", "G"])
@pytest.mark.parametrize("sizes", [(128, 128), (112, 96), (72, 40)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("n", NS)
def test_wide_z_pass(monkeypatch, n, sizes, with_g):
    """The Z split's dq pass with 128-wide value tiles (DLOG 3, bf16: Z only as its 16-bit copy,
    which the output warps step in place), forced on these few CTAs (the split needs the fused dk/dv
    pass and one segment): as test_matches_fp64_autograd without an initial state, with and without
    a final-state gradient."""
    dk, dv = sizes
    for positive in (True, False):
        q, k, v, grad, _, g_state = _inputs(n, dk, dv, BF16, positive, 13 * n + dk + dv, b=2 if n < 4096 else 1)
        with plan.override(dlog_split=True, dlog_wide=True, fused_dk_dv=True, segments=1):
            assert decay_grad.z_split_applies(q, k, v, grad) is not None
            launch = plan.dlog_launch(BF16, dv, dk, q.shape[0] * q.shape[1], n, q.device.index, plan.current_overrides(),
                                      True)
            assert launch.bv == 128 and launch.name.endswith(", 3>")
            _check(monkeypatch, (q, k, v, grad, None), positive, f"wide n={n} {sizes}", 1, g_state if with_g else None)


@pytest.mark.parametrize("with_g", [False, True], ids=["no-G", "G"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sizes", [(128, 128), (40, 72)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("n", (1, 65, 1000))
def test_narrow_z_pass(monkeypatch, n, sizes, dtype, with_g):
    """The Z split with its 64-wide dq pass (DLOG 2; the plan takes it only when forced by
    ``Overrides.dlog_split``), bf16 and fp16: as test_wide_z_pass."""
    dk, dv = sizes
    for positive in (True, False):
        q, k, v, grad, _, g_state = _inputs(n, dk, dv, dtype, positive, 17 * n + dk + dv)
        with plan.override(dlog_split=True, dlog_wide=False, fused_dk_dv=True, segments=1):
            assert decay_grad.z_split_applies(q, k, v, grad) is not None
            _check(monkeypatch, (q, k, v, grad, None), positive, f"narrow n={n} {sizes} {dtype}", 1,
                   g_state if with_g else None)


@pytest.mark.parametrize("tma_io", [True, False], ids=["tensor-copies", "cp-async"])
def test_mid_plan_by_default_is_sync_free_and_replays_in_a_cuda_graph(tma_io):
    """At the bench's mid shape (4 x 32 x 4096 x 128, bf16: 2 B H > SMs) the plan takes, unforced,
    W's dq pass by tensor copies, or without them the Z split with its 128-wide dq pass; a training
    step with a trainable CUDA decay then makes no host sync, and forward plus backward captured in
    a CUDA graph replay equal to eager."""
    b, h, n, d = 4, 32, 4096, 128

    def takes_the_planned_pass(q, k, v, grad):
        if tma_io:
            assert decay_grad.z_split_applies(q, k, v, grad) is None
            launch = plan.dlog_launch(BF16, d, d, b * h, n, q.device.index, plan.current_overrides())
            assert plan.tma_variant(launch.name) is not None
            return
        assert decay_grad.z_split_applies(q, k, v, grad) is not None
        launch = plan.dlog_launch(BF16, d, d, b * h, n, q.device.index, plan.current_overrides(), True)
        assert launch.bv == 128 and launch.name.endswith(", 3>")

    decay = (1 - torch.exp(torch.linspace(-3.5, -6.2, h, device="cuda"))).requires_grad_()
    with plan.override(tma_io=tma_io):
        eager = assert_training_step_replays((b, h, n, d), 8, decay,
                                             1 - torch.exp(torch.linspace(-2.5, -7.0, h, device="cuda")),
                                             takes_the_planned_pass)
    assert all(bool(torch.isfinite(g).all()) for g in eager)


def test_long_sequence_splits_by_default():
    """Few (batch, head, tile) CTAs over a long sequence: the heuristic splits the pass (one CTA per
    SM), as it does the forward."""
    dev = torch.cuda.current_device()
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    launch = plan.dlog_launch(BF16, 128, 128, 2, 16384, dev)
    assert launch.segments == plan.split(16384, plan.segments_for(4, 16384, sms, 1))[1] > 1


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bnhd_strides_and_determinism(monkeypatch, dtype):
    """[B, N, H, D] storage gives the bits of contiguous copies; two runs give the same bits."""
    q, k, v, grad, s0, _ = _inputs(300, 64, 128, dtype, False, 11)
    base = _grads(q, k, v, grad, s0, monkeypatch)
    tq, tk, tv, tg = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v, grad))
    again = _grads(tq, tk, tv, tg, s0, monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(base, again))
    assert torch.equal(_grads(q, k, v, grad, s0, monkeypatch)[3], base[3])


def test_falls_back_where_it_cannot():
    """float32, unaligned rows, q and k with different strides or Dv > 128: the separate kernel (a
    gradient of the final state is no obstacle; fp16 sums in the pass as bf16 does)."""
    q, k, v, grad, s0, g_state = _inputs(100, 64, 64, BF16, False, 2)
    assert decay_grad.dq_pass_sums(q, k, v, grad, None)
    assert decay_grad.dq_pass_sums(q, k, v, grad, g_state)
    assert decay_grad.dq_pass_sums(*(x.half() for x in (q, k, v, grad)), None)
    assert not decay_grad.dq_pass_sums(*(x.float() for x in (q, k, v, grad)), None)
    assert not decay_grad.dq_pass_sums(q, k.transpose(1, 2).contiguous().transpose(1, 2), v, grad, None)
    wide = torch.zeros(2, len(GAMMAS), 100, 256, dtype=BF16, device="cuda")
    assert not decay_grad.dq_pass_sums(q, k, wide, wide, None)
    buf = torch.empty(q.numel() + 1, dtype=BF16, device="cuda")
    assert not decay_grad.dq_pass_sums(buf[1:].view(q.shape), k, v, grad, None)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("which", ("q", "k", "v", "grad"))
def test_nan_reaches_its_head_only(monkeypatch, which, dtype):
    """A NaN in q, k, v or dL/do of head 1 makes its dlog(gamma) NaN; the other heads keep their
    values bit for bit (fp16: the copies' scaling is per CTA, so a NaN moves no other head's)."""
    x = list(_inputs(150, 32, 64, dtype, False, 3))[:5]
    clean = _grads(*x, monkeypatch)[3]
    i = ("q", "k", "v", "grad").index(which)
    x[i] = x[i].clone()
    x[i][1, 1, 149 if which in ("k", "v") else 70, 5] = float("nan")
    got = _grads(*x, monkeypatch)[3]
    assert torch.isnan(got[1]) and torch.equal(torch.cat([got[:1], got[2:]]), torch.cat([clean[:1], clean[2:]]))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_training_step(monkeypatch, dtype):
    """loss.backward() with a trainable decay (an nn.Parameter of factors) runs the fused pass and
    gives the fp64 gradient of the factors, under sync-debug mode "error"."""
    monkeypatch.setattr(kb, "kernel_log_decay_grad", _refuse)
    q, k, v, grad, _, _ = _inputs(700, 128, 128, dtype, True, 4)
    factors = torch.nn.Parameter(torch.tensor(GAMMAS, dtype=torch.float32, device="cuda"))
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = rtkernels.causal_linear_attention(q, k, v, factors, scale=SCALE, method="chunk")
        (out.float() * grad.float()).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    want = _want(q, k, v, grad, None, None) / factors.detach().double()
    assert ((factors.grad.double() - want).abs() <= REL_FRO[dtype] * want.abs()).all(), (factors.grad, want)


@pytest.mark.parametrize("segments", [None, 3], ids=["one-pass", "split"])
def test_fp16_range(monkeypatch, segments):
    """fp16's scaled W: heads with gamma = 5e-38 (its scale dn is 2^123: a weight formed as
    (len-1-s) dn gamma^(len-1-s) overflowed), 1e-30, 1e-12, 1e-6 (W's leading chunk weight is
    gamma, zero or a subnormal in fp16 unscaled), 0.5, 0.999 and 1, values of v up to 2000 (the pass's
    keys: weighted by up to 63 unscaled, they would overflow fp16) over 4096 tokens: every head
    finite and within fp16's relative tolerance of the fp64 gradient (non-negative inputs: no term
    cancels)."""
    gammas = (5e-38, 1e-30, 1e-12, 1e-6, 0.5, 0.999, 1.0)
    g = torch.Generator().manual_seed(5)
    b, h, n, d = 1, len(gammas), 4096, 64

    def draw(top):
        return (torch.rand(b, h, n, d, generator=g, dtype=F64) * top).to("cuda", torch.float16)

    q, k, v, grad = draw(0.125), draw(0.125), draw(2000.0), draw(1.0)
    log_decay = LogDecay(torch.device("cuda"), host=tuple(math.log(x) for x in gammas))
    monkeypatch.setattr(kb, "kernel_log_decay_grad", _refuse)
    kb.clear_plans()
    with plan.override(segments=segments):
        got = kb.kernel_backward(q, k, v, log_decay, SCALE, None, grad, None, False, True).log_decay.double()
    want = _want(q, k, v, grad, None, None, gammas)
    assert torch.isfinite(got).all() and ((got - want).abs() <= REL_FRO[torch.float16] * want.abs()).all(), \
        (got.tolist(), want.tolist())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("form, n, sizes, segments", [
    ("w", 1000, (128, 128), 3), ("w", 65, (40, 72), None), ("narrow-z", 65, (128, 128), 1),
    ("narrow-z", 1000, (40, 72), 1), ("wide-z", 1, (128, 128), 1), ("wide-z", 65, (112, 96), 1),
    ("wide-z", 4096, (128, 128), 1)], ids=str)
def test_tma_instance_equals_cp_async(monkeypatch, form, n, sizes, segments, dtype):
    """The dq pass that sums dlog(gamma), W form (split or not) and Z split at both widths, takes its
    TMA twin (tiles and x by tensor copies, dq rows by tensor stores; a Z walk's short first chunk
    zeroed after its copy and stored by rows) and gives the cp.async instance's bits: dq, dk, dv and
    dlog(gamma)."""
    from rtkernels.methods.chunk import launch

    if form == "wide-z" and dtype != BF16:
        pytest.skip("the 128-wide Z pass is bf16 only")
    dk, dv = sizes
    q, k, v, grad, s0, _ = _inputs(n, dk, dv, dtype, False, 19 * n + dk + dv, b=2 if n < 4096 else 1)
    chosen = []
    real = launch.tma_variant
    monkeypatch.setattr(launch, "tma_variant", lambda name: chosen.append((name, real(name))) or real(name))
    forced = {"w": dict(dlog_split=False), "narrow-z": dict(dlog_split=True, dlog_wide=False, fused_dk_dv=True),
              "wide-z": dict(dlog_split=True, dlog_wide=True, fused_dk_dv=True)}[form]
    got = {}
    for tma in (True, False):
        with plan.override(segments=segments, tma_io=tma, **forced), monkeypatch.context() as m:
            got[tma] = _grads(q, k, v, grad, None if form != "w" else s0, m, fused=True)
    dlog_names = [(nm, tw) for nm, tw in chosen if nm.count(",") == 6]  # the dq pass's own instance
    assert dlog_names and all(tw is not None for _, tw in dlog_names), chosen
    for a, b, what in zip(got[True], got[False], ("dq", "dk", "dv", "dlog gamma")):
        assert torch.equal(a, b), what
