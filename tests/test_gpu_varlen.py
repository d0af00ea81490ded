"""Packed variable-length batches on the GPU (marker ``gpu``; ``cu_seqlens``, rtkernels.varlen): outputs,
final states and every gradient against the fp64 reference run per sequence and against one ordinary
call per sequence (the kernels), in bf16, fp16 and fp32; forward and backward under
``torch.cuda.set_sync_debug_mode("error")`` (no host sync); a CUDA-graph capture replayed equal to an
eager call; invalid offsets on the device giving NaN. CUDA fp16/bf16/fp32 calls with a decay that
does not require grad run the chunk kernels (rtkernels.methods.chunk.packed; the tests at the end
check that they ran, forward and backward, Dk != Dv, with and without states)."""

from __future__ import annotations

import math

import pytest
import torch

import rtkernels
from graphs import capture
from reference import reference
from tolerances import assert_close, assert_close_to_magnitude
from inputs import run_without_host_sync

pytestmark = pytest.mark.gpu

F64 = torch.float64
GAMMAS = (1e-6, 0.9, 0.99, 1.0)
H, DK, DV = len(GAMMAS), 64, 48
LENS = (0, 1, 63, 0, 64, 65, 2000, 0)
N = sum(LENS)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: What the kernel_path fixture records for a forward and backward on the kernels: forward, dq, then
#: dk and dv reversed, or one walk for both (tests/test_gpu_fused_dk_dv.py holds where).
BACKWARD_PASSES = ([False, False, True, True], [False, False, "dk+dv"])
SCALE = 0.75


def offsets(lens, dtype=torch.int32) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=dtype, device="cuda")


def packed(dtype, layout="bhnd", seed=0, lens=LENS):
    """q, k, v ``[1, H, N, D]`` (or ``[1, N, H, D]``) in ``dtype``, fp32 ``[S, H, Dk, Dv]`` initial
    states and an fp32 gamma tensor, all on the GPU."""
    n = sum(lens)
    g = torch.Generator().manual_seed(seed)

    def draw(*shape, std=1.0):
        x = torch.randn(shape, generator=g, dtype=F64) * std
        return x if layout == "bhnd" or len(shape) != 4 else x.transpose(1, 2).contiguous()

    q = draw(1, H, n, DK, std=DK ** -0.5).to("cuda", dtype)
    k = draw(1, H, n, DK, std=DK ** -0.5).to("cuda", dtype)
    v = draw(1, H, n, DV).to("cuda", dtype)
    s0 = (torch.randn(len(lens), H, DK, DV, generator=g, dtype=F64) * DK ** -0.5).to("cuda", torch.float32)
    return q, k, v, s0, torch.tensor(GAMMAS, dtype=torch.float32, device="cuda")


def per_sequence(fn, q, k, v, s0, layout, lens=LENS):
    """``fn(q_s, k_s, v_s, s0_s) -> (output, state)`` per non-empty sequence (an empty one keeps its
    state); the outputs end to end and the states stacked, in float64."""
    dim = 2 if layout == "bhnd" else 1
    outs, states, lo = [], [], 0
    for s, n in enumerate(lens):
        if n == 0:
            states.append(s0[s].double())
            continue
        o, st = fn(*(x.narrow(dim, lo, n) for x in (q, k, v)), s0[s:s + 1])
        outs.append(o.double())
        states.append(st[0].double())
        lo += n
    return torch.cat(outs, dim), torch.stack(states)


def varlen(q, k, v, s0, gamma, layout, cu=None):
    return rtkernels.causal_linear_attention(q, k, v, gamma, scale=SCALE, layout=layout, initial_state=s0,
                                             return_state=True, cu_seqlens=offsets(LENS) if cu is None else cu)


def fp64_reference(q, k, v, s0, gamma, layout):
    return per_sequence(lambda a, b, c, s: reference(a, b, c, gamma, SCALE, layout, s), q, k, v, s0, layout)


def ordinary(q, k, v, s0, gamma, layout):
    return per_sequence(lambda a, b, c, s: rtkernels.causal_linear_attention(
        a, b, c, gamma, scale=SCALE, layout=layout, initial_state=s, return_state=True), q, k, v, s0, layout)


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_outputs_and_states(dtype, layout):
    q, k, v, s0, gamma = packed(dtype, layout)
    out, state = varlen(q, k, v, s0, gamma, layout)
    assert out.dtype == dtype and out.shape == q.shape[:3] + (DV,) and out.is_contiguous()
    assert state.dtype == torch.float32 and state.shape == (len(LENS), H, DK, DV)
    ro, rs = fp64_reference(q, k, v, s0, gamma, layout)
    assert_close(out, ro, dtype, "output vs fp64 reference", N)
    # these calls run the chunk kernels, whose 16-bit state products round the decay-weighted keys
    # to the input dtype: the states are as accurate as the dtype (the torch path's: fp32)
    assert_close(state, rs, dtype, "states vs fp64 reference", N)
    oo, os_ = ordinary(q, k, v, s0, gamma, layout)
    assert_close(out, oo, dtype, "output vs one call per sequence", N)
    # the 16-bit kernel rounds the decay-weighted keys to the input dtype before its state products
    # (the varlen path keeps them in fp32), so two fp32 states agree only to the input's precision
    assert_close(state, os_, dtype, "states vs one call per sequence", N)


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gradients(monkeypatch, dtype, layout):
    """dq, dk, dv, d(initial_state) and d(gamma) (a CUDA tensor) from the outputs and the states, on
    the torch path (its fp32 accuracy; bf16 on Hopper would run the kernels, whose trainable-decay
    test is test_kernel_path_trainable_decay)."""
    from rtkernels.methods.chunk import packed as kp

    monkeypatch.setattr(kp, "takes", lambda *args: False)
    q, k, v, s0, gamma = packed(dtype, layout, seed=1)
    g = torch.Generator().manual_seed(2)
    # representable in dtype: the gradient reaching a 16-bit output is rounded to it
    w_out = torch.randn(q.shape[:3] + (DV,), generator=g, dtype=F64).to(dtype).to("cuda", F64)
    w_state = torch.randn(tuple(s0.shape), generator=g, dtype=F64).to("cuda")

    def grads(run):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, s0, gamma)]
        out, state = run(*leaves, layout)
        loss = (out.double() * w_out).sum() + (state.double() * w_state).sum()
        return torch.autograd.grad(loss, leaves)

    got, want, calls = grads(varlen), grads(fp64_reference), grads(ordinary)
    for i, name in enumerate(("dq", "dk", "dv", "dinitial_state", "dgamma")):
        tol = dtype if i < 3 else torch.float32  # the state and the decay are accumulated in fp32
        assert got[i].dtype == (q, k, v, s0, gamma)[i].dtype, name
        assert_close(got[i], want[i], tol, f"{name} vs fp64 reference", N)
        if i < 4:  # (the kernel backward's dgamma has its own tests)
            assert_close(got[i], calls[i], dtype, f"{name} vs one call per sequence", N)


def test_no_host_sync_forward_and_backward():
    """CUDA offsets, a trainable CUDA gamma and initial states: nothing syncs the host."""
    q, k, v, s0, gamma = packed(torch.bfloat16, "bnhd")
    leaves = [x.requires_grad_() for x in (q, k, v, s0, gamma)]
    cu = offsets(LENS)

    def step():
        out, state = varlen(q, k, v, s0, gamma, "bnhd", cu)
        (out.float().sum() + state.sum()).backward()

    run_without_host_sync(step)  # once outside the check (compiles, plans), once under it
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in leaves)


def test_cuda_graph_capture_replays_equal_to_eager():
    """Captured once; replayed after new q and new offsets (same S) are copied in: equal to eager."""
    q, k, v, s0, gamma = packed(torch.bfloat16)
    cu = offsets(LENS)
    graph, (out, state) = capture(lambda: varlen(q, k, v, s0, gamma, "bhnd", cu))
    for lens in (LENS, (2000, 0, 1, 63, 64, 65, 0, 0), (N - 7, 7, 0, 0, 0, 0, 0, 0)):
        cu.copy_(offsets(lens))
        q.copy_(torch.randn_like(q))
        graph.replay()
        torch.cuda.synchronize()
        eager_out, eager_state = varlen(q, k, v, s0, gamma, "bhnd", cu)
        assert torch.equal(out, eager_out), f"replay differs from the eager call ({lens})"
        torch.testing.assert_close(state, eager_state, rtol=1e-5, atol=1e-5)
        ro, _ = per_sequence(lambda a, b, c, s: reference(a, b, c, gamma, SCALE, "bhnd", s), q, k, v, s0, "bhnd",
                             lens)
        assert_close(out, ro, torch.bfloat16, f"replay {lens}", N)


@pytest.mark.parametrize("cu", [[0, 50, 10, N], [3, 60, N], [0, 60, N - 1], [0, 60, 1 << 40]],
                         ids=["decreasing", "late-start", "short-end", "huge"])
def test_invalid_offsets_give_nan(cu):
    """Values on the device are never read on the host: invalid ones give NaN, no fault."""
    q, k, v, s0, gamma = packed(torch.float16, lens=(N,) + (0,) * (len(cu) - 2))
    out, state = rtkernels.causal_linear_attention(q, k, v, gamma, initial_state=s0, return_state=True,
                                                   cu_seqlens=torch.tensor(cu, device="cuda"))
    torch.cuda.synchronize()
    assert torch.isnan(out).all() and torch.isnan(state).all()


def test_errors_on_the_device():
    q, k, v, _, _ = packed(torch.float32, lens=(5, 6))
    with pytest.raises(ValueError, match=r"cu_seqlens must be on the device of q \(cuda:0\), got cpu"):
        rtkernels.causal_linear_attention(q, k, v, cu_seqlens=torch.tensor([0, 5, 11]))
    with pytest.raises(ValueError, match="initial_state must be on the device of q"):
        rtkernels.causal_linear_attention(q, k, v, cu_seqlens=offsets((5, 6)),
                                          initial_state=torch.zeros(2, H, DK, DV))
    assert math.isfinite(float(rtkernels.causal_linear_attention(q, k, v, cu_seqlens=offsets((5, 6))).sum()))


# ---- the chunk kernels' packed path (rtkernels.methods.chunk.packed) ------------------------------

#: The lengths of the kernel tests: one token, around the chunk size, an empty one, a long one.
KLENS = (1, 63, 64, 65, 0, 2000)
KN = sum(KLENS)


@pytest.fixture
def kernel_path(monkeypatch):
    """The torch varlen path raises; the packed kernel passes are counted (one per forward, three
    per backward, or two where dk and dv run as one walk: recorded as "dk+dv", else as the pass's
    ``reverse`` flag)."""
    from rtkernels import varlen as torch_varlen
    from rtkernels.methods.chunk import packed as kp

    def no_torch_path(*args, **kwargs):
        raise AssertionError("the torch varlen path ran where the chunk kernels should")

    passes = []
    real = kp.forward_pass

    def counted(*args, **kwargs):
        passes.append("dk+dv" if kwargs.get("dual") is not None else args[8])  # else: reverse
        return real(*args, **kwargs)

    monkeypatch.setattr(torch_varlen, "varlen_attention", no_torch_path)
    monkeypatch.setattr(kp, "forward_pass", counted)
    return passes


def kernel_inputs(dtype, dk, dv, layout, seed=0, lens=KLENS):
    """q, k, v in ``layout`` (batch 1), fp32 ``[S, H, Dk, Dv]`` initial states, an fp32 gamma tensor."""
    n = sum(lens)
    g = torch.Generator().manual_seed(seed)

    def draw(d, std):
        x = torch.randn(1, H, n, d, generator=g, dtype=F64) * std
        return (x if layout == "bhnd" else x.transpose(1, 2).contiguous()).to("cuda", dtype)

    q, k, v = draw(dk, dk ** -0.5), draw(dk, dk ** -0.5), draw(dv, 1.0)
    s0 = (torch.randn(len(lens), H, dk, dv, generator=g, dtype=F64) * dk ** -0.5).to("cuda", torch.float32)
    return q, k, v, s0, torch.tensor(GAMMAS, dtype=torch.float32, device="cuda")


def kernel_call(q, k, v, s0, gamma, layout, stateful, lens=KLENS, cu_dtype=torch.int32):
    res = rtkernels.causal_linear_attention(q, k, v, gamma, scale=SCALE, layout=layout,
                                            initial_state=s0 if stateful else None, return_state=stateful,
                                            cu_seqlens=offsets(lens, cu_dtype))
    return res if stateful else (res, None)


def split_call(fn, q, k, v, s0, layout, stateful, lens=KLENS):
    """``fn(q_s, k_s, v_s, s0_s or None, return_state)`` per non-empty sequence: outputs end to end,
    states stacked (an empty sequence keeps its initial state, or zeros)."""
    dim = 2 if layout == "bhnd" else 1
    outs, states, lo = [], [], 0
    for s, n in enumerate(lens):
        if n == 0:
            states.append(s0[s] if stateful else None)
            continue
        o, st = fn(*(x.narrow(dim, lo, n) for x in (q, k, v)), s0[s:s + 1] if stateful else None, stateful)
        outs.append(o)
        states.append(st[0] if stateful else None)
        lo += n
    return torch.cat(outs, dim), (torch.stack(states) if stateful else None)


def _by_reference(gamma, layout):
    def run(a, b, c, s, stateful):
        return reference(a, b, c, gamma, SCALE, layout, s)
    return run


def _by_ordinary_call(gamma, layout):
    def run(a, b, c, s, stateful):
        res = rtkernels.causal_linear_attention(a, b, c, gamma, scale=SCALE, layout=layout, initial_state=s,
                                                return_state=stateful)
        return res if stateful else (res, None)
    return run


@pytest.mark.parametrize("stateful", [True, False], ids=["states", "no-states"])
@pytest.mark.parametrize("dims, layout", [((64, 96), "bhnd"), ((37, 200), "bnhd"), ((128, 64), "bnhd")],
                         ids=["64x96", "37x200", "128x64"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_path_against_separate_calls_and_fp64(kernel_path, dtype, dims, layout, stateful):
    """Outputs, final states and the gradients of q, k, v and the initial states on the kernels,
    against one ordinary call per sequence and the fp64 reference per sequence."""
    dk, dv = dims
    q, k, v, s0, gamma = kernel_inputs(dtype, dk, dv, layout)
    g = torch.Generator().manual_seed(9)
    w_out = torch.randn(q.shape[:3] + (dv,), generator=g, dtype=F64).to(dtype).to("cuda", F64)
    w_state = torch.randn(len(KLENS), H, dk, dv, generator=g, dtype=F64).to("cuda")

    def run(fn):
        leaves = [x.detach().clone().requires_grad_() for x in ((q, k, v, s0) if stateful else (q, k, v))]
        qq, kk, vv = leaves[:3]
        ss = leaves[3] if stateful else s0
        out, state = fn(qq, kk, vv, ss)
        loss = (out.double() * w_out).sum()
        if stateful:
            loss = loss + (state.double() * w_state).sum()
        return out.detach(), None if state is None else state.detach(), torch.autograd.grad(loss, leaves)

    out, state, grads = run(lambda a, b, c, s: kernel_call(a, b, c, s, gamma, layout, stateful))
    assert kernel_path in BACKWARD_PASSES, "one forward and the backward's passes on the kernels"
    assert out.dtype == dtype and out.shape == q.shape[:3] + (dv,) and out.is_contiguous()
    ro, rs, rg = run(lambda a, b, c, s: split_call(_by_reference(gamma, layout), a, b, c, s, layout, stateful))
    oo, os_, og = run(lambda a, b, c, s: split_call(_by_ordinary_call(gamma, layout), a, b, c, s, layout, stateful))
    assert_close(out, ro, dtype, "output vs fp64 reference", KN)
    assert_close(out, oo, dtype, "output vs one call per sequence", KN)
    if stateful:
        assert state.dtype == torch.float32 and state.shape == (len(KLENS), H, dk, dv)
        assert torch.equal(state[4], s0[4]), "an empty sequence returns its initial state"
        assert_close(state, rs, dtype, "states vs fp64 reference", KN)
        assert_close(state, os_, dtype, "states vs one call per sequence", KN)
    for name, a, b, c in zip(("dq", "dk", "dv", "dinitial_state"), grads, rg, og):
        assert_close(a, b, dtype, f"{name} vs fp64 reference", KN)
        assert_close(a, c, dtype, f"{name} vs one call per sequence", KN)


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_path_final_state_gradient_with_tiny_gammas(kernel_path, dtype, layout):
    """The final states' gradient rides on the reversed passes, except for heads whose gamma is below
    eps^2 of fp32 (1e-30, 1e-20), which take it on each sequence's last token: every gradient
    against the fp64 reference per sequence, with empty sequences and either memory layout."""
    lens = (0, 1, 63, 0, 65, 130, 0)
    q, k, v, s0, _ = kernel_inputs(dtype, 40, 72, layout, seed=12, lens=lens)
    gamma = torch.tensor((1e-30, 1e-20, 0.9, 1.0), dtype=torch.float32, device="cuda")
    g = torch.Generator().manual_seed(13)
    w_out = torch.randn(q.shape[:3] + (72,), generator=g, dtype=F64).to(dtype).to("cuda", F64)
    w_state = torch.randn(len(lens), H, 40, 72, generator=g, dtype=F64).to("cuda")

    def grads(fn):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, s0)]
        out, state = fn(*leaves)
        return torch.autograd.grad((out.double() * w_out).sum() + (state.double() * w_state).sum(), leaves)

    got = grads(lambda a, b, c, s: kernel_call(a, b, c, s, gamma, layout, True, lens))
    assert kernel_path in BACKWARD_PASSES, "one forward and the backward's passes on the kernels"
    want = grads(lambda a, b, c, s: split_call(_by_reference(gamma.double(), layout), a, b, c, s, layout, True,
                                               lens))
    for name, a, b in zip(("dq", "dk", "dv", "dinitial_state"), got, want):
        assert torch.isfinite(a).all(), f"{name}: not finite"
        assert_close(a, b, dtype, f"{name} vs fp64 reference", sum(lens))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_path_equals_the_torch_path(dtype):
    """The kernels and rtkernels.varlen's torch path (run directly) agree; int64 offsets."""
    from rtkernels import varlen as torch_varlen
    from rtkernels.decay import LogDecay

    q, k, v, s0, gamma = kernel_inputs(dtype, 64, 96, "bhnd", seed=3)
    out, state = kernel_call(q, k, v, s0, gamma, "bhnd", True, cu_dtype=torch.int64)
    log_decay = LogDecay(q.device, host=tuple(math.log(x) for x in GAMMAS))
    to, ts = torch_varlen.varlen_attention(q, k, v, offsets(KLENS), log_decay, SCALE, s0, True, False)
    ro, rs = split_call(_by_reference(gamma, "bhnd"), q, k, v, s0, "bhnd", True)
    assert_close(out, ro, dtype, "kernels vs fp64", KN)
    assert_close(to, ro, dtype, "torch path vs fp64", KN)
    assert_close(out.double(), to.double(), dtype, "kernels vs torch path", KN)
    assert_close(state, ts, dtype, "kernel states vs torch path states", KN)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_path_no_host_sync(kernel_path, dtype):
    """Forward and backward on the kernels (q, k, v and the initial states require grad, a CUDA
    gamma that does not) under set_sync_debug_mode("error")."""
    q, k, v, s0, gamma = kernel_inputs(dtype, 64, 96, "bnhd", seed=4)
    leaves = [x.requires_grad_() for x in (q, k, v, s0)]
    cu = offsets(KLENS)

    def step():
        out, state = rtkernels.causal_linear_attention(q, k, v, gamma, layout="bnhd", initial_state=s0,
                                                       return_state=True, cu_seqlens=cu)
        (out.float().sum() + state.sum()).backward()

    run_without_host_sync(step)
    assert len(kernel_path) == 8
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in leaves)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_path_cuda_graph_replays_equal_to_eager(kernel_path, dtype):
    """The kernel forward captured once, replayed with new offsets (same S) and new q."""
    q, k, v, s0, gamma = kernel_inputs(dtype, 37, 200, "bhnd", seed=5)
    cu = offsets(KLENS)
    call = lambda: rtkernels.causal_linear_attention(q, k, v, gamma, scale=SCALE, initial_state=s0,  # noqa: E731
                                                     return_state=True, cu_seqlens=cu)
    graph, (out, state) = capture(call)
    for lens in (KLENS, (2000, 0, 1, 63, 64, 65), (KN - 7, 7, 0, 0, 0, 0)):
        cu.copy_(offsets(lens))
        q.copy_(torch.randn_like(q) * 37 ** -0.5)
        graph.replay()
        torch.cuda.synchronize()
        eager_out, eager_state = call()
        assert torch.equal(out, eager_out), f"replay differs from the eager call ({lens})"
        assert torch.equal(state, eager_state), f"replayed states differ from the eager call ({lens})"
        ro, rs = split_call(_by_reference(gamma, "bhnd"), q, k, v, s0, "bhnd", True, lens)
        assert_close(out, ro, dtype, f"replay {lens}", KN)
        assert_close(state, rs, dtype, f"replayed states {lens}", KN)


def test_kernel_path_backward_captured_in_a_cuda_graph(kernel_path):
    """Forward and backward (torch.autograd.grad) captured together, replayed equal to eager."""
    q, k, v, s0, gamma = kernel_inputs(torch.bfloat16, 64, 96, "bhnd", seed=6)
    cu = offsets(KLENS)
    leaves = [x.requires_grad_() for x in (q, k, v, s0)]

    def step():
        out, state = rtkernels.causal_linear_attention(q, k, v, gamma, initial_state=s0, return_state=True,
                                                       cu_seqlens=cu)
        return torch.autograd.grad(out.float().sum() + (state * state).sum(), leaves)

    graph, captured = capture(step)
    cu.copy_(offsets((2000, 0, 1, 63, 64, 65)))
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(captured, step()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("cu", [[0, 50, 10, KN], [3, 60, KN], [0, 60, KN - 1], [0, 60, 1 << 40], [-5, 60, KN]],
                         ids=["decreasing", "late-start", "short-end", "huge", "negative"])
def test_kernel_path_invalid_offsets_give_nan(kernel_path, dtype, cu):
    """Invalid device offsets on the kernels: every output, state and gradient NaN, no fault."""
    q, k, v, s0, gamma = kernel_inputs(dtype, 64, 96, "bhnd", lens=(KN,))
    s0 = s0.repeat(len(cu) - 1, 1, 1, 1)
    leaves = [x.requires_grad_() for x in (q, k, v, s0)]
    out, state = rtkernels.causal_linear_attention(q, k, v, gamma, initial_state=s0, return_state=True,
                                                   cu_seqlens=torch.tensor(cu, device="cuda"))
    grads = torch.autograd.grad(out.float().sum() + state.sum(), leaves)
    torch.cuda.synchronize()
    assert torch.isnan(out).all() and torch.isnan(state).all()
    assert all(torch.isnan(g).all() for g in grads)


# ------------------------------------------------------------------ a trainable decay on the kernels

def outputs_per_sequence(fn, q, k, v, s0, layout, lens=KLENS):
    """``fn(q_s, k_s, v_s, s0_s or None) -> output`` per non-empty sequence, end to end."""
    dim = 2 if layout == "bhnd" else 1
    outs, lo = [], 0
    for s, n in enumerate(lens):
        if n:
            outs.append(fn(*(x.narrow(dim, lo, n) for x in (q, k, v)), None if s0 is None else s0[s:s + 1]))
            lo += n
    return torch.cat(outs, dim)


@pytest.mark.parametrize("stateful", [False, True], ids=["out", "out+states"])
@pytest.mark.parametrize("with_s0", [True, False], ids=["s0", "no-s0"])
@pytest.mark.parametrize("form", ["decay", "decay_rate"])
@pytest.mark.parametrize("dims, layout", [((64, 96), "bhnd"), ((40, 72), "bnhd"), ((200, 40), "bhnd"),
                                          ((128, 128), "bnhd")], ids=["64x96", "40x72", "200x40", "128x128"])
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
def test_kernel_path_trainable_decay(kernel_path, dtype, dims, layout, form, with_s0, stateful):
    """A CUDA decay tensor that requires grad, bf16 and fp16: the forward and the three backward passes on
    the kernels, the dq pass summing dL/dgamma (dL/dr for rates) over the packed sequences (empty
    ones, 1, 63, 64, 65 and 2000 tokens; gamma 1e-6, 0.9, 0.99, 1); ``stateful``: the final states
    are returned and in the loss too (their term <G[s], W_end> per sequence). Against the fp64
    reference per sequence (the decay gradient within the dtype's tolerance of its magnitude: the
    same sums over absolute values) and against one ordinary call per sequence; dq, dk, dv and
    d(initial state) as without a trainable decay."""
    dk, dv = dims
    q, k, v, s0, gamma = kernel_inputs(dtype, dk, dv, layout, seed=3)
    decay = gamma if form == "decay" else -torch.log(gamma)
    gen = torch.Generator().manual_seed(10)
    w_out = torch.randn(q.shape[:3] + (dv,), generator=gen, dtype=F64).to(dtype).to("cuda", F64)
    w_state = torch.randn(len(KLENS), H, dk, dv, generator=gen, dtype=F64).to("cuda")

    def grads(fn, absolute=False):
        xs = [*(x.abs() if absolute else x for x in (q, k, v, s0)), decay]
        leaves = [x.detach().clone().requires_grad_() for x in (xs if with_s0 else xs[:3] + xs[4:])]
        qq, kk, vv, *rest = leaves
        out, state = fn(qq, kk, vv, rest[0] if with_s0 else None, rest[-1])
        loss = (out.double() * (w_out.abs() if absolute else w_out)).sum()
        if stateful:
            loss = loss + (state.double() * (w_state.abs() if absolute else w_state)).sum()
        return out.detach(), torch.autograd.grad(loss, leaves)

    def kernels(a, b, c, s, d):
        res = rtkernels.causal_linear_attention(a, b, c, scale=SCALE, layout=layout, initial_state=s,
                                                return_state=stateful, cu_seqlens=offsets(KLENS), **{form: d})
        return res if stateful else (res, None)

    def per_seq(run, a, b, c, s):  # run(q_s, k_s, v_s, s0_s or None) -> (out, state)
        init = s if s is not None else torch.zeros(len(KLENS), H, dk, dv, device="cuda")
        return split_call(lambda x, y, z, t, st: run(x, y, z, t if s is not None else None), a, b, c, init,
                          layout, True)

    def fp64(a, b, c, s, d):
        g = d.double() if form == "decay" else torch.exp(-d.double())
        return per_seq(lambda x, y, z, t: reference(x, y, z, g, SCALE, layout, t), a, b, c, s)

    def calls(a, b, c, s, d):
        return per_seq(lambda x, y, z, t: rtkernels.causal_linear_attention(
            x, y, z, scale=SCALE, layout=layout, initial_state=t, return_state=True, **{form: d}), a, b, c, s)

    out, got = grads(kernels)
    assert kernel_path in BACKWARD_PASSES, "one forward and the backward's passes on the kernels"
    ro, want = grads(fp64)
    _, mag = grads(fp64, absolute=True)
    _, each = grads(calls)
    assert_close(out, ro, dtype, "output vs fp64 reference", KN)
    names = ("dq", "dk", "dv", "dinitial_state")[:3 + with_s0] + (f"d{form}",)
    for name, a, b, c, m in zip(names, got, want, each, mag):
        if name.startswith("dd"):
            assert a.dtype == decay.dtype and a.shape == decay.shape
            assert_close_to_magnitude(a, b, m, dtype, f"{name} vs fp64 reference", KN)
            assert_close_to_magnitude(a, c.double(), m, dtype, f"{name} vs one call per sequence", KN)
        else:
            assert_close(a, b, dtype, f"{name} vs fp64 reference", KN)
            assert_close(a, c.double(), dtype, f"{name} vs one call per sequence", KN)


def test_kernel_path_trainable_decay_no_sync_and_graph(kernel_path):
    """A trainable decay on the kernels: forward and backward with no host sync, and captured in a
    CUDA graph, replayed after new offsets (same S) and a new decay equal to eager, bit for bit."""
    q, k, v, s0, gamma = kernel_inputs(torch.bfloat16, 64, 96, "bnhd", seed=7)
    cu = offsets(KLENS)
    decay = gamma.clone().requires_grad_()
    leaves = [x.requires_grad_() for x in (q, k, v, s0)] + [decay]

    def step():
        out = rtkernels.causal_linear_attention(q, k, v, decay, layout="bnhd", initial_state=s0, cu_seqlens=cu)
        return torch.autograd.grad(out.float().sum(), leaves)

    run_without_host_sync(step)
    graph, captured = capture(step)
    cu.copy_(offsets((2000, 0, 1, 63, 64, 65)))
    with torch.no_grad():
        decay.copy_(torch.tensor([0.5, 0.95, 0.999, 1.0]))
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(captured, step()):
        assert torch.equal(a, b)
    assert torch.isfinite(captured[-1]).all()


def test_kernel_path_trainable_decay_invalid_offsets_give_nan(kernel_path):
    """Invalid device offsets with a trainable decay: the output and every gradient NaN, the decay's too."""
    q, k, v, _, gamma = kernel_inputs(torch.bfloat16, 64, 96, "bhnd", lens=(KN,))
    decay = gamma.clone().requires_grad_()
    leaves = [x.requires_grad_() for x in (q, k, v)] + [decay]
    out = rtkernels.causal_linear_attention(q, k, v, decay, cu_seqlens=torch.tensor([0, 50, 10, KN], device="cuda"))
    grads = torch.autograd.grad(out.float().sum(), leaves)
    assert torch.isnan(out).all() and all(torch.isnan(g).all() for g in grads)


@pytest.mark.parametrize("case", ["fp32", "unaligned"])
def test_trainable_decay_elsewhere_runs_the_torch_path(monkeypatch, case):
    """Where the dq pass cannot sum dlog(gamma) (float32, rows not 16-byte aligned), a packed call
    with a trainable decay runs the torch path, with the right gradient."""
    from rtkernels import varlen as torch_varlen

    ran, real = [], torch_varlen.varlen_attention
    monkeypatch.setattr(torch_varlen, "varlen_attention", lambda *a, **kw: ran.append(1) or real(*a, **kw))
    dtype = torch.float32 if case == "fp32" else torch.bfloat16
    q, k, v, s0, gamma = kernel_inputs(dtype, 37 if case == "unaligned" else 64, 96, "bhnd", lens=(65, 0, 200))
    decay = gamma.clone().requires_grad_()
    out = rtkernels.causal_linear_attention(q, k, v, decay, cu_seqlens=offsets((65, 0, 200)))
    (got,) = torch.autograd.grad(out.float().sum(), [decay])
    assert ran == [1]
    g = gamma.double().requires_grad_()
    ref = outputs_per_sequence(lambda x, y, z, t: reference(x, y, z, g, 1.0, "bhnd", None)[0], q, k, v, None,
                               "bhnd", lens=(65, 0, 200))
    (want,) = torch.autograd.grad(ref.sum(), [g])
    assert_close(got, want, torch.bfloat16, "dgamma vs fp64 reference", 265)


def test_kernel_path_trainable_decay_unaligned_output_gradient(kernel_path):
    """dL/do given as a contiguous view 2 bytes off 16-byte alignment: the dq pass that sums
    dlog(gamma) reads it by 16-byte copies, so it takes an aligned copy; the gradients match those
    from an aligned dL/do (to bf16 rounding: the other passes may take unaligned kernels)."""
    q, k, v, _, gamma = kernel_inputs(torch.bfloat16, 64, 96, "bhnd", seed=8)
    g = torch.randn(q.shape[:3] + (96,), generator=torch.Generator().manual_seed(2)).to("cuda", torch.bfloat16)
    shifted = torch.empty(g.numel() + 1, dtype=g.dtype, device="cuda")[1:].view(g.shape)
    shifted.copy_(g)
    assert shifted.is_contiguous() and shifted.data_ptr() % 16

    def grads(dout):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, gamma)]
        out = rtkernels.causal_linear_attention(*leaves, cu_seqlens=offsets(KLENS))
        return torch.autograd.grad(out, leaves, dout)

    for name, a, b in zip(("dq", "dk", "dv", "dgamma"), grads(g), grads(shifted)):
        assert torch.isfinite(b).all()
        assert_close(b, a.double(), torch.bfloat16, f"{name}: unaligned dL/do vs aligned", KN)
