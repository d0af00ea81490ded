"""Packed variable-length batches on the CPU (``cu_seqlens``, rtkernels.varlen): outputs, final states
and every gradient against one ordinary call per sequence and against the fp64 reference run per
sequence, for lengths 0, 1, 63, 64, 65 and 2000 in one batch, both layouts, fp64/fp32/bf16 and
gamma in {1e-6, 0.9, 0.99, 1}; the errors for malformed inputs; invalid offsets read without a host
check (what a CUDA tensor gets); the call cache and torch.compile leaving varlen calls alone."""

from __future__ import annotations

import math

import pytest
import torch

import rtkernels
from rtkernels import api, call_cache, varlen
from rtkernels.decay import LogDecay
from inputs import compute_state_dtype, layout_shape, randn, seq_slice, state_tolerance_dtype
from reference import reference
from tolerances import assert_close

F64 = torch.float64
#: One head per decay: forgets at once, two where a wrong power of gamma shows, keeps everything.
GAMMAS = (1e-6, 0.9, 0.99, 1.0)
H, DK, DV = len(GAMMAS), 8, 6
#: Empty sequences (first, middle, last), one token, around the chunk size (64), one long sequence.
LENS = (0, 1, 63, 0, 64, 65, 2000, 0)
DTYPES = (F64, torch.float32, torch.bfloat16)
SCALE = 0.75


def offsets(lens, dtype=torch.int64) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=dtype)


def packed(lens, dtype, layout, seed=0):
    """q, k, v (batch 1, the sequences end to end in ``layout``), ``[S, H, Dk, Dv]`` initial states
    in the state dtype, the gamma tensor; values drawn in float64 and rounded to ``dtype``."""
    n = sum(lens)
    g = torch.Generator().manual_seed(seed)
    q = randn(g, layout_shape(1, H, n, DK, layout), dtype, 1 / math.sqrt(DK))
    k = randn(g, layout_shape(1, H, n, DK, layout), dtype, 1 / math.sqrt(DK))
    v = randn(g, layout_shape(1, H, n, DV, layout), dtype)
    s0 = randn(g, (len(lens), H, DK, DV), compute_state_dtype(dtype), 1 / math.sqrt(DK))
    return q, k, v, s0, torch.tensor(GAMMAS, dtype=F64)


def per_sequence(fn, lens, q, k, v, s0, layout):
    """Run ``fn(q_s, k_s, v_s, s0_s)`` -> (output, state) on each non-empty sequence; an empty one
    keeps its initial state. Returns the outputs end to end and the stacked states."""
    outs, states, lo = [], [], 0
    for s, n in enumerate(lens):
        if n == 0:
            states.append(s0[s])
            continue
        o, st = fn(*(seq_slice(x, lo, lo + n, layout) for x in (q, k, v)), s0[s:s + 1])
        outs.append(o)
        states.append(st[0])
        lo += n
    return torch.cat(outs, dim=2 if layout == "bhnd" else 1), torch.stack([x.double() for x in states])


def reference_per_sequence(lens, q, k, v, s0, gamma, layout):
    return per_sequence(lambda a, b, c, s: reference(a, b, c, gamma, SCALE, layout, s), lens, q, k, v, s0, layout)


def ordinary_per_sequence(lens, q, k, v, s0, decay, layout):
    def call(a, b, c, s):
        return rtkernels.causal_linear_attention(a, b, c, decay, scale=SCALE, layout=layout, initial_state=s,
                                                 return_state=True)
    return per_sequence(call, lens, q, k, v, s0, layout)


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_outputs_and_states(dtype, layout):
    q, k, v, s0, gamma = packed(LENS, dtype, layout)
    n = sum(LENS)
    for cu_dtype in (torch.int32, torch.int64):
        out, state = rtkernels.causal_linear_attention(q, k, v, gamma, scale=SCALE, layout=layout, initial_state=s0,
                                                       return_state=True, cu_seqlens=offsets(LENS, cu_dtype))
        assert out.shape == q.shape[:3] + (DV,) and out.dtype == dtype and out.is_contiguous()
        assert state.shape == (len(LENS), H, DK, DV) and state.dtype == compute_state_dtype(dtype)
        ro, rs = reference_per_sequence(LENS, q, k, v, s0, gamma, layout)
        assert_close(out, ro, dtype, "output vs fp64 reference", n)
        assert_close(state, rs, state_tolerance_dtype(dtype), "states vs fp64 reference", n)
    oo, os_ = ordinary_per_sequence(LENS, q, k, v, s0, gamma, layout)
    assert_close(out, oo.double(), dtype, "output vs one call per sequence", n)
    assert_close(state, os_.double(), state_tolerance_dtype(dtype), "states vs one call per sequence", n)


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gradients(dtype, layout):
    """dq, dk, dv, d(initial_state) and d(decay) from the outputs and the final states."""
    q, k, v, s0, gamma = packed(LENS, dtype, layout, seed=1)
    n = sum(LENS)
    g = torch.Generator().manual_seed(2)
    # representable in dtype: the gradient reaching a 16-bit output is rounded to it
    w_out = randn(g, layout_shape(1, H, n, DV, layout), dtype).to(F64)
    w_state = randn(g, tuple(s0.shape), F64)

    def grads(run):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, s0, gamma)]
        out, state = run(*leaves)
        loss = (out.double() * w_out).sum() + (state.double() * w_state).sum()
        return torch.autograd.grad(loss, leaves)

    got = grads(lambda a, b, c, s, gm: rtkernels.causal_linear_attention(
        a, b, c, gm, scale=SCALE, layout=layout, initial_state=s, return_state=True, cu_seqlens=offsets(LENS)))
    want = grads(lambda a, b, c, s, gm: reference_per_sequence(LENS, a, b, c, s, gm, layout))
    ordinary = grads(lambda a, b, c, s, gm: ordinary_per_sequence(LENS, a, b, c, s, gm, layout))
    names = ("dq", "dk", "dv", "dinitial_state", "ddecay")
    for name, a, b, o, x in zip(names, got, want, ordinary, (q, k, v, s0, gamma)):
        assert a.dtype == x.dtype and a.shape == x.shape, name
        tol = dtype if name in ("dq", "dk", "dv") else state_tolerance_dtype(dtype)
        assert_close(a, b, tol, f"{name} vs fp64 reference", n)
        assert_close(a, o.double(), tol, f"{name} vs one call per sequence", n)


def test_decay_rate_tensor_gradient():
    """A rate tensor that requires grad gets dL/dr = -gamma dL/dgamma."""
    lens = (5, 0, 70)
    q, k, v, s0, gamma = packed(lens, F64, "bhnd", seed=3)
    rate = (-torch.log(gamma)).requires_grad_()
    gm = gamma.clone().requires_grad_()
    out = rtkernels.causal_linear_attention(q, k, v, decay_rate=rate, cu_seqlens=offsets(lens), initial_state=s0)
    ref, _ = per_sequence(lambda a, b, c, s: reference(a, b, c, gm, 1.0, "bhnd", s), lens, q, k, v, s0, "bhnd")
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    (d_rate,) = torch.autograd.grad(out.sum(), rate)
    (d_gamma,) = torch.autograd.grad(ref.sum(), gm)
    torch.testing.assert_close(d_rate, -gamma * d_gamma, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("method", rtkernels.METHOD_NAMES)
def test_every_method_name_runs_the_varlen_path(method):
    lens = (3, 0, 40)
    q, k, v, s0, gamma = packed(lens, torch.float32, "bnhd")
    want = rtkernels.causal_linear_attention(q, k, v, 0.9, layout="bnhd", cu_seqlens=offsets(lens))
    got = rtkernels.causal_linear_attention(q, k, v, 0.9, layout="bnhd", method=method, cu_seqlens=offsets(lens))
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_no_initial_state_empty_sequences_get_zeros():
    lens = (0, 7, 0)
    q, k, v, _, _ = packed(lens, F64, "bhnd")
    out, state = rtkernels.causal_linear_attention(q, k, v, 0.5, cu_seqlens=offsets(lens), return_state=True)
    ref, ref_state = reference(q, k, v, torch.full((H,), 0.5, dtype=F64))
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    assert (state[0] == 0).all() and (state[2] == 0).all()
    torch.testing.assert_close(state[1], ref_state[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("lens", [(0,), (0, 0, 0), ()], ids=["one-empty", "three-empty", "no-sequences"])
def test_no_tokens(lens):
    """N = 0: an empty output; each sequence's state is its initial state, with its gradient."""
    q, k, v, s0, _ = packed(lens, torch.float32, "bhnd")
    s0.requires_grad_()
    out, state = rtkernels.causal_linear_attention(q, k, v, 0.9, cu_seqlens=offsets(lens), initial_state=s0,
                                                   return_state=True)
    assert out.shape == (1, H, 0, DV) and state.shape == (len(lens), H, DK, DV)
    torch.testing.assert_close(state, s0, rtol=0, atol=0)
    if lens:
        (d,) = torch.autograd.grad(state.sum(), s0)
        assert (d == 1).all()


def _bad_call(q, k, v, cu, **kw):
    return rtkernels.causal_linear_attention(q, k, v, 0.9, cu_seqlens=cu, **kw)


def test_bad_inputs_name_cu_seqlens():
    lens = (3, 5)
    q, k, v, s0, _ = packed(lens, torch.float32, "bhnd")
    cu = offsets(lens)
    with pytest.raises(TypeError, match="cu_seqlens must be an int32 or int64 tensor.*float32"):
        _bad_call(q, k, v, cu.float())
    with pytest.raises(TypeError, match="cu_seqlens must be a torch.Tensor or a CUDA array"):
        _bad_call(q, k, v, [0, 3, 8])
    with pytest.raises(ValueError, match=r"cu_seqlens must be a 1-D tensor \[S \+ 1\].*shape \(1, 3\)"):
        _bad_call(q, k, v, cu[None])
    with pytest.raises(ValueError, match=r"cu_seqlens must be a 1-D tensor \[S \+ 1\].*shape \(0,\)"):
        _bad_call(q, k, v, cu[:0])
    with pytest.raises(ValueError, match="no sequences"):
        _bad_call(q, k, v, cu[:1])
    with pytest.raises(TypeError, match="cu_seqlens must hold data"):
        _bad_call(q, k, v, cu.to("meta"))
    with pytest.raises(ValueError, match="batch size 1, got B = 2"):
        _bad_call(*(torch.cat([x, x]) for x in (q, k, v)), cu)
    with pytest.raises(ValueError, match=r"initial_state must have shape \[S, H, Dk, Dv\] = \[2, 4, 8, 6\] "
                                         r"\(one state per sequence of cu_seqlens\)"):
        _bad_call(q, k, v, cu, initial_state=s0[:1])
    with pytest.raises(ValueError, match="cu_seqlens must start at 0, got cu_seqlens\\[0\\] = 1"):
        _bad_call(q, k, v, torch.tensor([1, 3, 8]))
    with pytest.raises(ValueError, match="cu_seqlens must end at N = 8.*cu_seqlens\\[2\\] = 7"):
        _bad_call(q, k, v, torch.tensor([0, 3, 7]))
    with pytest.raises(ValueError, match="non-decreasing.*cu_seqlens\\[1\\] = 5 > cu_seqlens\\[2\\] = 4"):
        _bad_call(q, k, v, torch.tensor([0, 5, 4, 8]))
    with pytest.raises(ValueError, match="method must be one of"):
        _bad_call(q, k, v, cu, method="nope")
    with pytest.raises(ValueError, match="scale must be finite"):
        _bad_call(q, k, v, cu, scale=math.inf)


@pytest.mark.parametrize("cu", [[0, 50, 10, 130], [3, 60, 130], [0, 60, 125], [0, 60, 1 << 40], [-9, 200, 130]],
                         ids=["decreasing", "late-start", "short-end", "huge", "negative"])
def test_invalid_offsets_read_on_the_device_give_nan(cu):
    """What a CUDA cu_seqlens gets (values never read on the host): every index stays in range and
    every output and state is NaN."""
    n = 130
    q, k, v, s0, gamma = packed((n,) + (0,) * (len(cu) - 2), torch.float32, "bhnd")
    out, state = varlen.varlen_attention(q, k, v, torch.tensor(cu), LogDecay(q.device, host=(-0.1,) * H), 1.0,
                                         s0, True, checked_values=False)
    assert out.shape == (1, H, n, DV) and torch.isnan(out).all() and torch.isnan(state).all()


def test_unchecked_valid_offsets_are_not_nan():
    lens = (10, 0, 120)
    q, k, v, s0, _ = packed(lens, torch.float32, "bhnd")
    ld = LogDecay(q.device, host=(math.log(0.9),) * H)
    a = varlen.varlen_attention(q, k, v, offsets(lens), ld, 1.0, s0, True, checked_values=False)
    b = varlen.varlen_attention(q, k, v, offsets(lens), ld, 1.0, s0, True, checked_values=True)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_the_call_cache_never_serves_a_varlen_call():
    """A cached plan under the same non-varlen signature is not taken, and varlen calls add none."""
    lens = (4, 9)
    q, k, v, _, _ = packed(lens, torch.float32, "bhnd")
    args = (q, k, v, 0.9, None, 1.0, "auto", "bhnd", None, False, None)
    key = call_cache.call_key(*args)
    assert key is not None

    def launcher(*a):
        raise AssertionError("a varlen call took the cached launch of a call without cu_seqlens")

    call_cache.clear()
    try:
        call_cache.remember(key, launcher, torch.empty(1, H, sum(lens), DV), v, False)
        out = rtkernels.causal_linear_attention(q, k, v, 0.9, cu_seqlens=offsets(lens))
        assert call_cache.size() == 1
        ref, _ = per_sequence(lambda a, b, c, s: reference(a, b, c, torch.full((H,), 0.9)), lens, q, k, v,
                              torch.zeros(2, H, DK, DV), "bhnd")
        assert_close(out, ref, torch.float32)
    finally:
        call_cache.clear()


@pytest.mark.parametrize("decay", ["float", "tensor"])
def test_torch_compile_traces_the_varlen_path(monkeypatch, decay):
    """Under torch.compile the call never reaches the torch.library op (which has no cu_seqlens):
    one graph with a float decay; a CPU decay tensor's values are read on the host (a graph break)."""
    def no_op(*a, **kw):
        raise AssertionError("a varlen call was routed to the op, losing cu_seqlens")

    monkeypatch.setattr(api, "op_call", no_op)
    lens = (5, 0, 70, 20)
    q, k, v, s0, gamma = packed(lens, torch.float32, "bnhd")
    cu = offsets(lens)
    if decay == "float":
        gamma = 0.9

    def f(q, k, v, s0, gamma, cu):
        out, state = rtkernels.causal_linear_attention(q, k, v, gamma, layout="bnhd", initial_state=s0,
                                                       return_state=True, cu_seqlens=cu)
        return out.sum() + state.sum(), out, state

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=decay == "float")
    leaves = [x.clone().requires_grad_() for x in (q, k, v, s0)]
    loss, out, state = compiled(*leaves, gamma, cu)
    got = torch.autograd.grad(loss, leaves)
    eager_leaves = [x.clone().requires_grad_() for x in (q, k, v, s0)]
    loss_e, out_e, state_e = f(*eager_leaves, gamma, cu)
    want = torch.autograd.grad(loss_e, eager_leaves)
    torch.testing.assert_close(out, out_e)
    torch.testing.assert_close(state, state_e)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


# ---- the chunk kernels' packed path (rtkernels.methods.chunk.packed): its pure-Python parts -------

def test_chunk_shape_fields_match_the_header():
    """CHUNK_FIELDS lists rtk_chunk_shape's fields after its rtk_fwd_shape, in the header's order."""
    import re

    from rtkernels.jit import source_dir
    from rtkernels.methods.chunk.plan import CHUNK_FIELDS

    body = re.search(r"struct rtk_chunk_shape \{(.*?)\};", (source_dir() / "chunk" / "modes.cuh").read_text(),
                     re.S).group(1)
    decls = [d.strip() for d in body.split(";") if d.strip()]
    assert decls[0] == "rtk_fwd_shape f"
    fields = [name for d in decls[1:] for name in re.findall(r"(\w+)\s*(?:,|$)", d.split("rtk_i64", 1)[1])]
    assert tuple(fields) == CHUNK_FIELDS


def test_packed_plan_never_splits_a_sequence(monkeypatch):
    """Few long sequences and few heads (where an ordinary call splits the sequence): one segment."""
    from rtkernels.methods.chunk import plan

    monkeypatch.setattr(plan, "_sm_count", lambda dev: 132)
    monkeypatch.setattr(plan, "_smem_limit", lambda dev: plan.SMEM_LIMIT_SM90)
    plan.plan_launch.cache_clear()
    try:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for wgmma in (False, True):
                over = plan.Overrides(wgmma=wgmma if dtype != torch.float32 else None)
                assert plan.plan_launch(dtype, 64, 64, True, 2, 65536, 0, over).segments > 1
                assert plan.packed_launch(dtype, 64, 64, True, 2, 65536, 0, over).segments == 1
                assert plan.packed_launch(dtype, 64, 64, True, 2, 65536, 0,
                                          plan.Overrides(segments=8, wgmma=False)).segments == 1
    finally:
        plan.plan_launch.cache_clear()


@pytest.mark.parametrize("cu, ok", [([0, 5, 5, 12], True), ([0, 12], True), ([0, 0, 12, 12], True),
                                    ([1, 5, 12], False), ([0, 5, 11], False), ([0, 6, 5, 12], False),
                                    ([0, 5, 13], False)])
@pytest.mark.parametrize("dtype", (torch.int32, torch.int64), ids=str)
def test_packed_offsets_and_their_validity(cu, ok, dtype):
    from rtkernels.methods.chunk import packed

    cu64, valid = packed.offsets(torch.tensor(cu, dtype=dtype), 12)
    assert cu64.dtype == torch.int64 and cu64.is_contiguous() and cu64.tolist() == cu
    assert valid.dtype == torch.bool and valid.dim() == 0 and bool(valid) == ok


def _packed_pass_in_torch(cu):
    """A stand-in for packed.forward_pass on the CPU: each sequence through the backward's torch
    forward pass (reversed ones on flipped copies), initial and final states per sequence."""
    from rtkernels.methods.chunk import backward as kb

    bounds = cu.tolist()

    def run(q, k, v, log_decay, scale, out, initial_state, need_state, reverse, fp32_precision, packed):
        assert packed[0].tolist() == bounds
        states = []
        for s in range(len(bounds) - 1):
            lo, hi = bounds[s], bounds[s + 1]
            s0 = None if initial_state is None else initial_state[s:s + 1]
            if hi == lo:
                states.append(torch.zeros(1, *out.shape[1:2], q.shape[3], v.shape[3], dtype=F64) if s0 is None
                              else s0.to(F64))
                continue
            part = torch.empty_like(out[:, :, lo:hi])
            st = kb.forward_pass(q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], log_decay, scale, part, s0,
                                 True, reverse, on_kernel=False)
            out[:, :, lo:hi] = part
            states.append(st.to(F64))
        return torch.cat(states) if need_state else None

    return run


@pytest.mark.parametrize("with_s0", [True, False])
def test_packed_backward_assembles_the_gradients(monkeypatch, with_s0):
    """packed_backward (its three passes done per sequence in torch, fp64) against autograd through
    the torch varlen path: dq, dk, dv and d(initial_state), with a gradient on the final states."""
    from rtkernels.methods.chunk import packed

    lens = (0, 1, 63, 0, 64, 65, 200, 0)
    cu = offsets(lens)
    n = sum(lens)
    q, k, v, s0, gamma = packed_inputs = packed_inputs_f64(lens)
    if not with_s0:
        s0 = None
    log_decay = LogDecay(torch.device("cpu"), host=tuple(math.log(x) for x in GAMMAS))
    g = torch.Generator().manual_seed(5)
    w_out = torch.randn(1, H, n, DV, generator=g, dtype=F64)
    w_state = torch.randn(len(lens), H, DK, DV, generator=g, dtype=F64)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)] + ([s0.clone().requires_grad_()] if with_s0 else [])
    out, state = varlen.varlen_attention(*leaves[:3], cu, log_decay, SCALE, leaves[3] if with_s0 else None, True,
                                         True)
    want = torch.autograd.grad((out * w_out).sum() + (state * w_state).sum(), leaves)

    monkeypatch.setattr(packed, "forward_pass", _packed_pass_in_torch(cu))
    got = packed.packed_backward(q, k, v, log_decay, SCALE, s0, w_out, w_state, with_s0, "exact",
                                 packed.offsets(cu, n))
    for name, a, b in zip(("dq", "dk", "dv", "dinitial_state"), got, want):
        assert_close(a, b, F64, f"{name}: packed backward vs autograd of the torch path", n)
    if not with_s0:
        assert got[3] is None


#: Heads whose gamma is below eps^2 of the compute dtype (their G terms on the last token only)
#: beside ordinary ones.
EDGE_GAMMAS = (1e-45, 1e-20, 0.9, 1.0)


@pytest.mark.parametrize("layout", ("bhnd", "bnhd"))
@pytest.mark.parametrize("dtype", (F64, torch.float32), ids=str)
@pytest.mark.parametrize("scale", (1e6, 3e-6, 1e-7, -0.5), ids=lambda s: f"scale={s:g}")
def test_packed_final_state_gradient_at_the_edges(monkeypatch, scale, dtype, layout):
    """The G terms where they ride on the reversed passes (huge, tiny and negative scales), where they
    are torch products (1e-7), and on the last token of each sequence for heads whose gamma is too
    small to divide by, with empty sequences first, in the middle and last and gradients in either
    memory layout: packed_backward against autograd through the fp64 torch path."""
    from rtkernels.methods.chunk import packed

    lens = (0, 1, 63, 0, 65, 130, 0)
    cu = offsets(lens)
    n = sum(lens)
    g = torch.Generator().manual_seed(11)
    draw = lambda *shape: torch.randn(*shape, generator=g, dtype=F64)  # noqa: E731
    q, k, v = draw(1, H, n, DK) / math.sqrt(DK), draw(1, H, n, DK) / math.sqrt(DK), draw(1, H, n, DV)
    s0, w_out, w_state = draw(len(lens), H, DK, DV), draw(1, H, n, DV), draw(len(lens), H, DK, DV)
    lg = tuple(math.log(x) for x in EDGE_GAMMAS)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, s0)]
    out, state = varlen.varlen_attention(*leaves[:3], cu, LogDecay(torch.device("cpu"), host=lg), scale, leaves[3],
                                         True, True)
    want = torch.autograd.grad((out * w_out).sum() + (state * w_state).sum(), leaves)

    def given(x):  # the dtype, and [1, N, H, D] memory for bnhd
        x = x.to(dtype)
        return x if layout == "bhnd" else x.transpose(1, 2).contiguous().transpose(1, 2)

    monkeypatch.setattr(packed, "forward_pass", _packed_pass_in_torch(cu))
    got = packed.packed_backward(given(q), given(k), given(v), LogDecay(torch.device("cpu"), host=lg), scale,
                                 s0.to(dtype), given(w_out), w_state.to(dtype), True, "exact", packed.offsets(cu, n))
    for name, a, b in zip(("dq", "dk", "dv", "dinitial_state"), got, want):
        assert torch.isfinite(a).all(), f"{name}: not finite"
        assert_close(a, b, dtype, f"{name}: packed backward vs autograd of the torch path, scale={scale}", n)


def packed_inputs_f64(lens):
    q, k, v, s0, gamma = packed(lens, F64, "bhnd", seed=4)
    return q, k, v, s0, gamma


def test_packed_state_terms_against_a_loop():
    """dk_j += gamma^(e_s - j) v_j G[s]^T, dv_j += gamma^(e_s - j) k_j G[s], with empty sequences and
    gather blocks smaller than the batch."""
    from rtkernels.methods.chunk import packed

    lens = (3, 0, 5, 1, 0, 7)
    cu = offsets(lens)
    n = sum(lens)
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(1, H, n, DK, generator=g, dtype=F64), torch.randn(1, H, n, DV, generator=g, dtype=F64)
    gs = torch.randn(len(lens), H, DK, DV, generator=g, dtype=F64)
    lg = torch.log(torch.tensor(GAMMAS, dtype=F64))
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    old = packed.GATHER_BYTES
    packed.GATHER_BYTES = 2 * H * DK * DV * 8  # two tokens per block
    try:
        packed._state_terms(dk, dv, k, v, gs, lg, cu)
    finally:
        packed.GATHER_BYTES = old
    want_k, want_v = torch.zeros_like(k), torch.zeros_like(v)
    bounds = cu.tolist()
    for s in range(len(lens)):
        for j in range(bounds[s], bounds[s + 1]):
            w = torch.exp(lg * (bounds[s + 1] - 1 - j))[:, None]
            want_k[0, :, j] = w * torch.einsum("hv,hkv->hk", v[0, :, j], gs[s])
            want_v[0, :, j] = w * torch.einsum("hk,hkv->hv", k[0, :, j], gs[s])
    torch.testing.assert_close(dk, want_k, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dv, want_v, rtol=1e-12, atol=1e-12)


def test_cpu_inputs_never_take_the_kernel_path(monkeypatch):
    from rtkernels.methods.chunk import packed

    def no(*args, **kwargs):
        raise AssertionError("the packed kernel path ran for CPU inputs")

    monkeypatch.setattr(packed, "packed_attention", no)
    q, k, v, s0, gamma = packed_inputs_f64((3, 4))
    rtkernels.causal_linear_attention(q.float(), k.float(), v.float(), gamma, cu_seqlens=offsets((3, 4)))
