"""The compiled entry of cached calls on the GPU (marker ``gpu``; rtkernels/compiled_call.py): a
repeated call is answered by the C++ entry (Python's signature is never computed), its output,
final state and gradients equal Python's path bit for bit and the fp64 reference within the
dtype's tolerance, with no host sync and inside a CUDA graph; what it does not know (strict
decay checks, overrides, a CPU decay tensor) takes Python's path; float32 that follows torch's
matmul setting is keyed by that setting."""

from __future__ import annotations

import math

import pytest
import torch

import rtkernels
from graphs import assert_replays_like_eager
from inputs import make_qkv, make_state, no_host_sync, to_bhnd
from reference import reference
from rtkernels import call_cache, compiled_call
from rtkernels.methods.chunk import override
from tolerances import assert_close, row_error, row_tolerance

pytestmark = pytest.mark.gpu

GAMMAS = (0.9, 0.99, 1e-6, 1.0)  # 0.9 and 0.99: where a wrong power of gamma shows in fp32 and fp16
cla = rtkernels.causal_linear_attention


@pytest.fixture
def entry(monkeypatch):
    """The compiled entry, built and empty; yields a list counting Python's signatures (each call
    that reached Python's cached path or the full path computes one)."""
    if not compiled_call.enabled():
        pytest.skip(f"{compiled_call.ENV}=0: this run tests Python's cached path")
    assert compiled_call.build(wait=True), compiled_call.status()
    keys = []
    real = call_cache.call_key

    def counted(*args, **kwargs):
        keys.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(call_cache, "call_key", counted)
    call_cache.clear()
    yield keys
    call_cache.clear()


def _python_path(monkeypatch, fn):
    """``fn()`` with the compiled entry out of the way."""
    with compiled_call.suspended():
        return fn()


def _decay(form, dtype=torch.float32):
    g = torch.tensor(GAMMAS, dtype=torch.float64)
    if form == "float":
        return {"decay": 0.99}, torch.full((len(GAMMAS),), 0.99, dtype=torch.float64)
    if form == "none":
        return {}, torch.ones(len(GAMMAS), dtype=torch.float64)
    if form == "rate":
        r = (-torch.log(g)).to(dtype).cuda()
        return {"decay_rate": r}, torch.exp(-r.double().cpu())
    t = g.to(dtype).cuda()
    return {"decay": t}, t.double().cpu()


CASES = [  # dtype, fp32 mode, layout, b, n, dk, dv, decay form, state in and out
    (torch.bfloat16, None, "bhnd", 2, 300, 64, 128, "tensor", False),
    (torch.bfloat16, None, "bnhd", 1, 1, 128, 64, "rate", True),
    (torch.float16, None, "bhnd", 2, 65, 128, 128, "float", True),
    (torch.float16, None, "bnhd", 1, 1000, 64, 64, "none", False),
    (torch.float32, "tf32", "bhnd", 2, 130, 128, 128, "tensor", True),
    (torch.float32, "exact", "bnhd", 1, 63, 64, 128, "rate", False),
    (torch.float32, "tf32", "bhnd", 1, 8192, 128, 128, "tensor", True),  # long: split, states pass and scan
    (torch.bfloat16, None, "bhnd", 1, 8192, 128, 128, "tensor", True),  # long 16-bit: a states pass (on
    (torch.float16, None, "bnhd", 1, 5000, 64, 128, "rate", False),      # Hopper by tensor maps), then fused
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x).replace("torch.", "") for x in c))
def test_compiled_forward_equals_python_and_reference(entry, monkeypatch, case):
    dtype, prec, layout, b, n, dk, dv, form, with_state = case
    h = len(GAMMAS)
    q, k, v = (x.cuda() for x in make_qkv(1, b, h, n, dk, dv, dtype, layout))
    kw, gamma = _decay(form)
    s0 = make_state(2, b, h, dk, dv, torch.float32).cuda() if with_state else None
    opts = dict(kw, method="chunk", layout=layout, initial_state=s0, return_state=with_state, fp32_precision=prec)
    first = cla(q, k, v, **opts)  # the full path, which registers the call
    assert compiled_call.size() == 1 and len(entry) == 1
    q2, k2, v2 = (x.cuda() for x in make_qkv(3, b, h, n, dk, dv, dtype, layout))  # new data, same signature
    got = cla(q2, k2, v2, **opts)
    assert len(entry) == 1, "the repeated call reached Python's signature"
    want = _python_path(monkeypatch, lambda: cla(q2, k2, v2, **opts))
    got, want = (x if with_state else (x, None) for x in (got, want))
    assert torch.equal(got[0], want[0]) and got[0].dtype == dtype and got[0].is_contiguous()
    ref, ref_state = reference(q2, k2, v2, gamma.cuda(), layout=layout, initial_state=s0)
    if prec == "tf32":  # 10-bit operands: tests/test_gpu_fp32.py's bounds (relative Frobenius, max / max |ref|)
        for x, r in ((got[0], ref), (got[1], ref_state)) if with_state else ((got[0], ref),):
            err = (x.double() - r).to(torch.float64)
            assert float(err.norm() / r.norm()) <= 2e-3 and float(err.abs().max() / r.abs().max()) <= 1e-2, case
    else:
        assert row_error(to_bhnd(got[0], layout), to_bhnd(ref, layout)) <= row_tolerance(dtype, n), case
        assert_close(got[0], ref, dtype, f"compiled {case}", n=n)
        if with_state:
            assert_close(got[1], ref_state, torch.float32 if dtype == torch.float32 else dtype, f"state {case}")
    if with_state:
        assert torch.equal(got[1], want[1])
    del first


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32), ids=str)
@pytest.mark.parametrize("trainable", (False, True))
@pytest.mark.parametrize("layout", ("bhnd", "bnhd"))
@pytest.mark.parametrize("n", (200, 8192))
def test_compiled_training_call_equals_python(entry, monkeypatch, dtype, trainable, layout, n):
    """q, k, v, the initial state and (``trainable``) the decay require grad; the output, the final
    state and every gradient equal Python's path bit for bit. n = 8192 splits the sequence: the
    forward's states-pass slots (16-bit) reach the backward through the entry's node."""
    b, h, dk, dv = 2, len(GAMMAS), 64, 128
    prec = "tf32" if dtype == torch.float32 else None
    decay = torch.nn.Parameter(torch.tensor(GAMMAS[:2] * 2, device="cuda").clamp(max=0.999),
                               requires_grad=trainable)

    def step(seed):
        q, k, v = (x.cuda().requires_grad_() for x in make_qkv(seed, b, h, n, dk, dv, dtype, layout))
        s0 = make_state(seed + 1, b, h, dk, dv, torch.float32).cuda().requires_grad_()
        out, state = cla(q, k, v, decay, method="chunk", layout=layout, initial_state=s0, return_state=True,
                         fp32_precision=prec)
        g = torch.Generator(device="cuda").manual_seed(seed + 2)
        loss = (out.float() * torch.randn(out.shape, generator=g, device="cuda")).sum() + state.square().sum()
        decay.grad = None
        loss.backward()
        return out, state, q.grad, k.grad, v.grad, s0.grad, decay.grad

    step(0)  # registers
    assert compiled_call.size() == 1
    keys = len(entry)
    got = step(5)
    assert len(entry) == keys, "the repeated training call reached Python's signature"
    want = _python_path(monkeypatch, lambda: step(5))
    for name, x, y in zip(("out", "state", "dq", "dk", "dv", "ds0", "ddecay"), got, want):
        if y is None:
            assert x is None, name
        else:
            assert torch.equal(x, y), name
    assert (got[-1] is not None) == trainable


def test_compiled_unused_output_and_state(entry, monkeypatch):
    """Gradients reach the inputs through the state alone (the output unused) and through the
    output alone (the state unused), as on Python's path."""
    q, k, v = (x.cuda().requires_grad_() for x in make_qkv(0, 1, 4, 70, 64, 64, torch.float16))
    decay = torch.tensor(GAMMAS, device="cuda")

    def grads(use):
        for x in (q, k, v):
            x.grad = None
        out, state = cla(q, k, v, decay, return_state=True)
        (state.sum() if use == "state" else out.float().sum()).backward()
        return [x.grad for x in (q, k, v)]

    grads("out")  # registers
    keys = len(entry)
    got = {use: grads(use) for use in ("state", "out")}
    assert len(entry) == keys and compiled_call.size() == 1
    for use in ("state", "out"):
        for x, y in zip(got[use], _python_path(monkeypatch, lambda: grads(use))):
            assert torch.equal(x, y), use


def test_compiled_second_derivative_raises(entry, monkeypatch):
    """Not twice differentiable, loudly, as the Python Function (``once_differentiable``)."""
    q, k, v = (x.cuda().requires_grad_() for x in make_qkv(0, 1, 2, 40, 16, 16, torch.float32))
    w = torch.randn(1, 2, 40, 16, device="cuda", requires_grad=True)

    def second():
        out = cla(q, k, v, 0.9, method="chunk", fp32_precision="exact")
        (gq,) = torch.autograd.grad(out, q, grad_outputs=w, create_graph=True)
        with pytest.raises(RuntimeError, match="differentiate twice"):
            gq.sum().backward()

    second()  # registers
    keys = len(entry)
    second()
    assert len(entry) == keys and compiled_call.size() == 1
    _python_path(monkeypatch, second)


@pytest.mark.parametrize("trainable", (False, True))
def test_compiled_call_is_sync_free_and_capturable(entry, trainable):
    """A forward (and with a trainable decay a training step) on the compiled entry: no host sync,
    and a CUDA graph of it replays like eager calls on new values."""
    b, h, n, d = 2, 4, 256, 64
    dtype = torch.bfloat16
    q, k, v = (x.cuda() for x in make_qkv(0, b, h, n, d, d, dtype))
    decay = torch.nn.Parameter(torch.tensor([0.9, 0.99, 0.5, 0.999], device="cuda"), requires_grad=trainable)
    if trainable:
        for x in (q, k, v):
            x.requires_grad_()

    def step():
        out = cla(q, k, v, decay, method="chunk")
        if not trainable:
            return (out,)
        for x in (q, k, v, decay):
            x.grad = None
        out.float().square().sum().backward()
        return out, q.grad, k.grad, v.grad, decay.grad

    def change():
        for x in (q, k, v):
            x.mul_(0.5)
        decay.copy_(torch.tensor([0.95, 0.9, 0.99, 0.7], device="cuda"))

    cla(q, k, v, decay, method="chunk")
    cla(q, k, v, decay, method="chunk")  # registered by now
    keys = len(entry)
    with no_host_sync():
        step()
    assert len(entry) == keys, "the step left the compiled entry"
    eager = assert_replays_like_eager(step, change)
    ref, _ = reference(q.detach(), k.detach(), v.detach(), decay.detach().double())
    assert_close(eager[0], ref, dtype, "after the graph", n=n)


def test_compiled_call_follows_the_current_stream(entry):
    q, k, v = (x.cuda() for x in make_qkv(0, 2, 4, 500, 64, 64, torch.float16))
    decay = torch.tensor([0.9, 0.99, 0.5, 1.0], device="cuda")
    cla(q, k, v, decay)
    want = cla(q, k, v, decay)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(1_000_000)  # the side stream is busy: a launch on the wrong stream would race
        got = cla(q, k, v, decay)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(got, want)


def test_what_the_compiled_entry_leaves_to_python(entry):
    q, k, v = (x.cuda() for x in make_qkv(0, 1, 4, 100, 64, 64, torch.bfloat16))
    q32, k32, v32 = (x.float() for x in (q, k, v))
    decay = torch.tensor([0.9, 0.99, 0.5, 1.0], device="cuda")

    def calls_reaching_python(fn, times=3):
        before = len(entry)
        for _ in range(times):
            fn()
        return len(entry) - before

    assert calls_reaching_python(lambda: cla(q, k, v, decay)) == 1  # the first, which registers it
    assert calls_reaching_python(lambda: cla(q, k, v, decay.cpu())) == 3  # a CPU decay is keyed by value
    assert calls_reaching_python(lambda: cla(q32, k32, v32, decay, fp32_precision="tf32")) == 1
    # float32 following torch's matmul setting: keyed by the setting, read on every call
    previous = torch.get_float32_matmul_precision()
    try:
        for setting, mode in (("highest", "exact"), ("high", "tf32")):
            torch.set_float32_matmul_precision(setting)
            assert calls_reaching_python(lambda: cla(q32, k32, v32, decay)) == 1, setting  # registers it
            got = cla(q32, k32, v32, decay)
            with compiled_call.suspended():
                want = cla(q32, k32, v32, decay, fp32_precision=mode)
            assert torch.equal(got, want), setting
        torch.set_float32_matmul_precision("highest")
        assert calls_reaching_python(lambda: cla(q32, k32, v32, decay)) == 0  # the first setting's entry
    finally:
        torch.set_float32_matmul_precision(previous)
    with override(segments=2):
        assert calls_reaching_python(lambda: cla(q, k, v, decay)) == 3
    previous = rtkernels.set_strict_decay(True)
    try:
        assert calls_reaching_python(lambda: cla(q, k, v, decay)) == 3
    finally:
        rtkernels.set_strict_decay(previous)
    assert calls_reaching_python(lambda: cla(q, k, v, decay)) == 0
    call_cache.clear()
    assert compiled_call.size() == 0
    assert calls_reaching_python(lambda: cla(q, k, v, decay)) == 1


def test_invalid_device_decay_gives_nan_heads_on_the_compiled_entry(entry):
    """A value outside (0, 1] in a CUDA decay makes that head's outputs NaN (no sync to raise)."""
    q, k, v = (x.cuda() for x in make_qkv(0, 1, 4, 64, 32, 32, torch.float16))
    decay = torch.tensor([0.9, 0.99, 0.5, 1.0], device="cuda")
    cla(q, k, v, decay)
    decay[1] = 1.5
    decay[2] = math.nan
    out = cla(q, k, v, decay)
    assert compiled_call.size() == 1
    assert out[:, 1:3].isnan().all() and not out[:, [0, 3]].isnan().any()
