"""The backward's dk and dv passes as one walk (marker ``gpu``): the DUAL instance of the chunk
kernel (``cuda_src/chunk/fwd16.cu``) forced on with ``Overrides(fused_dk_dv=True)``. Gradients
against autograd through the fp64 reference on odd shapes, both layouts, fp16 and bf16, every
decay from 1e-6 to 1 (0.9 and 0.99 where a wrong power of gamma shows in fp16), sequences split
into segments, packed sequences; Inf/NaN reaching the same gradients as the separate passes; no host sync; a CUDA
graph of a training step replaying equal to eager; and where the heuristic takes it."""

from __future__ import annotations

import pytest
import torch

import rtkernels
from graphs import assert_training_step_replays
from inputs import force_chunk
from rtkernels.methods.chunk import plan

from test_gpu_grad import _case
from test_gpu_kernel_backward import _want_stateless
from tolerances import assert_close

pytestmark = pytest.mark.gpu

GAMMAS = (1e-6, 0.5, 0.9, 0.99, 0.999, 1.0)
#: ((B, H, N, Dk, Dv, layout), forced segments or None): N in {1, 63, 64, 65, 1000, 4096}; Dk != Dv
#: both ways (KMAX 128 over BV 64, KMAX 64 under BV 128); Dk 40 and Dv 104, whose tiles hold zero
#: columns and whose dk rows take the paired stores; 4096 tokens split into 3 segments.
CASES = [((2, 2, 1, 64, 64, "bhnd"), None), ((1, 3, 63, 128, 64, "bnhd"), None),
         ((1, 2, 64, 64, 128, "bhnd"), None), ((2, 2, 65, 40, 104, "bnhd"), None),
         ((1, 2, 1000, 128, 128, "bhnd"), None), ((1, 2, 4096, 128, 128, "bnhd"), 3),
         ((1, 2, 4096, 64, 128, "bhnd"), 3)]


def _case_id(case) -> str:
    shape, segments = case
    return "x".join(map(str, shape)) + ("" if segments is None else f"-seg{segments}")


def _spy(monkeypatch) -> list[bool]:
    """Record every answer of plan.fuses_dk_dv (the backward asks it once per call)."""
    seen: list[bool] = []
    real = plan.fuses_dk_dv

    def spy(*args, **kwargs):
        seen.append(real(*args, **kwargs))
        return seen[-1]
    monkeypatch.setattr(plan, "fuses_dk_dv", spy)
    return seen


@pytest.mark.parametrize("stateful", (True, False), ids=("state", "nostate"))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_fused_dk_dv_matches_fp64(case, dtype, stateful, monkeypatch):
    """dq, dk, dv and dS_0 (the fused pass's final state) within the dtype's tolerance, with the
    fused pass taken on every call (a trainable decay, whose gradient does not involve dk or dv)."""
    shape, segments = case
    force_chunk(monkeypatch, segments=segments, fused_dk_dv=True)
    seen = _spy(monkeypatch)
    n, layout = shape[2], shape[5]
    for gamma in GAMMAS:
        (q, k, v, s0, decay, w, ws), want = _case(shape, dtype, gamma)
        if not stateful:
            want = _want_stateless(shape, dtype, gamma)
        inputs = (q, k, v, *([s0] if stateful else []), decay.float())
        leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
        res = rtkernels.causal_linear_attention(*leaves[:3], leaves[-1], scale=0.8, method="chunk", layout=layout,
                                                initial_state=leaves[3] if stateful else None, return_state=stateful)
        out, state = res if stateful else (res, None)
        loss = (out.float() * w.float()).sum() + ((state * ws).sum() if stateful else 0)
        loss.backward()
        names = ("q", "k", "v", *(["initial_state"] if stateful else []))
        for name, x, r in zip(names, leaves, want):
            assert_close(x.grad, r, dtype, f"d{name} {dtype} {case} gamma={gamma}", n=n)
    assert seen and all(seen), seen


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("dk, dv", ((64, 128), (128, 64)))
def test_fused_dk_dv_on_packed_sequences(dk, dv, dtype, monkeypatch):
    """Packed sequences of 65, 0, 1, 130 and 63 tokens (one CTA row per sequence and head, each
    walk restarting at its sequence's last token): dq, dk, dv, dS_0 and the final states' gradient
    terms against the fp64 torch path of the same packed call, γ 0.9 and 0.99 among the heads."""
    force_chunk(monkeypatch, fused_dk_dv=True)
    seen = _spy(monkeypatch)
    lens = [65, 0, 1, 130, 63]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    n, h = sum(lens), 4
    gen = torch.Generator(device="cuda").manual_seed(dk)
    q, k = (torch.randn(1, h, n, dk, generator=gen, device="cuda").div_(dk ** 0.5).to(dtype) for _ in range(2))
    v = torch.randn(1, h, n, dv, generator=gen, device="cuda").to(dtype)
    s0 = torch.randn(len(lens), h, dk, dv, generator=gen, device="cuda").div_(4)
    w = torch.randn(1, h, n, dv, generator=gen, device="cuda")
    ws = torch.randn(len(lens), h, dk, dv, generator=gen, device="cuda")
    decay = torch.tensor([0.5, 0.9, 0.99, 0.999], device="cuda")
    grads = []
    for leaves in ([x.clone().requires_grad_() for x in (q, k, v, s0)],
                   [x.double().requires_grad_() for x in (q, k, v, s0)]):
        gamma = decay.double() if leaves[0].dtype == torch.float64 else decay
        out, state = rtkernels.causal_linear_attention(*leaves[:3], gamma, scale=0.8, initial_state=leaves[3],
                                                       return_state=True, cu_seqlens=cu)
        ((out.double() * w.double()).sum() + (state.double() * ws.double()).sum()).backward()
        grads.append([x.grad for x in leaves])
    for name, got, want in zip(("dq", "dk", "dv", "ds0"), *grads):
        assert_close(got, want, dtype, f"packed {name} {dtype} {dk}x{dv}", n=max(lens))
    assert seen == [True]


def test_nonfinite_inputs_reach_what_the_separate_passes_reach(monkeypatch):
    """NaN in q (the fused pass's k tile: the values of dk's product), Inf in v (its x) and NaN in
    dL/do: the gradients are non-finite exactly where the separate dk and dv passes make them so,
    and equal to them elsewhere within bf16's tolerance."""
    b, h, n, d = 1, 2, 300, 64
    gen = torch.Generator(device="cuda").manual_seed(5)
    q, k, v, grad = (torch.randn(b, h, n, d, generator=gen, device="cuda").div_(4).bfloat16() for _ in range(4))
    q[0, 0, 70, 3] = float("nan")
    v[0, 1, 130, 5] = float("inf")
    grad[0, 1, 200, 7] = float("nan")
    decay = torch.tensor([0.9, 0.99], device="cuda")
    results = {}
    for fused in (True, False):
        force_chunk(monkeypatch, fused_dk_dv=fused)
        seen = _spy(monkeypatch)
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        rtkernels.causal_linear_attention(*leaves, decay, method="chunk").backward(grad)
        assert seen == [fused]
        results[fused] = [x.grad for x in leaves[1:]]
    for name, a, b_ in zip(("dk", "dv"), results[True], results[False]):
        bad = ~torch.isfinite(b_)
        assert bad.any() and torch.equal(~torch.isfinite(a), bad), name
        assert_close(a.masked_fill(bad, 0), b_.masked_fill(bad, 0).double(), torch.bfloat16, name, n=n)


def test_fused_step_has_no_host_sync_and_replays_in_a_cuda_graph(monkeypatch):
    """A training step with a trainable CUDA decay and the fused pass: no host sync once planned,
    and forward plus backward captured in a CUDA graph replay equal to eager on new values."""
    force_chunk(monkeypatch, fused_dk_dv=True)
    seen = _spy(monkeypatch)
    decay = torch.tensor([0.5, 0.9, 0.99, 1.0], device="cuda", requires_grad=True)
    assert_training_step_replays((2, 4, 1000, 128), 6, decay, torch.tensor([0.3, 0.95, 0.999, 1.0], device="cuda"))
    assert seen and all(seen)


def test_where_the_backward_fuses():
    """The heuristic takes the fused pass where the dv pass alone would hold all of Dv in one value
    tile (mid and long shapes, Dv <= 64), not where 64-wide tiles give twice the CTAs (2 x 32 heads
    of 1024 tokens); never for unaligned rows, Dv > 128, fp32, v and dL/do of different strides, or
    q without a unit last stride."""
    over = plan.Overrides()

    def fuses(b, h, n, dk, dv, dtype=torch.bfloat16, grad_strides=True, sequences=0, q_unit=True):
        q, k = (torch.empty(b, h, n, dk, device="cuda", dtype=dtype) for _ in range(2))
        grad_k = torch.empty_like(k)
        if not q_unit:  # 16-byte aligned rows whose elements are 8 apart (dk alike): a pass copies such a q
            q, grad_k = (torch.empty(b, h, n, dk * 8, device="cuda", dtype=dtype)[..., ::8] for _ in range(2))
        v = torch.empty(b, h, n, dv, device="cuda", dtype=dtype)
        g = torch.empty_like(v)
        if not grad_strides:
            g = torch.empty(b, n, h, dv, device="cuda", dtype=dtype).transpose(1, 2)
        return plan.fuses_dk_dv(q, k, v, g, grad_k, over, sequences)

    wgmma = plan._wgmma_ok(0, over)
    assert fuses(4, 32, 4096, 128, 128) == wgmma
    assert fuses(1, 32, 16384, 128, 128) == wgmma
    assert fuses(8, 16, 2048, 64, 64) == wgmma
    assert not fuses(2, 32, 1024, 128, 128)
    # packed sequences (never split): fused where the (sequence, head) rows fill 3/4 of the SMs
    assert fuses(1, 32, 65536, 128, 128, sequences=16) == wgmma
    assert not fuses(1, 32, 65536, 128, 128, sequences=2)
    assert not fuses(4, 32, 4096, 36, 128)  # 72-byte rows
    assert not fuses(4, 32, 4096, 128, 200)
    assert not fuses(4, 32, 4096, 128, 128, torch.float32)
    assert not fuses(4, 32, 4096, 128, 128, grad_strides=False)
    assert not fuses(4, 32, 4096, 128, 128, q_unit=False)
