"""``rtkernels.linear_attention`` on the CPU: normalized decaying linear attention against an
independent fp64 O(N^2) loop (written here, not using the library), gradients by gradcheck and
against autograd through the loop, argument checks, NaN propagation, empty inputs.

    w_ij = gamma_h^(i-j) s(q_i, k_j),   s = scale q.k ("identity") or 1 + scale q.k ("1+qk")
    o_i  = sum_{j<=i} w_ij v_j / (sum_{j<=i} w_ij + eps)        (normalize=False: the numerator)
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import rtkernels
from rtkernels import normalized
from tolerances import assert_close

F64 = torch.float64
#: Per-head factors: the smallest accepted order of magnitude, two memories, no decay at all.
GAMMAS = (1e-6, 0.9, 0.99, 1.0)
#: (B, N, Dk, Dv): one token, a sequence past two 64-token chunks, Dk != Dv, D = 37.
SHAPES = [(1, 1, 8, 8), (2, 130, 37, 5), (1, 130, 6, 37)]


def normalized_loop(q, k, v, gammas, scale, feature, normalize, eps, layout="bhnd"):
    """(output in ``layout``, denominator ``[B, H, N]``) in float64 on q's device, one query row at a
    time: ``w = gamma^(i-j) s(q_i, k_j)`` for j <= i, ``o_i = sum_j w v_j / (sum_j w + eps)``.
    Differentiable with respect to every tensor argument (autograd through plain torch ops)."""
    q, k, v = (x.to(F64) for x in (q, k, v))
    if layout == "bnhd":
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    g = gammas.to(q.device, F64)
    b, h, n, _ = q.shape
    rows, dens = [], []
    for i in range(n):
        dist = i - torch.arange(i + 1, dtype=F64, device=q.device)
        s = scale * torch.einsum("bhd,bhjd->bhj", q[:, :, i], k[:, :, :i + 1])
        if feature == "1+qk":
            s = 1 + s
        w = g[:, None] ** dist[None, :] * s                     # [B, H, i+1]
        num = torch.einsum("bhj,bhjd->bhd", w, v[:, :, :i + 1])
        den = w.sum(-1)
        rows.append(num / (den + eps)[..., None] if normalize else num)
        dens.append(den)
    if n == 0:
        return v.new_zeros(v.shape).transpose(1, 2) if layout == "bnhd" else v.new_zeros(v.shape), q.new_zeros(b, h, 0)
    o = torch.stack(rows, 2)
    return (o.transpose(1, 2) if layout == "bnhd" else o), torch.stack(dens, 2)


def positive_features(x: torch.Tensor) -> torch.Tensor:
    """elu(x) + 1 > 0: every q.k > 0, so every weight >= 0 and the denominator > 0."""
    return F.elu(x) + 1


def make_inputs(seed, b, h, n, dk, dv, layout, dtype=F64, positive=True):
    """q, k, v in ``layout`` rounded to ``dtype``: q, k positive features (elu + 1) / sqrt(Dk), or
    signed ``randn / (2 sqrt(Dk))`` (then |q.k| is small: 1 + 0.7 q.k stays well above 0)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (lambda d: (b, h, n, d)) if layout == "bhnd" else (lambda d: (b, n, h, d))
    x = [torch.randn(shape(dk), generator=gen, dtype=F64) for _ in range(2)]
    if positive:
        q, k = (positive_features(t) / math.sqrt(dk) for t in x)
    else:
        q, k = (t / (2 * math.sqrt(dk)) for t in x)
    v = torch.randn(shape(dv), generator=gen, dtype=F64)
    return tuple(t.to(dtype) for t in (q, k, v))


def heads(h: int = 4) -> torch.Tensor:
    return torch.tensor(GAMMAS[:h], dtype=F64)


# ------------------------------------------------------------------------------------ forward

@pytest.mark.parametrize("scale", [0.0, 0.7])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("feature", rtkernels.FEATURES)
def test_forward_matches_fp64_loop(feature, normalize, layout, shape, scale):
    """fp64, per-head gammas {1e-6, 0.9, 0.99, 1}: the loop's answer to ~1e-10. Normalized identity
    calls get positive features (a positive denominator); the others signed inputs."""
    b, n, dk, dv = shape
    positive = normalize and feature == "identity"
    q, k, v = make_inputs(n + dk, b, 4, n, dk, dv, layout, positive=positive)
    gam = heads()
    out = rtkernels.linear_attention(q, k, v, gam, scale=scale, normalize=normalize, feature=feature, layout=layout)
    want, den = normalized_loop(q, k, v, gam, scale, feature, normalize, 1e-6, layout)
    assert out.dtype == F64 and out.shape == v.shape and out.is_contiguous()
    if normalize and not (feature == "identity" and scale == 0):
        assert float(den.min()) > 0.1, "the test's inputs should keep the denominator away from 0"
    assert_close(out, want, F64, f"{feature} normalize={normalize} {layout} {shape} scale={scale}")


def test_identity_numerator_is_the_core_call():
    q, k, v = make_inputs(1, 2, 4, 70, 5, 9, "bnhd", positive=False)
    for kwargs in ({"decay": heads()}, {"decay_rate": 0.1}, {}):
        got = rtkernels.linear_attention(q, k, v, scale=0.3, normalize=False, layout="bnhd", **kwargs)
        assert torch.equal(got, rtkernels.causal_linear_attention(q, k, v, scale=0.3, layout="bnhd", **kwargs))


@pytest.mark.parametrize("feature", rtkernels.FEATURES)
def test_decay_forms(feature):
    """A float factor, a rate tensor and no decay mean what they mean for the core."""
    q, k, v = make_inputs(3, 1, 4, 50, 7, 3, "bhnd")
    forms = [({"decay": 0.8}, torch.full((4,), 0.8, dtype=F64)),
             ({"decay_rate": -torch.log(heads())}, heads()),
             ({}, torch.ones(4, dtype=F64))]
    for kwargs, gam in forms:
        out = rtkernels.linear_attention(q, k, v, feature=feature, **kwargs)
        assert_close(out, normalized_loop(q, k, v, gam, 1.0, feature, True, 1e-6)[0], F64, str(kwargs))


@pytest.mark.parametrize("method", ["chunk", "scan", "vanilla", "block"])
def test_every_method_gives_the_same_answer(method):
    q, k, v = make_inputs(4, 1, 4, 65, 5, 6, "bhnd")
    out = rtkernels.linear_attention(q, k, v, heads(), feature="1+qk", scale=0.5, method=method)
    assert_close(out, normalized_loop(q, k, v, heads(), 0.5, "1+qk", True, 1e-6)[0], F64, method)


@pytest.mark.parametrize("eps", [0.0, 0.5])
def test_eps_is_added_to_the_denominator(eps):
    q, k, v = make_inputs(5, 1, 4, 40, 5, 6, "bhnd")
    out = rtkernels.linear_attention(q, k, v, heads(), eps=eps)
    assert_close(out, normalized_loop(q, k, v, heads(), 1.0, "identity", True, eps)[0], F64, f"eps={eps}")


def test_zero_weights():
    """scale 0 with "identity": every weight is 0, the output 0 / eps = 0, and 0/0 = NaN for eps = 0;
    with "1+qk" the weights are the decay alone: a decayed mean of v."""
    q, k, v = make_inputs(6, 1, 4, 20, 3, 2, "bhnd")
    assert torch.equal(rtkernels.linear_attention(q, k, v, heads(), scale=0), torch.zeros_like(v))
    assert torch.isnan(rtkernels.linear_attention(q, k, v, heads(), scale=0, eps=0)).all()
    out = rtkernels.linear_attention(q, k, v, heads(), scale=0, feature="1+qk", eps=0)
    assert_close(out, normalized_loop(q, k, v, heads(), 0.0, "1+qk", True, 0.0)[0], F64)
    assert torch.allclose(out[:, 0], v[:, 0], atol=1e-5)
    assert torch.allclose(out[:, 3], v[:, 3].cumsum(1) / torch.arange(1, 21, dtype=F64)[:, None])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("feature", rtkernels.FEATURES)
def test_low_precision_dtypes(dtype, feature):
    """fp32 / fp16 / bf16 in, the same dtype out, within the dtype's tolerance of the fp64 loop on
    the same (rounded) inputs."""
    q, k, v = make_inputs(7, 2, 4, 130, 16, 24, "bnhd", dtype=dtype)
    out = rtkernels.linear_attention(q, k, v, heads(), feature=feature, scale=0.25, layout="bnhd")
    assert out.dtype == dtype and out.shape == v.shape and out.is_contiguous()
    assert_close(out, normalized_loop(q, k, v, heads(), 0.25, feature, True, 1e-6, "bnhd")[0], dtype, str(dtype))


@pytest.mark.parametrize("feature", rtkernels.FEATURES)
def test_recording_autograd_does_not_change_the_output(feature):
    """Without autograd the last operation writes the 16-bit output directly (``out=``); with it,
    through an fp32 temporary: the same single rounding, the same bits."""
    q, k, v = make_inputs(15, 2, 4, 70, 8, 6, "bhnd", dtype=torch.bfloat16)
    plain = rtkernels.linear_attention(q, k, v, heads(), feature=feature, scale=0.5)
    recorded = rtkernels.linear_attention(q.requires_grad_(True), k, v, heads(), feature=feature, scale=0.5)
    assert recorded.requires_grad and recorded.dtype == plain.dtype and torch.equal(recorded.detach(), plain)


@pytest.mark.parametrize("feature", rtkernels.FEATURES)
def test_vmap(feature):
    """torch.func.vmap over a leading axis: each slice as its own call."""
    q, k, v = (x.reshape(3, 1, *x.shape[1:]) for x in make_inputs(16, 3, 4, 20, 5, 6, "bhnd"))
    got = torch.func.vmap(lambda a, b, c: rtkernels.linear_attention(a, b, c, heads(), feature=feature))(q, k, v)
    want = torch.stack([rtkernels.linear_attention(q[i], k[i], v[i], heads(), feature=feature) for i in range(3)])
    assert_close(got, want, F64, feature)


# ---------------------------------------------------------------------------------- gradients

@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("feature", rtkernels.FEATURES)
def test_gradcheck(feature, normalize, layout):
    """torch.autograd.gradcheck in fp64 for q, k, v and a trainable decay tensor (interior
    factors, so that a central difference stays in (0, 1])."""
    q, k, v = make_inputs(8, 1, 2, 6, 3, 2, layout)
    gam = torch.tensor([0.6, 0.95], dtype=F64)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, gam)]

    def fn(q, k, v, d):
        return rtkernels.linear_attention(q, k, v, d, scale=0.7, normalize=normalize, feature=feature, layout=layout)

    assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("feature", rtkernels.FEATURES)
def test_gradients_match_fp64_loop(feature):
    """dq, dk, dv, d(decay) of sum(W * out) against autograd through the loop, N = 70, Dv = 37."""
    q, k, v = make_inputs(9, 2, 4, 70, 5, 37, "bnhd")
    w = torch.randn(v.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    got_leaves = [t.clone().requires_grad_(True) for t in (q, k, v, torch.tensor([1e-6, 0.9, 0.99, 0.999], dtype=F64))]
    out = rtkernels.linear_attention(*got_leaves[:3], got_leaves[3], scale=0.6, feature=feature, layout="bnhd")
    got = torch.autograd.grad((out * w).sum(), got_leaves)
    ref_leaves = [t.detach().clone().requires_grad_(True) for t in got_leaves]
    ref, _ = normalized_loop(*ref_leaves[:3], ref_leaves[3], 0.6, feature, True, 1e-6, "bnhd")
    want = torch.autograd.grad((ref * w).sum(), ref_leaves)
    for name, g, r in zip(("q", "k", "v", "decay"), got, want):
        assert_close(g, r, F64, f"d{name} {feature}")


# ------------------------------------------------------------------------------ the core calls

@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("feature", rtkernels.FEATURES)
def test_core_calls_take_the_callers_tensors(feature, normalize, layout, monkeypatch):
    """No copy of q, k or v: the core gets them as they are (same memory, same strides), the other
    operands are width-1 stride-0 views of ones (``core(1, 1, k) = z``, ``core(1, 1, v) = u``, and for
    ``"1+qk"`` a ``[1, H, N, 1]`` call in fp32 for G); every call gets the caller's decay arguments."""
    calls = []
    real = normalized.causal_linear_attention

    def record(*args, **kwargs):
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(normalized, "causal_linear_attention", record)
    q, k, v = (x.to(torch.bfloat16) for x in make_inputs(14, 2, 3, 9, 5, 7, layout))
    decay, rate = torch.tensor([0.5, 0.9, 1.0]), None
    rtkernels.linear_attention(q, k, v, decay, decay_rate=rate, scale=0.3, normalize=normalize, feature=feature,
                               layout=layout, method="chunk", fp32_precision="tf32")

    def same(x, y):
        return x.data_ptr() == y.data_ptr() and x.shape == y.shape and x.stride() == y.stride() and x.dtype == y.dtype

    def ones(x, lead):
        return (x.shape == (*lead, 1) and all(s == 0 or n == 1 for s, n in zip(x.stride()[:3], lead))
                and bool((x == 1).all()))

    def unit_rows(x, lead):  # e_1 = (1, 0, ..., 0), 8 wide (16-byte rows), stride 0 over the tokens
        return (x.shape == (*lead, 8) and all(s == 0 or n == 1 for s, n in zip(x.stride()[:3], lead))
                and bool((x[..., 0] == 1).all()) and bool((x[..., 1:] == 0).all()))

    lead = tuple(q.shape[:3])
    expected = ["main"] + (["u"] if feature == "1+qk" else []) + (["z"] if normalize else []) \
        + (["G"] if normalize and feature == "1+qk" else [])
    assert len(calls) == len(expected)
    for what, (args, kwargs) in zip(expected, calls):
        a, b, c, d = args
        assert d is decay and kwargs["decay_rate"] is rate and kwargs["layout"] == layout, what
        assert kwargs["method"] == "chunk", what
        if what == "main":
            assert same(a, q) and same(b, k) and same(c, v) and kwargs["scale"] == 0.3
            assert kwargs["fp32_precision"] == "tf32"
        elif what in ("u", "z"):
            assert unit_rows(a, lead) and a.dtype == q.dtype and b is a and same(c, v if what == "u" else k), what
            assert kwargs["scale"] == 1.0 and kwargs["fp32_precision"] == "tf32", what
        else:  # G: computed in fp32 (exact mode), one batch row
            g_lead = (1, *lead[1:])
            assert ones(a, g_lead) and a.dtype == torch.float32 and b is a and c is a
            assert kwargs["fp32_precision"] == "exact"


# ------------------------------------------------------------------------------- bad arguments

BAD = [
    ({"feature": "softmax"}, ValueError, "^feature must be one of 'identity', '1\\+qk', got 'softmax'"),
    ({"feature": None}, TypeError, "^feature must be a string"),
    ({"eps": -1e-3}, ValueError, "^eps must be finite and >= 0, got -0.001"),
    ({"eps": float("nan")}, ValueError, "^eps must be finite"),
    ({"eps": float("inf")}, ValueError, "^eps must be finite"),
    ({"eps": "1e-6"}, TypeError, "^eps must be a real number, got str"),
    ({"eps": True}, TypeError, "^eps must be a real number, got bool"),
    ({"eps": torch.tensor(1e-6)}, TypeError, "^eps must be a real number, got Tensor"),
    ({"normalize": 1}, TypeError, "^normalize must be a bool, got int"),
    ({"normalize": None}, TypeError, "^normalize must be a bool, got NoneType"),
    ({"scale": float("inf")}, ValueError, "^scale must be finite"),
    ({"scale": "1"}, TypeError, "^scale must be a real number"),
    ({"layout": "nhbd"}, ValueError, "^layout must be one of"),
    ({"decay": 1.5}, ValueError, "^decay must be a factor gamma in \\(0, 1\\]"),
    ({"decay": 0.5, "decay_rate": 0.1}, ValueError, "^pass decay"),
    ({"decay": torch.ones(3)}, ValueError, "^decay must be a float or a tensor of shape \\[H\\] = \\[2\\]"),
    ({"method": "fast"}, ValueError, "^method must be one of"),
    ({"fp32_precision": "half"}, ValueError, "^fp32_precision must be"),
]


@pytest.mark.parametrize("feature", rtkernels.FEATURES)
@pytest.mark.parametrize("kwargs, exc, match", BAD, ids=lambda x: str(x)[:40] if isinstance(x, dict) else "")
def test_bad_arguments(kwargs, exc, match, feature):
    q, k, v = make_inputs(10, 1, 2, 4, 3, 2, "bhnd")
    call = {"feature": feature, **kwargs}
    with pytest.raises(exc, match=match):
        rtkernels.linear_attention(q, k, v, **call)


def test_bad_tensors_are_named_before_any_augmentation():
    """The checks of q, k, v run on the caller's tensors (a Dv = 0 v is not hidden by the ones
    column; the messages give the caller's shapes)."""
    q, k, v = make_inputs(11, 1, 2, 4, 3, 2, "bhnd")
    with pytest.raises(ValueError, match=r"^v must have Dv >= 1, got shape \(1, 2, 4, 0\)"):
        rtkernels.linear_attention(q, k, v[..., :0])
    with pytest.raises(ValueError, match=r"^v must have the batch, head and sequence sizes of q"):
        rtkernels.linear_attention(q, k, v[:, :, :3], feature="1+qk")
    with pytest.raises(ValueError, match=r"^k must have the key dimension Dk of q: expected 3, got 2"):
        rtkernels.linear_attention(q, k[..., :2], v, feature="1+qk")
    with pytest.raises(TypeError, match="^q, k and v must share one dtype"):
        rtkernels.linear_attention(q.float(), k, v)
    with pytest.raises(TypeError, match="^q must be a torch.Tensor"):
        rtkernels.linear_attention(q.tolist(), k, v)


# ------------------------------------------------------------------------------------------ NaN

@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("feature", rtkernels.FEATURES)
@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_nan_reaches_exactly_its_rows(where, feature, normalize, layout):
    """A NaN in v_j[c] reaches rows i >= j of its head (column c only); in k_j rows i >= j; in q_i
    row i. Nothing else is NaN."""
    b, h, n, dk, dv = 2, 3, 9, 4, 5
    q, k, v = make_inputs(12, b, h, n, dk, dv, layout)
    bi, hi, row, col = 1, 2, 4, 1
    x = {"q": q, "k": k, "v": v}[where]
    (x[bi, hi, row, col] if layout == "bhnd" else x[bi, row, hi, col]).fill_(float("nan"))
    out = rtkernels.linear_attention(q, k, v, torch.tensor([0.5, 0.9, 1.0]), normalize=normalize, feature=feature,
                                     layout=layout)
    expected = torch.zeros(b, h, n, dv, dtype=torch.bool)
    if where == "q":
        expected[bi, hi, row] = True
    elif where == "k":
        expected[bi, hi, row:] = True
    else:
        expected[bi, hi, row:, col] = True
    got = torch.isnan(out if layout == "bhnd" else out.transpose(1, 2))
    assert torch.equal(got, expected)


# -------------------------------------------------------------------------------------- empty

@pytest.mark.parametrize("feature", rtkernels.FEATURES)
@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
def test_empty_inputs(feature, layout):
    """N = 0 (and B = 0): an empty output of the right shape, and a backward that gives zeros."""
    for b, n in ((2, 0), (0, 5)):
        q, k, v = (t.requires_grad_(True) for t in make_inputs(13, b, 3, n, 4, 6, layout))
        d = torch.tensor([0.5, 0.9, 1.0], dtype=F64, requires_grad=True)
        out = rtkernels.linear_attention(q, k, v, d, feature=feature, layout=layout)
        assert out.shape == v.shape and out.dtype == v.dtype
        out.sum().backward()
        for t in (q, k, v, d):
            assert t.grad is not None and t.grad.shape == t.shape and not t.grad.any()


def test_public_names():
    assert "linear_attention" in rtkernels.__all__ and "FEATURES" in rtkernels.__all__
    assert rtkernels.FEATURES == ("identity", "1+qk")
