"""The math of the dlog(gamma) kernel (rtkernels/methods/chunk/decay_grad.py, cuda_src/chunk/decay_grad.cu), on the
CPU: :func:`~rtkernels.decay_grad.torch_w_recurrence` -- the kernel's computation in torch
operations, the W = dS/dlog(gamma) recurrence -- against autograd through the fp64 reference and
against the four-term adjoint formula of the torch backward; the kernels' configurations. The
kernels themselves run in tests/test_gpu_decay_grad.py (16-bit) and tests/test_gpu_decay_grad_f32.py."""

from __future__ import annotations

import math

import pytest
import torch

import rtkernels.autograd as rk_autograd
import rtkernels.kernel_backward as kb
from inputs import backward_inputs
from reference import reference
from rtkernels import decay_grad
from rtkernels.decay import LogDecay
from rtkernels.methods import chunk

F64 = torch.float64
#: One head per decay: forgets at once, halves, keeps almost everything, keeps everything.
GAMMAS = (1e-6, 0.5, 0.999, 1.0)
NS = (1, 63, 65, 200)
#: (Dk, Dv), never equal
SIZES = [(3, 16), (40, 7)]
#: (initial state given, gradient of the final state given)
STATES = [(False, False), (True, False), (False, True), (True, True)]


def _inputs(seed: int, n: int, dk: int, dv: int, with_s0: bool, with_g: bool, b: int = 2):
    return backward_inputs(seed, b, len(GAMMAS), n, dk, dv, with_s0, with_g)


def _autograd_dlog(q, k, v, g, s0, g_state, scale: float) -> torch.Tensor:
    """dL/dlog(gamma) for L = sum(g * out) + sum(G * final state), by autograd through the fp64
    reference (the decay enters it as exp(log gamma))."""
    lg = torch.log(torch.tensor(GAMMAS, dtype=F64)).requires_grad_(True)
    out, state = reference(q, k, v, torch.exp(lg), scale, initial_state=s0)
    loss = (out * g).sum() + ((state * g_state).sum() if g_state is not None else 0)
    return torch.autograd.grad(loss, lg)[0]


def _per_head_close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    """Each head within ``tol`` relative (the heads' gradients differ by orders of magnitude)."""
    assert got.shape == want.shape, what
    err = ((got - want).abs() / want.abs().clamp(min=1e-300)).tolist()
    assert all(e <= tol for e in err), f"{what}: per-head relative errors {err}"


@pytest.mark.parametrize("scale", (0.7, 0.0))
@pytest.mark.parametrize("states", STATES, ids=lambda s: f"s0={int(s[0])}-G={int(s[1])}")
@pytest.mark.parametrize("sizes", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("n", NS)
def test_w_recurrence_matches_fp64_autograd(n, sizes, states, scale):
    """The S/W recurrences and the two terms (the formula the kernel implements) give dL/dlog(gamma)
    of autograd through the reference, per head, for gamma in {1e-6, 0.5, 0.999, 1}, one chunk,
    a chunk and one token, several chunks with a partial last one."""
    q, k, v, g, s0, g_state = _inputs(11 * n, n, *sizes, *states)
    want = _autograd_dlog(q, k, v, g, s0, g_state, scale)
    got = decay_grad.torch_w_recurrence(q, k, v, torch.log(torch.tensor(GAMMAS, dtype=F64)), scale, s0, g, g_state)
    if scale == 0.0 and g_state is None:
        assert torch.equal(got, torch.zeros_like(got)) and torch.equal(want, torch.zeros_like(want))
        return
    _per_head_close(got, want, 1e-9, f"n={n} {sizes} {states} scale={scale}")


def _dq_pass_model(q, k, v, g, s0, g_state, lg, scale: float, tile: int) -> torch.Tensor:
    """dL/dlog(gamma) as docs/design.md plans it inside the backward's dq pass (query dL/do, key v,
    value k; its state is S^T and W^T, Dv x Dk), for each tile of ``tile`` value columns (columns
    of Dk) on its own, the tiles' partial sums added: per chunk, the row dots with q of
    dL/do S^T (weight (tau+1) gamma^(tau+1)) and of dL/do W^T (weight gamma^(tau+1)), the intra sum
    of (t-s) gamma^(t-s) (dL/do_t . v_s) (q_t . k_s) with q . k^T over the tile only, and <G, W_end>
    on the tile. Returns ``[H]``."""
    b, h, n, dk = q.shape
    dv = v.shape[-1]
    chunk = decay_grad.CHUNK
    total = torch.zeros(h, dtype=F64)
    lgh = lg.view(h, 1)
    for j0 in range(0, dk, tile):
        cols = slice(j0, min(dk, j0 + tile))
        width = cols.stop - cols.start
        s = (s0[:, :, cols].transpose(-1, -2).clone() if s0 is not None
             else torch.zeros(b, h, dv, width, dtype=F64))
        w = torch.zeros_like(s)
        acc = torch.zeros(b, h, dtype=F64)
        for c0 in range(0, n, chunk):
            ln = min(chunk, n - c0)
            tau = torch.arange(ln, dtype=F64)
            gq, vv = g[:, :, c0:c0 + ln], v[:, :, c0:c0 + ln]
            qq, kk = q[:, :, c0:c0 + ln, cols], k[:, :, c0:c0 + ln, cols]
            pw = torch.exp(lgh * (tau + 1))                                      # [H, L]
            acc = acc + (((tau + 1) * pw)[..., None] * (gq @ s) * qq).sum((-1, -2))
            acc = acc + (pw[..., None] * (gq @ w) * qq).sum((-1, -2))
            dist = tau[:, None] - tau[None, :]
            weight = torch.where(dist >= 0, dist * torch.exp(lgh[..., None] * dist.clamp(min=0)),
                                 torch.zeros((), dtype=F64))
            acc = acc + ((gq @ vv.transpose(-1, -2)) * (qq @ kk.transpose(-1, -2)) * weight).sum((-1, -2))
            m = ln - 1 - tau
            e = torch.exp(lgh * m)
            carry = torch.exp(lg * ln).view(h, 1, 1)
            w = carry * (w + ln * s) + (vv * (m * e)[..., None]).transpose(-1, -2) @ kk
            s = carry * s + (vv * e[..., None]).transpose(-1, -2) @ kk
        total = total + scale * acc.sum(0)
        if g_state is not None:
            total = total + (g_state[:, :, cols].transpose(-1, -2) * w).sum((-1, -2)).sum(0)
    return total


@pytest.mark.parametrize("tile", (16, 64))
@pytest.mark.parametrize("states", STATES, ids=lambda s: f"s0={int(s[0])}-G={int(s[1])}")
@pytest.mark.parametrize("sizes", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("n", NS)
def test_dq_pass_plan_matches_fp64_autograd(n, sizes, states, tile):
    """The dq-pass form of dL/dlog(gamma) (docs/design.md's plan for the fused backward), tiles of
    Dk summed, equals autograd through the fp64 reference for every head."""
    q, k, v, g, s0, g_state = _inputs(7 * n + tile, n, *sizes, *states)
    want = _autograd_dlog(q, k, v, g, s0, g_state, 0.7)
    got = _dq_pass_model(q, k, v, g, s0, g_state, torch.log(torch.tensor(GAMMAS, dtype=F64)), 0.7, tile)
    _per_head_close(got, want, 1e-9, "dq-pass plan")


@pytest.mark.parametrize("states", STATES, ids=lambda s: f"s0={int(s[0])}-G={int(s[1])}")
@pytest.mark.parametrize("n", (64, 130))
def test_w_recurrence_equals_adjoint_formula(n, states):
    """Forward mode (W carried with S) and the torch backward's adjoint four-term formula
    (rtkernels.autograd.log_decay_grad) are the same number."""
    q, k, v, g, s0, g_state = _inputs(5 * n, n, 16, 24, *states, b=3)
    ld = LogDecay(torch.device("cpu"), host=tuple(math.log(x) for x in GAMMAS))
    want = rk_autograd.log_decay_grad(q, k, v, ld, 0.5, s0, g, g_state)
    got = decay_grad.torch_w_recurrence(q, k, v, ld.tensor(F64), 0.5, s0, g, g_state)
    _per_head_close(got, want, 1e-10, f"n={n} {states}")


@pytest.mark.parametrize("pos", (0, 63, 64, 99))
@pytest.mark.parametrize("which", ("q", "k", "v", "g"))
def test_w_recurrence_nan_reaches_its_head_only(which, pos):
    """A NaN in q, k, v or dL/do of head 1 makes that head's dlog(gamma) NaN (the last token's
    k and v too: through the diagonal products, whose weight is 0) and leaves the others as they
    were; the adjoint formula agrees."""
    q, k, v, g, s0, g_state = _inputs(3, 100, 8, 5, True, False)
    lg = torch.log(torch.tensor(GAMMAS, dtype=F64))
    clean = decay_grad.torch_w_recurrence(q, k, v, lg, 0.5, s0, g, g_state)
    x = dict(q=q, k=k, v=v, g=g)[which]
    x[1, 1, pos, 2] = float("nan")
    got = decay_grad.torch_w_recurrence(q, k, v, lg, 0.5, s0, g, g_state)
    assert torch.isnan(got[1]) and torch.equal(torch.cat([got[:1], got[2:]]), torch.cat([clean[:1], clean[2:]]))
    ld = LogDecay(torch.device("cpu"), host=tuple(math.log(x) for x in GAMMAS))
    adj = rk_autograd.log_decay_grad(q, k, v, ld, 0.5, s0, g, g_state)
    assert torch.equal(torch.isnan(adj), torch.isnan(got))


def test_configs_cover_every_head_size():
    """Every Dk, Dv in 1..256 (both loaders) maps to an instance the compile test compiles, whose
    shared memory fits an H100/H200 CTA; KMAX <= 128 instances are built for two CTAs per
    multiprocessor (launch bounds), so two of them must fit its 228 KiB too."""
    configs = set(decay_grad.all_configs())
    for dk in range(1, 257):
        for dv in range(1, 257):
            for vec in (False, True):
                c = decay_grad.kernel_config(torch.bfloat16, dk, dv, vec)
                assert c in configs, (dk, dv, vec)
    for _, kmax, bv, _ in configs:
        smem = decay_grad.smem_bytes(kmax, bv)
        assert smem <= 227 * 1024
        if kmax <= 128:
            assert 2 * (smem + 1024 + 32) <= 228 * 1024, (kmax, bv)  # + reserved and static per CTA
    assert decay_grad.name_expression((2, 128, 64, True)) == "rtk_chunk_decay_grad<2, 128, 64, true>"


def test_f32_configs_cover_every_head_size():
    """The float32 kernel: every Dk, Dv in 1..256, both loaders, both modes and both tile rules map
    to an instance the compile test compiles; 64-wide value tiles only at KMAX 128 and Dv > 32, and
    never where 64-wide tiles would leave SMs idle; two row slices in one stage at KMAX 128 where
    32-wide tiles would too; one stage otherwise only at KMAX 256; each instance's
    shared memory (dynamic + 2,352 bytes static) fits a CTA, and two of them where the launch bounds
    ask for two CTAs a multiprocessor (the kernel's rule: dynamic memory <= 110 KiB)."""
    configs = set(decay_grad.all_configs_f32())
    for dk in range(1, 257):
        for dv in range(1, 257):
            for vec in (False, True):
                for exact in (False, True):
                    for few, fewer in ((False, False), (True, False), (True, True)):
                        c = decay_grad.kernel_config_f32(dk, dv, vec, exact, few, fewer)
                        assert c in configs, (dk, dv, vec, exact, few, fewer)
                        kmax, bv, stages, slices, ex, v = c
                        assert kmax >= dk and (ex, v) == (exact, vec)
                        assert bv == (64 if kmax == 128 and dv > 32 and not few else 32), c
                        assert slices == (2 if kmax == 128 and fewer else 1), c
                        assert stages == (1 if kmax == 256 or slices == 2 else 2), c
    for kmax, bv, stages, _, _, _ in configs:
        smem = decay_grad.smem_bytes_f32(kmax, bv, stages) + 2352
        assert smem <= 227 * 1024, (kmax, bv, stages)
        if decay_grad.smem_bytes_f32(kmax, bv, stages) <= 110 * 1024:
            assert 2 * (smem + 1024) <= 228 * 1024, (kmax, bv, stages)
    assert decay_grad.name_expression_f32((128, 64, 2, 1, True, False)) == \
        "rtk_chunk_decay_grad_f32<128, 64, 2, 1, true, false>"


def test_tf32_mode_on_hopper_takes_the_wgmma_kernel():
    """The float32 "tf32" mode on an sm_90a GPU with 16-byte aligned rows and Dk <= 128 runs
    rtk_chunk_decay_grad_tf32 (KMAX 64 with 128 value columns a CTA, KMAX 128 with 64), compiled
    with the sm_90a option; the "exact" mode, unaligned rows, Dk > 128 and GPUs without wgmma keep
    the mma.sync kernel; every instance it names is one the compile test compiles, and its shared
    memory (dynamic + 2,352 bytes static) fits a CTA."""
    f32 = torch.float32
    names = set(chunk.instances()[decay_grad.SOURCE_TF32])
    for dk in range(1, 129):
        for dv in (1, 40, 64, 65, 128, 300):
            source, name, bv, slices, smem, options = decay_grad._plan(f32, dk, dv, True, False, False, False, True)
            kmax = 64 if dk <= 64 else 128
            assert (source, name, bv, slices) == (decay_grad.SOURCE_TF32, f"rtk_chunk_decay_grad_tf32<{kmax}, false>",
                                                  128 * 64 // kmax, 1)
            assert decay_grad.tf32_wg_kmax(dk) == kmax and decay_grad.tf32_wg_bv(kmax) == bv
            assert name in names and options == chunk.WGMMA_OPTIONS and smem == decay_grad.smem_bytes_tf32(kmax)
            assert chunk.instance_options()[name] == chunk.WGMMA_OPTIONS
            assert smem + 2352 <= 227 * 1024
    for args in ((f32, 128, 128, True, False, True, False, True),   # exact
                 (f32, 128, 128, False, False, False, False, True),  # unaligned rows
                 (f32, 200, 128, True, False, False, False, True),   # Dk > 128
                 (f32, 128, 128, True, False, False, False, False),  # no wgmma
                 (torch.bfloat16, 128, 128, True, False, False, False, True)):
        assert decay_grad._plan(*args)[0] != decay_grad.SOURCE_TF32, args


def test_tf32_wgmma_split_plan():
    """The wgmma dlog kernel splits the sequence only where its CTAs fill at most half the SMs (one
    CTA per SM, segments of at least 32 chunks), on 132 SMs: (1, 32, 16384, 128) in 2 segments,
    (1, 16, 32768, 128) in 4, the mid and small shapes not at all; its states instances compile
    with the walk's options and launch 256 threads, as does the KMAX 64 walk (the KMAX 128 walk 384)."""
    seg = chunk.tf32_dlog_segments
    assert seg(32 * 2, 16384, 132) == 2 and seg(16 * 2, 32768, 132) == 4
    assert seg(4 * 32 * 2, 4096, 132) == 1 and seg(2 * 32 * 2, 1024, 132) == 1
    assert seg(2, 2048, 132) == 1  # 32 chunks: too short to split
    names = chunk.instances()[decay_grad.SOURCE_TF32]
    for kmax in (64, 128):
        states = decay_grad.name_expression_tf32(kmax, True)
        assert states == f"rtk_chunk_decay_grad_tf32<{kmax}, true>" and states in names
        assert chunk.instance_options()[states] == chunk.WGMMA_OPTIONS
    # the KMAX 128 walk has its causal warpgroup; the states pass and the KMAX 64 walk have none
    assert [decay_grad.tf32_threads(*a) for a in ((128,), (128, True), (64,), (64, True))] == [384, 256, 256, 256]


def test_cpu_kernel_backward_keeps_the_torch_formula(monkeypatch):
    """Where the chunk kernel does not run (here: the CPU) kernel_backward computes dlog(gamma) with
    rtkernels.autograd.log_decay_grad, never the CUDA kernel."""
    def no_kernel(*args, **kwargs):
        raise AssertionError("the dlog(gamma) kernel was called for CPU inputs")

    monkeypatch.setattr(kb, "kernel_log_decay_grad", no_kernel)
    q, k, v, g, s0, g_state = _inputs(2, 70, 8, 6, True, True)
    ld = LogDecay(torch.device("cpu"), host=tuple(math.log(x) for x in GAMMAS))
    got = kb.kernel_backward(q, k, v, ld, 0.5, s0, g, g_state, True, True).log_decay
    assert torch.equal(got, rk_autograd.log_decay_grad(q, k, v, ld, 0.5, s0, g, g_state))


@pytest.mark.parametrize("kind", ("factor", "rate"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.float64, torch.bfloat16))
def test_source_grad_is_autograd_through_the_clamped_log(kind, dtype):
    """LogDecay.source_grad (the chain rule a CUDA decay tensor gets, also what
    rtk_chunk_decay_grad_sum computes): equal to autograd through the clamped log(gamma) that a CPU
    decay tensor goes through, zero where a rate is clamped, NaN for a value outside the domain."""
    from rtkernels.decay import KIND_FACTOR, KIND_RATE, LOG_DECAY_MIN

    if kind == "factor":
        good = torch.tensor([1e-6, 0.5, 0.99, 1.0], dtype=dtype)
        bad = torch.tensor([0.0, 1.5, -0.1, math.nan], dtype=dtype)
    else:
        good = torch.tensor([0.0, 0.01, 3.0, 2e4], dtype=dtype)  # 2e4: clamped, gradient 0
        bad = torch.tensor([-1.0, math.inf, math.nan, -0.5], dtype=dtype)
    d_log = torch.tensor([0.3, -1.25, 2.0, 0.7], dtype=torch.float32)
    for values in (good, bad):
        ld = LogDecay(torch.device("cpu"), raw=values, kind=KIND_FACTOR if kind == "factor" else KIND_RATE)
        ld.source_kind = ld.kind
        got = ld.source_grad(d_log)
        assert got.dtype == torch.float32
        if values is bad:
            assert torch.isnan(got).all(), got
            continue
        x = values.to(F64).requires_grad_(True)
        lg = (torch.log(x) if kind == "factor" else -x).clamp(min=LOG_DECAY_MIN)
        (lg * d_log.to(F64)).sum().backward()
        assert torch.allclose(got.to(F64), x.grad, rtol=1e-6, atol=0), (got, x.grad)
        if kind == "rate":
            assert got[3] == 0


def test_dq_pass_instance_exists_only_where_it_fits():
    """The dq pass that sums dlog(gamma) (plan.dlog_config): fp16 or bf16 with aligned rows and a
    pass Dk (the forward's Dv) of at most 128 only, 64-wide value tiles on the wgmma kernel, listed
    among the instances the CI compiles, its states pass (split sequences) too, and its shared
    memory (x tiles, W copies and fp16's W maxima added) within an H100's 227 KB; float32 and CPU
    tensors never take it."""
    from rtkernels.methods.chunk import plan

    for dtype in (torch.bfloat16, torch.float16):
        for dk in (16, 64, 100, 128):
            config = plan.dlog_config(dtype, dk, True)
            assert config is not None and config[2] == 64 and config[5] and config[6]
            assert config in plan.all_configs()
            smem = plan.config_smem(config)
            assert plan.smem_bytes(config[1], 64, True) + 32 < smem <= plan.SMEM_LIMIT_SM90
            for tma in (False, True):
                if not tma or config[1] == 128:
                    states = plan.states_config(dtype, dk, 64, True, plan.SMEM_LIMIT_SM90, dlog=True, tma=tma)
                    assert states in plan._states_configs()
    assert plan.dlog_config(torch.float32, 128, True) is None
    assert plan.dlog_config(torch.bfloat16, 129, True) is None
    assert plan.dlog_config(torch.bfloat16, 64, False) is None
    x = torch.zeros(1, 2, 8, 64, dtype=torch.bfloat16)
    assert not decay_grad.dq_pass_sums(x, x, x, x, None)


@pytest.mark.parametrize("per_seg", [1, 2, 3])
def test_split_fold_of_w_is_the_derivative_of_the_fold(per_seg):
    """The split dq pass's fold (cuda_src/include/state_frag.cuh, rtk_chunk_state::fold_with) in
    fp64: from the states pass's slots (slot 0 the initial state, slot 1 the state after the first
    slot's tokens from it, slot j > 1 tokens [(j-1) L, j L) alone from zero; W slot j their
    derivatives by log(gamma), carried from 0 chunk by chunk as the states pass does), the state
    entering segment z is s = slot[min(m, 1)], s = gamma^L s + slot[j] (m = z per_seg slots before
    it), and w = W slot[1], w = gamma^L (w + L s) + W slot[j] must be d s / d log(gamma):
    checked against autograd through the S fold for every segment, gamma = 0.9, 0.99, 1."""
    g = torch.Generator().manual_seed(3)
    h, dk, dv, slot_len, segments = 3, 5, 4, 96, 4
    n = slot_len * per_seg * (segments - 1)
    k, v = (torch.randn(h, n, d, generator=g, dtype=torch.float64) for d in (dk, dv))
    s0 = torch.randn(h, dk, dv, generator=g, dtype=torch.float64)
    lg = torch.log(torch.tensor([0.9, 0.99, 1.0], dtype=torch.float64)).requires_grad_()

    def own(a, b, start):  # the state of tokens [a, b) from `start`, and its W from 0, chunk by chunk
        s, w = start.clone(), torch.zeros_like(start)
        for c0 in range(a, b, decay_grad.CHUNK):
            ln = min(decay_grad.CHUNK, b - c0)
            m = ln - 1 - torch.arange(ln, dtype=torch.float64)
            e = torch.exp(lg.view(h, 1) * m)
            kc, vc = k[:, c0:c0 + ln], v[:, c0:c0 + ln]
            carry = torch.exp(lg * ln).view(h, 1, 1)
            w = carry * (w + ln * s) + (kc * (m * e)[..., None]).transpose(-1, -2) @ vc
            s = carry * s + (kc * e[..., None]).transpose(-1, -2) @ vc
        return s, w

    slots, w_slots = [s0], [torch.zeros_like(s0)]
    for j in range(n // slot_len):
        s, w = own(j * slot_len, (j + 1) * slot_len, s0 if j == 0 else torch.zeros_like(s0))
        slots.append(s)
        w_slots.append(w)
    carry = torch.exp(lg * slot_len).view(h, 1, 1)
    for z in range(segments):
        m = z * per_seg
        s, w = slots[min(m, 1)], (w_slots[1] if m >= 1 else torch.zeros_like(s0))
        for j in range(2, m + 1):
            s, w = carry * s + slots[j], carry * (w + slot_len * s) + w_slots[j]
        probe = torch.randn(h, dk, dv, generator=g, dtype=torch.float64)
        want = (torch.autograd.grad((s * probe).sum(), lg, retain_graph=True)[0] if s.requires_grad
                else torch.zeros(h, dtype=torch.float64))  # segment 0 starts from the initial state
        got = (w * probe).sum((-1, -2)).detach()
        assert torch.allclose(got, want, rtol=1e-10, atol=1e-10), (z, got, want)
