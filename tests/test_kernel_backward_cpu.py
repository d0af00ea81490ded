"""The backward built from three forward passes (rtkernels/methods/chunk/backward.py), on the CPU.

Without the kernel, :func:`~rtkernels.kernel_backward.forward_pass` runs the torch ``chunk`` path on
flipped tensors, so these fp64 tests check the decomposition itself (the reversed passes, the
final-state terms, dS_0, the shared dlog(gamma)) against ``torch_backward``, against autograd through
the fp64 reference and with gradcheck. tests/test_gpu_kernel_backward.py checks the kernel's
reversed passes on a GPU.
"""

from __future__ import annotations

import math
from typing import Optional

import pytest
import torch

import rtkernels
import rtkernels.autograd as rk_autograd
import test_grad_cpu as grad_cpu
from inputs import backward_inputs, randn
from reference import reference
from rtkernels.decay import LogDecay
from rtkernels.methods.chunk.backward import forward_pass, kernel_backward, supports
from tolerances import assert_close

F64 = torch.float64
#: One head per decay: forgets at once, halves, keeps almost everything, keeps everything.
GAMMAS = (1e-6, 0.5, 0.999999, 1.0)
NS = (1, 63, 65, 130)
#: (Dk, Dv), never equal
SIZES = [(3, 16), (16, 40), (40, 3)]
#: (initial state given, gradient of the returned final state given)
STATES = [(False, False), (True, False), (False, True), (True, True)]
NAMES = ("q", "k", "v", "initial_state", "log_decay")


@pytest.fixture
def kernel_impl(monkeypatch):
    """Every backward of this test through kernel_backward (on the CPU the registry would pick
    torch_backward)."""
    monkeypatch.setattr(rk_autograd, "BACKWARD_IMPLS", [(lambda q, v: True, kernel_backward)])


def _inputs(seed: int, n: int, dk: int, dv: int, with_s0: bool, with_g: bool, b: int = 2):
    return backward_inputs(seed, b, len(GAMMAS), n, dk, dv, with_s0, with_g)


def _log_decay() -> LogDecay:
    return LogDecay(torch.device("cpu"), host=tuple(math.log(x) for x in GAMMAS))


@pytest.mark.parametrize("scale", (0.5, 0.0))
@pytest.mark.parametrize("states", STATES, ids=lambda s: f"s0={int(s[0])}-G={int(s[1])}")
@pytest.mark.parametrize("sizes", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("n", NS)
def test_matches_torch_backward(n, sizes, states, scale):
    """Every gradient of kernel_backward equals torch_backward's (fp64, to rounding)."""
    q, k, v, g, s0, g_state = _inputs(n, n, *sizes, *states)
    ld = _log_decay()
    got = kernel_backward(q, k, v, ld, scale, s0, g, g_state, s0 is not None, True)
    want = rk_autograd.torch_backward(q, k, v, ld, scale, s0, g, g_state, s0 is not None, True)
    for name, x, r in zip(NAMES, got, want):
        if r is None:
            assert x is None, f"d{name} given where not asked for"
            continue
        assert x.dtype == F64 and x.shape == r.shape, f"d{name}: {x.dtype} {tuple(x.shape)}"
        assert_close(x, r, F64, f"d{name} n={n} {sizes} {states} scale={scale}", n=n)


#: Decays at the edges of the final-state gradient's route (backward.py: X = G / (scale gamma) as
#: the reversed passes' initial state): 1e-45 is below fp64's eps^2 (its G terms on the last token
#: only), 1e-20 above it but below fp32's, and 0.9 where a wrong power of gamma shows.
EDGE_GAMMAS = (1e-45, 1e-20, 0.9, 1.0)


@pytest.mark.parametrize("dtype", (F64, torch.float32), ids=str)
@pytest.mark.parametrize("scale", (1e6, 3e-6, 1e-7, -0.5), ids=lambda s: f"scale={s:g}")
@pytest.mark.parametrize("n", (1, 65, 130))
def test_final_state_gradient_at_the_edges(n, scale, dtype):
    """The G terms where they ride on the reversed passes (|scale| >= 2^-20: huge, tiny and negative
    scales) and where they are torch products (1e-7), with heads whose gamma is too small to divide by
    in the compute dtype: kernel_backward equals torch_backward."""
    q, k, v, g, s0, g_state = (None if x is None else x.to(dtype)
                               for x in backward_inputs(n, 2, len(EDGE_GAMMAS), n, 16, 40, True, True))
    ld = LogDecay(torch.device("cpu"), host=tuple(math.log(x) for x in EDGE_GAMMAS))
    got = kernel_backward(q, k, v, ld, scale, s0, g, g_state, True, False)
    want = rk_autograd.torch_backward(q, k, v, ld, scale, s0, g, g_state, True, False)
    for name, x, r in zip(NAMES[:4], got, want):
        assert_close(x, r, dtype, f"d{name} n={n} scale={scale} {dtype}", n=n)


def test_nan_in_the_final_state_gradient_stays_in_its_head():
    """NaN in one head's G makes that head's dk, dv and dS_0 NaN (never a plausible number) and leaves
    the other heads' gradients as they were."""
    q, k, v, g, s0, g_state = backward_inputs(3, 1, len(GAMMAS), 65, 16, 40, True, True)
    ld = _log_decay()
    clean = kernel_backward(q, k, v, ld, 0.5, s0, g, g_state, True, False)
    g_state[0, 1, 3, 5] = float("nan")
    got = kernel_backward(q, k, v, ld, 0.5, s0, g, g_state, True, False)
    for name, x, r in zip(("k", "v", "initial_state"), got[1:4], clean[1:4]):
        assert x[:, 1].isnan().any(), f"d{name}: the NaN of G does not show"
        others = [0, 2, 3]
        assert torch.equal(x[:, others], r[:, others]), f"d{name}: NaN reached another head"


def _grads(fn, leaves: list[torch.Tensor], w: torch.Tensor, ws: Optional[torch.Tensor]) -> tuple:
    out, state = fn(*leaves)
    loss = (out * w).sum() + ((state * ws).sum() if ws is not None else 0)
    return torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("scale", (0.5, 0.0))
@pytest.mark.parametrize("form", ("decay", "decay_rate"))
@pytest.mark.parametrize("states", STATES, ids=lambda s: f"s0={int(s[0])}-G={int(s[1])}")
@pytest.mark.parametrize("sizes", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("n", NS)
def test_matches_fp64_autograd(kernel_impl, n, sizes, states, form, scale):
    """Through the library (method "chunk", kernel_backward in the Function): the gradients of q, k,
    v, the initial state and the decay (factors or rates that require grad) equal autograd through
    the naive fp64 reference."""
    with_s0, with_g = states
    layout = "bnhd" if n % 2 else "bhnd"
    q, k, v, g, s0, _ = _inputs(7 * n, n, *sizes, with_s0, with_g)
    if layout == "bnhd":
        q, k, v, g = (x.transpose(1, 2).contiguous() for x in (q, k, v, g))
    ws = randn(torch.Generator().manual_seed(n), s0.shape if s0 is not None else (2, len(GAMMAS), *sizes), F64) \
        if with_g else None
    factors = torch.tensor(GAMMAS, dtype=F64)
    decay = (factors if form == "decay" else -torch.log(factors)).requires_grad_(True)
    tensors = [x.clone().requires_grad_(True) for x in (q, k, v, *([s0] if with_s0 else []))]

    def lib(*xs):
        return rtkernels.causal_linear_attention(xs[0], xs[1], xs[2], method="chunk", layout=layout, scale=scale,
                                                 initial_state=xs[3] if with_s0 else None, return_state=True,
                                                 **{form: xs[-1]})

    def ref(*xs):
        gam = xs[-1] if form == "decay" else torch.exp(-xs[-1])
        return reference(xs[0], xs[1], xs[2], gam, scale, layout, xs[3] if with_s0 else None)

    got = _grads(lib, tensors + [decay], g, ws)
    want = _grads(ref, tensors + [decay], g, ws)
    for name, x, r in zip(("q", "k", "v", *(["initial_state"] if with_s0 else []), form), got, want):
        assert_close(x, r, F64, f"d{name} n={n} {sizes} {states} {form} scale={scale}", n=n)


@pytest.mark.parametrize("layout", ("bhnd", "bnhd"))
@pytest.mark.parametrize("form", ("decay", "decay_rate"))
@pytest.mark.parametrize("n", (1, 17, 65))
def test_gradcheck(kernel_impl, n, form, layout):
    """gradcheck (fp64, fast mode) of (output, final state) through kernel_backward with respect to
    q, k, v, the initial state and the decay (interior decays, which a central difference can
    perturb), and at the boundary decays with respect to q, k, v and the initial state."""
    fn = grad_cpu.library("chunk", form, layout, 0.7)
    q, k, v, s0 = grad_cpu.leaves(*grad_cpu.problem(n, 1, 3, n, 3, 2, F64, layout))
    assert torch.autograd.gradcheck(fn, (q, k, v, s0, grad_cpu.decay_tensor(form, grad_cpu.INNER_GAMMAS)),
                                    fast_mode=True)
    edge = grad_cpu.decay_tensor(form, grad_cpu.EDGE_GAMMAS)
    assert torch.autograd.gradcheck(lambda *x: fn(*x, edge), (q, k, v, s0), fast_mode=True)


def test_gradcheck_full_mode(kernel_impl):
    """The element-by-element gradcheck once: odd sizes, two batches."""
    grad_cpu.test_gradcheck_full_mode("chunk")


@pytest.mark.parametrize("pos", (0, 64, 149))
@pytest.mark.parametrize("which", ("q", "k", "v"))
def test_nan_reaches_exactly_its_gradient_rows(kernel_impl, which, pos):
    """NaN in an input reaches exactly the gradient entries autograd.py's docstring names, through
    the three forward passes as through torch_backward."""
    grad_cpu.test_nan_reaches_exactly_its_gradient_rows("chunk", which, pos, 0.9)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_low_precision_inputs(kernel_impl, dtype):
    """fp32 and 16-bit inputs (the torch passes in fp32 on the CPU): gradients in the input dtypes
    within the dtype's tolerance."""
    grad_cpu.test_low_precision_gradients("chunk", dtype)


@pytest.mark.parametrize("budget", (1, 2_000_000, 4_000_000, 1 << 40))
def test_log_decay_grad_in_passes(monkeypatch, budget):
    """dlog(gamma) over ranges of heads and batches (a small DECAY_GRAD_BYTES) equals one pass."""
    q, k, v, g, s0, g_state = _inputs(3, 65, 16, 40, True, True, b=3)
    ld = _log_decay()
    whole = rk_autograd.log_decay_grad(q, k, v, ld, 0.5, s0, g, g_state)
    monkeypatch.setattr(rk_autograd, "DECAY_GRAD_BYTES", budget)
    assert_close(rk_autograd.log_decay_grad(q, k, v, ld, 0.5, s0, g, g_state), whole, F64, f"budget {budget}")


@pytest.mark.parametrize("with_s0", (False, True))
def test_reverse_pass_is_the_flipped_forward(with_s0):
    """forward_pass(reverse=True) is the forward of the flipped sequence, flipped back; the initial
    state enters before token N-1 and the final state leaves after token 0."""
    q, k, v, _, s0, _ = _inputs(5, 70, 4, 6, with_s0, False)
    ld = _log_decay()
    out = torch.empty_like(v)
    state = forward_pass(q, k, v, ld, 0.3, out, s0, True, True)
    ref, ref_state = reference(q.flip(2), k.flip(2), v.flip(2), torch.tensor(GAMMAS, dtype=F64), 0.3,
                               initial_state=s0)
    assert_close(out, ref.flip(2), F64, "reversed output")
    assert_close(state, ref_state, F64, "reversed final state")


def test_registered_in_front_for_kernel_inputs_only():
    """kernel_backward is first in BACKWARD_IMPLS, and declines CPU inputs (torch_backward runs)."""
    assert rk_autograd.BACKWARD_IMPLS[0] == (supports, kernel_backward)
    q = torch.zeros(1, 1, 4, 8, dtype=torch.bfloat16)
    assert not supports(q, q)
    assert rk_autograd.backward_impl(q, q) is rk_autograd.torch_backward


@pytest.mark.parametrize("reverse", (False, True))
@pytest.mark.parametrize("dv", (40, 37, 16, 3))
def test_key_pieces_add_up_to_the_whole_pass(monkeypatch, reverse, dv):
    """A contraction wider than the kernel takes (the backward's dq / dk passes, whose keys are Dv
    wide) runs as pieces of key columns (``plan.key_pieces``, as ``launch.KeyPiecesLaunch`` does;
    MAX_DIM lowered to 16 here, so 40 -> 16, 16, 8; 37 -> 16, 16, 5; 16 and 3 -> one piece): the
    outputs add up to one pass over all columns, the state term included, and the final states
    stack along the key rows, in fp64."""
    from rtkernels.methods.chunk import plan

    monkeypatch.setattr(plan, "MAX_DIM", 16)
    pieces = plan.key_pieces(torch.float32, dv, 0, plan.current_overrides()) or [slice(0, dv)]
    assert len(pieces) == -(-dv // 16) and all(p.stop - p.start <= 16 for p in pieces)
    assert [i for p in pieces for i in range(p.start, p.stop)] == list(range(dv))
    b, h, n, dx = 2, len(GAMMAS), 130, 5
    g, w, c = (randn(torch.Generator().manual_seed(s), (b, h, n, d), F64) for s, d in ((1, dv), (2, dv), (3, dx)))
    s0 = None if reverse else randn(torch.Generator().manual_seed(4), (b, h, dv, dx), F64)
    whole = torch.empty(b, h, n, dx, dtype=F64)
    whole_state = forward_pass(g, w, c, _log_decay(), 0.7, whole, s0, True, reverse, on_kernel=False)
    split, states = torch.zeros_like(whole), []
    for p in pieces:
        part = torch.empty_like(whole)
        states.append(forward_pass(g[..., p], w[..., p], c, _log_decay(), 0.7, part,
                                   None if s0 is None else s0[:, :, p], True, reverse, on_kernel=False))
        split += part
    assert_close(split, whole, F64, "sum of the key pieces")
    assert_close(torch.cat(states, dim=2), whole_state, F64, "stacked states of the key pieces")


def test_value_width_limit_of_the_kernels():
    """The chunk kernels take Dk <= 256 and Dv <= 512 (value tiles); the backward's kernel test agrees."""
    from rtkernels.methods import chunk

    assert (chunk.MAX_DIM, chunk.MAX_VALUE_DIM) == (256, 512)
    for dk, dv, ok in ((256, 512, True), (192, 320, True), (257, 64, False), (64, 513, False)):
        q, v = torch.zeros(1, 1, 1, dk, dtype=torch.bfloat16), torch.zeros(1, 1, 1, dv, dtype=torch.bfloat16)
        assert chunk.kernel_supports(q, v) is ok


def test_key_pieces_plan():
    """Dk over 128 on the wgmma kernel: equal pieces of at most 128 key columns, 16-byte aligned
    (multiples of 8) but the last, covering Dk once; elsewhere (fp32, no wgmma, pieces switched
    off) pieces of at most 256 only where Dk is wider (the backward's Dv-wide passes)."""
    from rtkernels.methods.chunk import plan

    bf16 = torch.bfloat16
    with plan.override(wgmma=True):
        cases = {256: [(0, 128), (128, 256)], 200: [(0, 104), (104, 200)], 192: [(0, 96), (96, 192)],
                 129: [(0, 72), (72, 129)]}
        for dk, want in cases.items():
            got = plan.key_pieces(bf16, dk, 0, plan.current_overrides())
            assert [(p.start, p.stop) for p in got] == want
        assert plan.key_pieces(bf16, 128, 0, plan.current_overrides()) is None
        assert plan.key_pieces(torch.float32, 256, 0, plan.current_overrides()) is None
        with plan.override(key_pieces=False):
            assert plan.key_pieces(bf16, 256, 0, plan.current_overrides()) is None
        assert plan.key_pieces(bf16, 512, 0, plan.current_overrides())[-1] == slice(384, 512)
        assert [(p.start, p.stop) for p in plan.key_pieces(torch.float32, 512, 0, plan.current_overrides())] \
            == [(0, 256), (256, 512)]
    with plan.override(wgmma=False):
        assert plan.key_pieces(torch.float16, 256, 0, plan.current_overrides()) is None
        assert [(p.start, p.stop) for p in plan.key_pieces(torch.float16, 320, 0, plan.current_overrides())] \
            == [(0, 160), (160, 320)]


def test_repeated_backward_repeats_its_planned_launches(monkeypatch):
    """With the kernel standing in (every pass a recording launch): the first backward of a
    signature plans its three passes through kernel_forward, a repeat calls the same three launches
    on the new tensors (never kernel_forward), and calls with an initial state are never planned."""
    import rtkernels.methods.chunk.backward as kb
    from rtkernels.methods.chunk import launch

    made, ran, forwards = [], [], []

    def fake_launcher(q, k, v, log_decay, scale, out, need_state, reverse, *rest):
        def run(q_, k_, v_, out_, s0=None, decay=None, decay_ptr=None, seqs=None, dlog=None):
            ran.append((reverse, q_.data_ptr(), out_.data_ptr()))
        made.append(reverse)
        return run

    real_forward = launch.kernel_forward

    def counted_forward(*args, **kwargs):
        forwards.append(1)
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(kb, "kernel_runs", lambda *a: True)
    monkeypatch.setattr(launch, "_launcher", fake_launcher)
    monkeypatch.setattr(launch, "kernel_forward", counted_forward)
    monkeypatch.setattr(launch, "_planned", {})
    kb.clear_plans()
    ld = LogDecay(torch.device("cpu"), host=(math.log(0.9),) * 2)
    q, k, v, g = (torch.randn(1, 2, 70, d, dtype=torch.bfloat16) for d in (16, 16, 24, 24))  # Dk != Dv
    kb.kernel_backward(q, k, v, ld, 0.5, None, g, None, False, False)
    assert made == [False, True, True] and len(forwards) == 3 and len(kb._plans) == 1
    ran.clear()
    q2, k2, v2, g2 = (x.clone() for x in (q, k, v, g))
    grads = kb.kernel_backward(q2, k2, v2, ld, 0.5, None, g2, None, False, False)
    assert len(forwards) == 3 and made == [False, True, True]  # no new plan, no kernel_forward
    assert [(r, p) for r, p, _ in ran] == [(False, g2.data_ptr()), (True, v2.data_ptr()), (True, k2.data_ptr())]
    assert [o for _, _, o in ran] == [grads.q.data_ptr(), grads.k.data_ptr(), grads.v.data_ptr()]
    kb.clear_plans()
    kb.kernel_backward(q, k, v, ld, 0.5, torch.zeros(1, 2, 16, 16), g, None, False, False)
    assert not kb._plans
    kb.clear_plans()
