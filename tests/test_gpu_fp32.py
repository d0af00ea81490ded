"""The fp32 chunk kernel (``rtk_chunk_fwd_f32``) in both modes against the fp64 reference
(marker ``gpu``).

Tolerances (relative Frobenius error ||out - ref|| / ||ref||, and max |out - ref| / max |ref|):

* ``"exact"`` (3xTF32): each product keeps about 20 bits of its operands (x = hi + lo, hi truncated
  to 11 bits, lo read by the tensor cores to 11; the lo*lo' term, < 2^-20 relative, is dropped)
  and is accumulated in fp32, so the result has
  about fp32 accuracy: the requirement is a relative error <= 1e-5 (and 1e-4 of max |ref|), flat,
  up to N = 4096.
* ``"tf32"``: every operand is rounded to TF32 (10 explicit mantissa bits, round to nearest:
  relative error <= u = 2^-11 ~ 4.9e-4). An output passes through two rounded products (q k^T,
  then P v, with P rounded again; or q S with S rounded), so its expected relative error is about
  2u ~ 1e-3 at most, and less because the errors are independent and partly cancel. The bound
  2e-3 is twice that estimate; the max error is allowed 1e-2 of max |ref|. On Hopper the wgmma
  kernel (``rtk_chunk_fwd_tf32``) reads q and k unrounded, so the tensor cores truncate them (relative
  error <= 2u each): 6.4e-4 at (4, 32, 4096, 128) against 4.2e-4, inside the same bound.
"""

import functools

import pytest
import torch

from inputs import force_chunk

import rtkernels
from rtkernels.methods import METHODS, auto_method

from reference import nan_reach, reference

pytestmark = pytest.mark.gpu

MODES = ("exact", "tf32")
TOL = {"exact": (1e-5, 1e-4), "tf32": (2e-3, 1e-2)}  # (relative Frobenius, max relative to max |ref|)
GAMMAS = (1e-6, 0.5, 0.999999, 1.0)
SHAPES = [  # (B, H, N, Dk, Dv): every N of {1, 63, 65, 1000}, every D of {16, 40, 64, 96, 128, 256}
    (2, 3, 1, 16, 40), (1, 2, 63, 40, 16), (2, 2, 65, 64, 96), (1, 2, 1000, 96, 128),
    (1, 2, 1000, 128, 64), (1, 1, 65, 256, 40), (1, 2, 1000, 16, 256),
    (1, 2, 130, 37, 45),  # rows of 37 and 45 floats: not 16-byte aligned, the scalar load path
]


def _inputs(b, h, n, dk, dv, seed=0, device="cuda"):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(b, h, n, dk, generator=g) / dk ** 0.5
    k = torch.randn(b, h, n, dk, generator=g) / dk ** 0.5
    v = torch.randn(b, h, n, dv, generator=g)
    return q.to(device), k.to(device), v.to(device)


def _heads(gamma, h):
    t = torch.full((h,), gamma, dtype=torch.float64)
    if 1e-6 < gamma < 0.99:  # per-head factors around gamma
        t = t * torch.linspace(0.8, 1.0, h, dtype=torch.float64)
    return t


def _errors(out, ref):
    o, r = out.double(), ref.double()
    return ((o - r).norm() / r.norm()).item(), ((o - r).abs().max() / r.abs().max()).item()


def _check(out, ref, mode, what):
    assert out.dtype == torch.float32 and out.shape == ref.shape, what
    assert torch.isfinite(out).all(), f"{what}: non-finite output"
    fro, mx = _errors(out, ref)
    tol_fro, tol_max = TOL[mode]
    assert fro <= tol_fro, f"{what}: relative error {fro:.3g} > {tol_fro:g}"
    assert mx <= tol_max, f"{what}: max error {mx:.3g} of max|ref| > {tol_max:g}"


@functools.lru_cache(maxsize=64)
def _case(shape, gamma):
    b, h, n, dk, dv = shape
    q, k, v = _inputs(b, h, n, dk, dv)
    decay = _heads(gamma, h)
    return q, k, v, decay, reference(q, k, v, decay)[0]


def test_fp32_runs_the_kernel_and_auto_picks_it():
    q, k, v = _inputs(1, 2, 10, 64, 64)
    assert METHODS["chunk"].uses_kernel(q, v)
    assert auto_method(q, v) == "chunk"
    assert not METHODS["chunk"].uses_kernel(q.double(), v.double())  # fp64: the torch path


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fp32_matches_fp64(shape, mode, monkeypatch):
    n = shape[2]
    for gamma in GAMMAS:
        q, k, v, decay, ref = _case(shape, gamma)
        for segments in (None, 3):  # the heuristic (one pass here) and the split-sequence strategy
            force_chunk(monkeypatch, segments=segments)
            for layout in ("bhnd", "bnhd"):
                qi, ki, vi, r = (q, k, v, ref) if layout == "bhnd" else \
                    (x.transpose(1, 2).contiguous() for x in (q, k, v, ref))
                out = rtkernels.causal_linear_attention(qi, ki, vi, decay.cuda(), method="chunk", layout=layout,
                                                        fp32_precision=mode)
                assert out.is_contiguous()
                _check(out, r, mode, f"{shape} {mode} gamma={gamma} segments={segments} {layout} n={n}")


@pytest.mark.parametrize("mode", MODES)
def test_fp32_large(mode):
    """The benchmark shape (4, 32, 4096, 128); the reference is built one batch at a time."""
    b, h, n, d = 4, 32, 4096, 128
    q, k, v = _inputs(b, h, n, d, d, seed=1)
    decay = 1 - torch.exp(torch.linspace(-3.5, -6.2, h, dtype=torch.float64))  # RetNet-like, per head
    out = rtkernels.causal_linear_attention(q, k, v, decay, method="chunk", fp32_precision=mode)
    ref = torch.cat([reference(q[i:i + 1], k[i:i + 1], v[i:i + 1], decay)[0] for i in range(b)])
    _check(out, ref, mode, f"(4, 32, 4096, 128) {mode}")
    out1 = rtkernels.causal_linear_attention(q, k, v, 1.0, method="chunk", fp32_precision=mode)
    ref1 = torch.cat([reference(q[i:i + 1], k[i:i + 1], v[i:i + 1], torch.ones(h, dtype=torch.float64))[0]
                      for i in range(b)])
    _check(out1, ref1, mode, f"(4, 32, 4096, 128) {mode} gamma=1")


@pytest.mark.parametrize("segments", [None, 4])
@pytest.mark.parametrize("mode", MODES)
def test_fp32_state_in_and_out(mode, segments, monkeypatch):
    force_chunk(monkeypatch, segments=segments)
    b, h, n, dk, dv = 2, 3, 777, 48, 80
    q, k, v = _inputs(b, h, n, dk, dv, seed=2)
    rate = torch.tensor([0.0, 0.01, 2.0])
    s0 = torch.randn(b, h, dk, dv, device="cuda")
    out, state = rtkernels.causal_linear_attention(q, k, v, decay_rate=rate, scale=0.37, method="chunk",
                                                   initial_state=s0, return_state=True, fp32_precision=mode)
    assert state.dtype == torch.float32 and state.shape == (b, h, dk, dv)
    ref, ref_state = reference(q, k, v, torch.exp(-rate.double()), scale=0.37, initial_state=s0)
    _check(out, ref, mode, "output")
    _check(state, ref_state, mode, "state")
    # two pieces (the cut inside a chunk), the state handed over
    o1, s1 = rtkernels.causal_linear_attention(q[:, :, :300], k[:, :, :300], v[:, :, :300], decay_rate=rate,
                                               scale=0.37, method="chunk", initial_state=s0, return_state=True,
                                               fp32_precision=mode)
    o2, s2 = rtkernels.causal_linear_attention(q[:, :, 300:], k[:, :, 300:], v[:, :, 300:], decay_rate=rate,
                                               scale=0.37, method="chunk", initial_state=s1, return_state=True,
                                               fp32_precision=mode)
    _check(torch.cat([o1, o2], 2), ref, mode, "two pieces")
    _check(s2, ref_state, mode, "two-piece state")


@pytest.mark.parametrize("reverse", [False, True], ids=("forward", "reversed"))
@pytest.mark.parametrize("shape", [(1, 2, 1000, 128, 128), (2, 3, 777, 48, 80), (1, 2, 1500, 64, 200)],
                         ids=lambda s: "x".join(map(str, s)))
def test_tf32_states_pass_dedicated_or_fused(shape, reverse, monkeypatch):
    """float32 "tf32" split in 3 segments (on Hopper rtk_chunk_fwd_tf32): its first pass by
    rtk_chunk_states_tf32 (the plan's) and by the fused kernel's states-only mode
    (dedicated_states=False) each give the fp64 output and final state, with an initial state and
    gamma 0.9 / 0.99 / 0.999 among the heads, and agree with each other to the TF32 bound; the
    states pass alone (launch.kernel_final_state, forward and reversed) gives the fp64 state of
    the sequence from zero, with no host sync."""
    from rtkernels.decay import KIND_FACTOR, LogDecay
    from rtkernels.methods.chunk.launch import kernel_final_state

    from inputs import no_host_sync

    b, h, n, dk, dv = shape
    q, k, v = _inputs(b, h, n, dk, dv, seed=4)
    gammas = torch.tensor([0.9, 0.99, 0.999][:h], dtype=torch.float64)
    s0 = torch.randn(b, h, dk, dv, device="cuda") / 4
    ref, ref_state = reference(q, k, v, gammas, initial_state=s0)
    got = {}
    for dedicated in (True, False):
        force_chunk(monkeypatch, segments=3, dedicated_states=dedicated)
        out, state = rtkernels.causal_linear_attention(q, k, v, gammas.float().cuda(), method="chunk",
                                                       initial_state=s0, return_state=True, fp32_precision="tf32")
        _check(out, ref, "tf32", f"{shape} dedicated={dedicated} output")
        _check(state, ref_state, "tf32", f"{shape} dedicated={dedicated} state")
        got[dedicated] = out
    _check(got[True], got[False].double(), "tf32", f"{shape} the two states passes")
    force_chunk(monkeypatch, segments=3)
    log_decay = LogDecay(torch.device("cuda"), raw=gammas.float().cuda(), kind=KIND_FACTOR)
    with no_host_sync():
        alone = kernel_final_state(k, v, log_decay, fp32_precision="tf32", reverse=reverse)
    kr, vr = (x.flip(2) if reverse else x for x in (k, v))
    _check(alone, reference(kr, kr, vr, gammas)[1], "tf32", f"{shape} final state alone reverse={reverse}")


# NaN bit patterns, as int32: the quiet NaN torch writes, and a negative one with every payload bit
# set, which an integer rounding that adds half an ulp would turn into +0 (the kernels' TF32
# roundings must keep both NaN)
NAN_BITS = {"quiet": 0x7FC00000, "negative-full-payload": -1}


@pytest.mark.parametrize("nan", NAN_BITS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("d", [64, 37])  # 37: the scalar load path
@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_fp32_nan_reaches_only_its_rows(where, d, mode, nan, monkeypatch):
    b, h, n = 2, 2, 150
    for segments, row in ((None, 0), (None, 70), (None, 149), (2, 70)):
        force_chunk(monkeypatch, segments=segments)
        q, k, v = _inputs(b, h, n, d, d, seed=3)
        {"q": q, "k": k, "v": v}[where].view(torch.int32)[1, 0, row, 5] = NAN_BITS[nan]
        out = rtkernels.causal_linear_attention(q, k, v, 1e-6, method="chunk", fp32_precision=mode).cpu()
        expected = nan_reach(out.shape, where, 1, 0, row, 5)
        assert torch.equal(torch.isnan(out), expected), (where, row, segments)
        assert torch.isfinite(out[~expected]).all()


@pytest.mark.parametrize("gamma", [1e-6, 1.0])
@pytest.mark.parametrize("nan", NAN_BITS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("d", [64, 37])
def test_fp32_nan_in_initial_state_reaches_its_column(d, mode, nan, gamma, monkeypatch):
    """A NaN at S0[1, 0, 5, 7] reaches output column 7 of every row of head (1, 0), through three
    chunks' carries, and stays at its own entry of the final state; everything else is finite."""
    b, h, n = 2, 2, 150
    for segments in (None, 2):
        force_chunk(monkeypatch, segments=segments)
        q, k, v = _inputs(b, h, n, d, d, seed=5)
        s0 = torch.randn(b, h, d, d, device="cuda")
        s0.view(torch.int32)[1, 0, 5, 7] = NAN_BITS[nan]
        out, state = rtkernels.causal_linear_attention(q, k, v, gamma, method="chunk", initial_state=s0,
                                                       return_state=True, fp32_precision=mode)
        expected = torch.zeros(out.shape, dtype=torch.bool, device="cuda")
        expected[1, 0, :, 7] = True
        assert torch.equal(torch.isnan(out), expected), (segments, "output")
        assert torch.isfinite(out[~expected]).all()
        state_nan = torch.zeros(state.shape, dtype=torch.bool, device="cuda")
        state_nan[1, 0, 5, 7] = True  # S is updated entry by entry: the NaN stays where it was
        assert torch.equal(torch.isnan(state), state_nan), (segments, "state")


def test_fp32_default_follows_torch_matmul_precision():
    q, k, v = _inputs(1, 4, 300, 64, 64, seed=4)
    exact = rtkernels.causal_linear_attention(q, k, v, 0.99, method="chunk", fp32_precision="exact")
    tf32 = rtkernels.causal_linear_attention(q, k, v, 0.99, method="chunk", fp32_precision="tf32")
    assert not torch.equal(exact, tf32)
    before = torch.get_float32_matmul_precision()
    try:
        for setting, expected in (("highest", exact), ("high", tf32), ("medium", tf32)):
            torch.set_float32_matmul_precision(setting)
            out = rtkernels.causal_linear_attention(q, k, v, 0.99, method="chunk")
            assert torch.equal(out, expected), setting  # the kernels are deterministic
            assert torch.equal(rtkernels.causal_linear_attention(q, k, v, 0.99), expected), setting  # auto
    finally:
        torch.set_float32_matmul_precision(before)


def test_fp32_strided_views_and_long_sequence():
    base = torch.randn(2, 3, 500, 2 * 64, device="cuda") / 8
    q, k = base[..., :64], base[..., 64:]  # row stride 128: non-contiguous views, 16-byte aligned
    v = torch.randn(2, 500, 3, 48, device="cuda").transpose(1, 2)
    for mode in MODES:
        out = rtkernels.causal_linear_attention(q, k, v, 0.9, method="chunk", fp32_precision=mode)
        ref, _ = reference(q, k, v, torch.full((3,), 0.9, dtype=torch.float64))
        _check(out, ref, mode, f"strided {mode}")
    q, k, v = _inputs(1, 2, 1 << 16, 64, 64, seed=5)
    for gamma in (1.0, 1e-6):
        for mode in MODES:
            out = rtkernels.causal_linear_attention(q, k, v, gamma, method="chunk", fp32_precision=mode)
            assert torch.isfinite(out).all(), (gamma, mode)


def test_fp32_cached_calls_keep_their_mode():
    """A repeated call reuses its planned launch (rtkernels.call_cache), one per mode, never the other mode's."""
    from rtkernels import call_cache

    call_cache.clear()
    q, k, v = _inputs(1, 4, 300, 64, 64, seed=6)
    first = {m: rtkernels.causal_linear_attention(q, k, v, 0.99, method="chunk", fp32_precision=m) for m in MODES}
    assert call_cache.size() == 2 and not torch.equal(first["exact"], first["tf32"])
    for m in ("tf32", "exact", "tf32"):  # cached calls
        assert torch.equal(rtkernels.causal_linear_attention(q, k, v, 0.99, method="chunk", fp32_precision=m), first[m])
