"""linear_attention's normalization step (rtkernels.normalize_op) on the CPU: the torch path (the
kernels' reference) against the formula in fp64, gradcheck of the op (every input, both outputs),
torch.library.opcheck, torch.compile(fullgraph=True) of linear_attention with the op in its graph,
and the kernel launch's arguments as the Python side builds them (the launch itself mocked)."""

from __future__ import annotations

import re

import pytest
import torch

import rtkernels
from rtkernels import normalize_op
from rtkernels.jit import source_dir

F64 = torch.float64
B, H, N = 2, 3, 5


def _shape(layout, d):
    return (B, H, N, d) if layout == "bhnd" else (B, N, H, d)


def _operands(layout, feature, dk=4, dv=3, dtype=F64, grad=False, g_batch=1, seed=0):
    """q, z, num, u, g in ``layout`` (G ``[g_batch, ., ., 1]``, fp32 or fp64); z and G positive."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.rand(_shape(layout, dk), generator=gen, dtype=F64) + 0.1
    z = torch.rand(_shape(layout, dk), generator=gen, dtype=F64) + 0.1
    num = torch.randn(_shape(layout, dv), generator=gen, dtype=F64)
    u = torch.randn(_shape(layout, dv), generator=gen, dtype=F64) if feature == "1+qk" else None
    g = None
    if feature == "1+qk":
        g = torch.rand((g_batch, *_shape(layout, 1)[1:]), generator=gen, dtype=F64) + 1
        g = g.to(F64 if dtype == F64 else torch.float32)
    rows = [t.to(dtype) if t is not None else None for t in (q, z, num, u)]
    return tuple(t.requires_grad_(grad) if t is not None else None for t in (*rows, g))


def _formula(q, z, num, u, g, scale, eps, layout):
    """(o, den [B, H, N]) in fp64 from the definitions."""
    q, z, num = (t.double() for t in (q, z, num))
    den = scale * (q * z).sum(-1)
    if g is not None:
        den = den + g.double()[..., 0]
    s = num if u is None else num + u.double()
    o = s / (den + eps)[..., None]
    return o, (den if layout == "bhnd" else den.transpose(1, 2))


@pytest.mark.parametrize("g_batch", [1, B])
@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("feature", rtkernels.FEATURES)
def test_torch_forward_is_the_formula(feature, layout, g_batch):
    ops = _operands(layout, feature, g_batch=g_batch)
    o, den = normalize_op.forward_op(*ops, 0.7, 0.25, layout)
    want_o, want_den = _formula(*ops, 0.7, 0.25, layout)
    assert o.shape == ops[2].shape and o.is_contiguous() and den.shape == (B, H, N) and den.is_contiguous()
    torch.testing.assert_close(o, want_o, rtol=1e-13, atol=0)
    torch.testing.assert_close(den, want_den, rtol=1e-13, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("feature", rtkernels.FEATURES)
def test_low_precision_rounds_once(feature, dtype):
    """16-bit inputs: den fp32 (never rounded to 16 bits), o the fp64 answer rounded once (up to a
    tie the fp32 quotient may round the other way: one unit in the last place at most). fp32: the
    fp32 dot's own rounding errors come on top (a few units)."""
    ops = _operands("bnhd", feature, dk=37, dv=9, dtype=dtype)
    o, den = normalize_op.forward_op(*ops, 0.3, 1e-6, "bnhd")
    want_o, want_den = _formula(*ops, 0.3, 1e-6, "bnhd")
    assert o.dtype == dtype and den.dtype == torch.float32
    torch.testing.assert_close(den.double(), want_den, rtol=2e-6, atol=0)
    ulp = torch.finfo(dtype).eps * (16 if dtype == torch.float32 else 1)
    assert ((o.double() - want_o).abs() <= ulp * want_o.abs()).all()


def test_eps_is_added_in_the_compute_dtype():
    """fp16: eps = 1e-6 is subnormal in fp16 and would vanish added in 16 bits; here a zero
    denominator gives num / eps."""
    q, z, num, _, _ = _operands("bhnd", "identity", dtype=torch.float16)
    num = torch.full_like(num, 1e-3)
    o, den = normalize_op.forward_op(q, z, num, None, None, 0.0, 1e-2, "bhnd")
    assert (den == 0).all() and torch.allclose(o.float(), torch.full(o.shape, 0.1), rtol=1e-3)


def test_nan_in_nan_out():
    q, z, num, _, _ = _operands("bhnd", "identity")
    q[1, 2, 3, 0] = float("nan")
    num[0, 0, 1, 2] = float("nan")
    o, _ = normalize_op.forward_op(q, z, num, None, None, 1.0, 1e-6, "bhnd")
    expected = torch.zeros(o.shape, dtype=torch.bool)
    expected[1, 2, 3] = True
    expected[0, 0, 1, 2] = True
    assert torch.equal(torch.isnan(o), expected)


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("feature", rtkernels.FEATURES)
def test_gradcheck_of_the_op(feature, layout):
    """Every input, and both outputs (den's gradient too: the backward adds it)."""
    ops = _operands(layout, feature, grad=True)
    if ops[4] is not None:
        ops[4].requires_grad_(True)
    leaves = [t for t in ops if t is not None]

    def fn(*xs):
        it = iter(xs)
        args = [next(it) if t is not None else None for t in ops]
        return normalize_op.forward_op(*args, 0.7, 0.3, layout)

    assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-8, rtol=1e-6)


def test_gradients_only_where_needed():
    """q alone requiring grad: the backward computes dq (and d_num for nothing else)."""
    q, z, num, _, _ = _operands("bhnd", "identity")
    q.requires_grad_(True)
    o, _ = normalize_op.forward_op(q, z, num, None, None, 0.5, 1e-6, "bhnd")
    (dq,) = torch.autograd.grad(o.sum(), [q])
    q64 = q.detach().clone().requires_grad_(True)
    (want,) = torch.autograd.grad(_formula(q64, z, num, None, None, 0.5, 1e-6, "bhnd")[0].sum(), [q64])
    torch.testing.assert_close(dq, want)


def test_not_twice_differentiable():
    q, z, num, _, _ = _operands("bhnd", "identity", grad=True)
    o, _ = normalize_op.forward_op(q, z, num, None, None, 0.5, 1e-6, "bhnd")
    (dq,) = torch.autograd.grad(o.sum(), [q], create_graph=True)
    with pytest.raises(RuntimeError, match="not twice differentiable"):
        dq.sum().backward()


OPCHECK = {
    "identity-bhnd": lambda: (*_operands("bhnd", "identity", grad=True)[:3], None, None, 0.5, 1e-6, "bhnd"),
    "1+qk-bnhd-f32": lambda: (*_operands("bnhd", "1+qk", dtype=torch.float32, grad=True), 0.2, 0.0, "bnhd"),
    "1+qk-batch-g": lambda: (*_operands("bhnd", "1+qk", g_batch=B, grad=True), 1.0, 1e-3, "bhnd"),
}


@pytest.mark.parametrize("case", OPCHECK)
def test_opcheck_forward(case):
    args = OPCHECK[case]()
    if args[4] is not None:
        args[4].requires_grad_(True)
    torch.library.opcheck(normalize_op.forward_op, args)


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
def test_opcheck_backward(layout):
    q, z, num, u, g = _operands(layout, "1+qk", dtype=torch.float32)
    _, den = normalize_op.forward_op(q, z, num, u, g, 0.5, 1e-6, layout)
    grad = torch.randn(num.shape)
    torch.library.opcheck(normalize_op.backward_op, (grad, q, z, num, u, den, None, 0.5, 1e-6, layout, True, True,
                                                     True))
    torch.library.opcheck(normalize_op.backward_op, (grad, q, z, num, None, den, torch.randn(den.shape), 0.5, 1e-6,
                                                     layout, False, True, False))


@pytest.mark.parametrize("feature", rtkernels.FEATURES)
def test_torch_compile_fullgraph(feature):
    """torch.compile(fullgraph=True) of linear_attention: one graph holding the normalization op,
    the same output and gradients as eager."""
    gen = torch.Generator().manual_seed(3)
    q, k = (torch.rand(2, 3, 20, 4, generator=gen) + 0.1 for _ in range(2))
    v = torch.randn(2, 3, 20, 5, generator=gen)
    gamma = torch.tensor([0.5, 0.9, 1.0], requires_grad=True)

    def f(q, k, v, gamma):
        return rtkernels.linear_attention(q, k, v, gamma, scale=0.5, feature=feature)

    explained = torch._dynamo.explain(f)(q, k, v, gamma)
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
    targets = [n.target for gm in explained.graphs for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.rtkernels.linear_attention_normalize.default in targets
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    eager = f(*leaves, gamma)
    want = torch.autograd.grad(eager.sum(), [*leaves, gamma])
    leaves2 = [t.clone().requires_grad_(True) for t in (q, k, v)]
    got_out = torch.compile(f, fullgraph=True, backend="aot_eager")(*leaves2, gamma)
    got = torch.autograd.grad(got_out.sum(), [*leaves2, gamma])
    torch.testing.assert_close(got_out, eager)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


# ------------------------------------------------------------- the launch, as Python builds it

def _struct_fields() -> list[str]:
    text = (source_dir() / "normalize" / "row.cuh").read_text()
    body = re.search(r"struct rtk_norm_shape \{(.*?)\};", text, re.S).group(1)
    body = re.sub(r"//[^\n]*", "", body)
    return [name for decl in body.split(";") for name in re.findall(r"(\w+)\s*(?:,|$)", decl.strip())]


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("feature", rtkernels.FEATURES)
def test_launch_arguments(feature, layout, monkeypatch):
    """The pointers, then rtk_norm_shape's 32 fields in order: sizes, scale and eps as floats, the
    [B, H, N, D] strides of each operand (G's batch stride 0), the team; the instance's vector flag."""
    calls = []
    monkeypatch.setattr(normalize_op, "get_function", lambda src, name, dev: (src, name))
    monkeypatch.setattr(normalize_op, "launch", lambda fn, grid, block, args, dev, pointers: calls.append(
        (fn, grid, block, args, pointers)))
    fields = _struct_fields()
    assert len(fields) == 32 and fields[:7] == ["B", "H", "N", "Dk", "Dv", "scale", "eps"] and fields[-1] == "team"
    q, z, num, u, g = _operands(layout, feature, dk=16, dv=64, dtype=torch.bfloat16)
    o = torch.empty_like(num)
    den = torch.empty(B, H, N)
    normalize_op._launch_forward(q, z, num, u, g, o, den, 0.5, 1e-6, layout)
    (fn, grid, block, args, pointers), = calls
    vec = all(t.data_ptr() % 16 == 0 for t in (q, z, num, o, *([u] if u is not None else [])))
    assert fn == ("normalize/fwd.cu", f"rtk_normalize_fwd<2, {str(vec).lower()}, {str(u is not None).lower()}>")
    assert pointers == 7 and len(args) == 7 + 32 and block == (256, 1, 1)
    f = dict(zip(fields, args[7:]))
    assert (f["B"], f["H"], f["N"], f["Dk"], f["Dv"]) == (B, H, N, 16, 64)
    assert type(f["scale"]) is float and type(f["eps"]) is float and f["scale"] == 0.5
    view = (lambda t: t) if layout == "bhnd" else (lambda t: t.transpose(1, 2))
    assert (f["q_sb"], f["q_sh"], f["q_sn"]) == view(q).stride()[:3]
    assert (f["o_sb"], f["o_sh"], f["o_sn"]) == view(o).stride()[:3]
    if g is not None:
        assert f["g_sb"] == 0 and (f["g_sh"], f["g_sn"]) == view(g).stride()[1:3]
    assert f["team"] == (8 if vec else 32)  # 64 values in chunks of 8 (vec) or 1
    assert grid == (-(-B * H * N // (256 // f["team"])), 1, 1)
    assert all(type(a) is int for name, a in zip(fields, args[7:]) if name not in ("scale", "eps"))


def test_vector_flag_and_team():
    x = torch.empty(2, 3, 4, 16, dtype=torch.bfloat16)
    assert normalize_op._vector((x, x), 16, 16) == (x.data_ptr() % 16 == 0)
    assert not normalize_op._vector((x, x), 16, 12)             # 12 values: not whole 8-value chunks
    assert not normalize_op._vector((x[..., 1:9], x), 8, 8)      # a row start 2 bytes past alignment
    assert [normalize_op._team(c) for c in (0, 1, 3, 8, 16, 37, 64)] == [1, 1, 4, 8, 16, 32, 32]


def test_instances_cover_both_sources():
    inst = normalize_op.instances()
    assert set(inst) == set(normalize_op.SOURCES) and all(len(v) == 12 for v in inst.values())
