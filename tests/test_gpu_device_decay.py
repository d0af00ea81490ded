"""A decay that lives on the GPU (marker ``gpu``): the kernels read the caller's tensor where it
is, so a call costs no host sync and no copy, a CUDA graph captures it, and the cached call
follows the tensor's current values. A value outside the domain makes that head's outputs NaN;
``set_strict_decay`` brings the ``ValueError`` back."""

import math

import pytest
import torch

from inputs import force_chunk, no_host_sync, run_without_host_sync

import rtkernels
from rtkernels import call_cache
from rtkernels.methods import METHODS

from graphs import capture
from reference import reference
from tolerances import assert_close

pytestmark = pytest.mark.gpu

ALL_METHODS = sorted(METHODS)
DECAY_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def _qkv(b, h, n, dk, dv, dtype, seed=0, requires_grad=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = (torch.randn(b, h, n, dk, generator=g, device="cuda") / dk ** 0.5).to(dtype)
    k = (torch.randn(b, h, n, dk, generator=g, device="cuda") / dk ** 0.5).to(dtype)
    v = torch.randn(b, h, n, dv, generator=g, device="cuda").to(dtype)
    return tuple(x.requires_grad_(requires_grad) for x in (q, k, v))


def _strided(values, dtype):
    """A CUDA [H] tensor of ``values`` with element stride 2 (a view into a longer buffer)."""
    buf = torch.zeros(2 * len(values), dtype=dtype, device="cuda")
    buf[::2] = torch.tensor(values, dtype=torch.float64).to(dtype)
    return buf[::2]


@pytest.mark.parametrize("decay_dtype", DECAY_DTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("method", ALL_METHODS)
def test_every_decay_dtype_and_stride_is_read_as_given(method, dtype, decay_dtype):
    """gamma 0.9 and 0.99, where a wrong power of gamma shows in fp32 and fp16."""
    b, h, n, dk, dv = 2, 3, 200, 40, 24
    q, k, v = _qkv(b, h, n, dk, dv, dtype)
    for values in ([0.9, 0.99, 0.5], [0.99, 1.0, 1e-6]):
        for rate in (False, True):
            x = [-math.log(g) for g in values] if rate else values
            t = _strided(x, decay_dtype)
            exact = t.double().cpu()
            gamma = torch.exp(-exact) if rate else exact
            kw = {"decay_rate": t} if rate else {"decay": t}
            out, state = rtkernels.causal_linear_attention(q, k, v, method=method, return_state=True, **kw)
            ref, ref_state = reference(q, k, v, gamma)
            what = f"{method} {dtype} decay {decay_dtype} {'rates' if rate else 'factors'} {values}"
            assert_close(out, ref, dtype, what, n=n)
            assert_close(state, ref_state, torch.float32 if dtype == torch.float32 else dtype, what + " state")


@pytest.mark.parametrize("segments", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_chunk_split_sequence_reads_the_device_decay(monkeypatch, dtype, segments):
    force_chunk(monkeypatch, segments=segments)
    q, k, v = _qkv(1, 2, 1000, 64, 64, dtype)
    s0 = torch.randn(1, 2, 64, 64, device="cuda") / 8
    d = torch.tensor([0.99, 0.9], device="cuda")
    out, state = rtkernels.causal_linear_attention(q, k, v, d, method="chunk", initial_state=s0, return_state=True)
    ref, ref_state = reference(q, k, v, d.cpu(), initial_state=s0)
    assert_close(out, ref, dtype, f"chunk segments={segments}", n=1000)
    assert_close(state, ref_state, torch.float32 if dtype == torch.float32 else dtype, "state")


@pytest.mark.parametrize("method", ALL_METHODS)
@pytest.mark.parametrize("rate", [False, True])
def test_an_invalid_device_value_poisons_its_head_only(method, rate):
    b, h, n, dk, dv = 2, 4, 130, 32, 16
    q, k, v = _qkv(b, h, n, dk, dv, torch.float32)
    bad = [0.9, 1.5, 0.0, math.nan] if not rate else [0.1, -0.5, math.inf, math.nan]
    t = torch.tensor(bad, device="cuda")
    kw = {"decay_rate": t} if rate else {"decay": t}
    out, state = rtkernels.causal_linear_attention(q, k, v, method=method, return_state=True, **kw)
    assert out[:, 1:].isnan().all() and state[:, 1:].isnan().all(), "invalid heads must be NaN everywhere"
    good = torch.tensor([0.9 if not rate else math.exp(-0.1)], dtype=torch.float64)
    ref, ref_state = reference(q[:, :1], k[:, :1], v[:, :1], good)
    assert_close(out[:, :1], ref, torch.float32, f"{method}: the valid head", n=n)
    assert_close(state[:, :1], ref_state, torch.float32, f"{method}: the valid head's state")
    previous = rtkernels.set_strict_decay(True)
    try:
        with pytest.raises(ValueError, match="decay_rate" if rate else "decay"):
            rtkernels.causal_linear_attention(q, k, v, method=method, **kw)
    finally:
        rtkernels.set_strict_decay(previous)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cached_call_follows_the_device_tensor(dtype):
    call_cache.clear()
    q, k, v = _qkv(2, 3, 300, 64, 64, dtype)
    d = torch.tensor([0.5, 0.9, 0.99], device="cuda")
    for values in ([0.5, 0.9, 0.99], [0.99, 0.999, 0.9]):
        d.copy_(torch.tensor(values))  # in place, as an optimizer step does
        out = rtkernels.causal_linear_attention(q, k, v, d, method="chunk")
        assert_close(out, reference(q, k, v, d.cpu())[0], dtype, f"in place {values}")
    other = torch.tensor([0.7, 0.8, 0.95], device="cuda")  # another tensor of the same layout
    out = rtkernels.causal_linear_attention(q, k, v, other, method="chunk")
    assert_close(out, reference(q, k, v, other.cpu())[0], dtype, "another tensor")
    assert call_cache.size() == 1
    d.fill_(2.0)  # invalid: NaN, never the old gamma
    assert rtkernels.causal_linear_attention(q, k, v, d, method="chunk").isnan().all()


def test_a_parameter_decay_is_cached_and_follows_optimizer_steps():
    """A model's decay as an nn.Parameter: one cached plan for inference (no_grad) and one for
    training, each following the values an in-place optimizer step writes; no host sync."""
    call_cache.clear()
    q, k, v = _qkv(2, 3, 300, 64, 64, torch.bfloat16)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    p = torch.nn.Parameter(torch.tensor([0.5, 0.9, 0.99], device="cuda"))
    opt = torch.optim.SGD([p], lr=1e-4)

    def step():
        with torch.no_grad():
            out = rtkernels.causal_linear_attention(q, k, v, p, method="chunk")
        out2 = rtkernels.causal_linear_attention(*leaves, p, method="chunk")
        out2.float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out, out2

    step()  # plans both calls
    assert call_cache.size() == 2
    before = p.detach().clone()
    with no_host_sync():
        out, out2 = step()
    assert call_cache.size() == 2  # both calls were cache hits
    assert not torch.equal(p.detach(), before)  # the step moved the decay
    for o in (out, out2):  # the values of the call's own time: after the first step, before the second
        assert_close(o, reference(q, k, v, before.cpu())[0], torch.bfloat16, "parameter decay")


def test_cached_call_sees_writes_that_bypass_the_version_counter():
    """A CPU decay tensor written through .numpy() or .data keeps its _version: the cached call
    keys host decays by value, so it uses the new values and rejects an invalid one."""
    call_cache.clear()
    q, k, v = _qkv(1, 2, 300, 64, 64, torch.float16)
    d = torch.tensor([0.5, 0.9])
    rtkernels.causal_linear_attention(q, k, v, d, method="chunk")
    d.numpy()[:] = [0.99, 0.9]
    out = rtkernels.causal_linear_attention(q, k, v, d, method="chunk")
    assert_close(out, reference(q, k, v, d)[0], torch.float16, "written through numpy()")
    d.data[1] = 0.999
    out = rtkernels.causal_linear_attention(q, k, v, d, method="chunk")
    assert_close(out, reference(q, k, v, d)[0], torch.float16, "written through .data")
    d.numpy()[0] = 1.5
    with pytest.raises(ValueError, match="decay"):
        rtkernels.causal_linear_attention(q, k, v, d, method="chunk")


@pytest.mark.parametrize("method", ["chunk", "scan"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_no_host_sync_forward_and_training(method, dtype):
    """Forward with a CUDA decay buffer, then forward + backward with a trainable CUDA decay, under
    torch's sync debug mode: any host sync raises."""
    b, h, n, d = 2, 4, 257, 64
    q, k, v = _qkv(b, h, n, d, d, dtype, requires_grad=True)
    gamma = torch.nn.Parameter(torch.tensor([0.5, 0.9, 0.99, 0.999], device="cuda"))
    rates = torch.nn.Parameter(torch.tensor([0.5, 0.1, 0.01, 0.0], device="cuda"))
    buf = torch.tensor([0.9, 0.99, 0.5, 1.0], device="cuda")

    def step():
        with torch.no_grad():
            rtkernels.causal_linear_attention(q, k, v, buf, method=method)
            rtkernels.causal_linear_attention(q, k, v, buf, method=method)  # the cached call
        for kw in ({"decay": gamma}, {"decay_rate": rates}):
            out, state = rtkernels.causal_linear_attention(q, k, v, method=method, return_state=True, **kw)
            (out.float().square().sum() + state.sum()).backward()

    run_without_host_sync(step)  # once outside the check (compiles, plans), once under it
    assert gamma.grad is not None and torch.isfinite(gamma.grad).all()
    assert rates.grad is not None and torch.isfinite(rates.grad).all()


def test_trainable_device_decay_gradient_matches_fp64():
    b, h, n, d = 2, 3, 300, 32
    q, k, v = _qkv(b, h, n, d, d, torch.float32, seed=3)
    gamma = torch.tensor([0.9, 0.99, 0.5], device="cuda", requires_grad=True)
    out = rtkernels.causal_linear_attention(q, k, v, gamma, method="chunk")
    w = torch.randn_like(out)
    (out * w).sum().backward()
    g64 = gamma.detach().double().requires_grad_(True)
    (reference(q, k, v, g64)[0] * w.double()).sum().backward()
    assert_close(gamma.grad, g64.grad, torch.float32, "dL/dgamma")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_graph_capture_with_a_device_decay(dtype):
    """Captured once, replayed after changing q and gamma in place: equal to an eager call."""
    q, k, v = _qkv(2, 4, 1024, 128, 128, dtype)
    gamma = torch.tensor([0.5, 0.9, 0.99, 0.999], device="cuda")
    rtkernels.causal_linear_attention(q, k, v, gamma, method="chunk")  # compile and plan first
    graph, out = capture(lambda: rtkernels.causal_linear_attention(q, k, v, gamma, method="chunk"))
    for values in ([0.8, 0.95, 0.999, 1.0], [0.99, 0.9, 0.5, 0.1]):
        gamma.copy_(torch.tensor(values))
        q.copy_(torch.randn_like(q))
        graph.replay()
        torch.cuda.synchronize()
        eager = rtkernels.causal_linear_attention(q, k, v, gamma, method="chunk")
        assert torch.equal(out, eager), "replay differs from the eager call"
        assert_close(out, reference(q, k, v, gamma.cpu())[0], dtype, f"replay {values}")
