"""The compiled entry's autograd node on the CPU, through a copy that takes CPU tensors and
launches nothing (tests/compiled_cpu_copy.py): its gradients equal the Python Function's bit for
bit (the same backward body on the node's saved tensors), for a trainable decay and for a state in
and out through either output; an in-place change of a saved input raises; a second derivative
raises; saved-tensor hooks apply as on the Python Function. Float32 without an explicit precision
is keyed by torch's matmul setting."""

import pytest
import torch

import rtkernels
from rtkernels import compiled_call
from compiled_cpu_copy import build_cpu_copy, init, register
from rtkernels.decay import LogDecay

B, H, N, D = 2, 3, 70, 16


@pytest.fixture(scope="module")
def ext():
    return build_cpu_copy()


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, N, D, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3))
    s0 = torch.randn(B, H, D, D, generator=g, dtype=torch.float64).requires_grad_()
    return q, k, v, s0, torch.randn(B, H, N, D, generator=g, dtype=torch.float64), \
        torch.randn(B, H, D, D, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("layout", ("bhnd", "bnhd"))
def test_trainable_decay_gradients_equal_the_python_function(ext, layout):
    q, k, v, _, g, _ = _inputs(0)
    if layout == "bnhd":
        q, k, v, g = (x.detach().transpose(1, 2).contiguous().requires_grad_(x.requires_grad) for x in (q, k, v, g))
    gamma = torch.nn.Parameter(torch.tensor([0.9, 0.99, 0.5], dtype=torch.float64))
    args = (q, k, v, gamma, None, 1.0, "chunk", layout, None, False, "exact")
    assert register(ext, args, v)
    out = ext.call(*args)
    assert out.grad_fn is not None and out.shape == v.shape
    want = rtkernels.causal_linear_attention(q, k, v, gamma, method="chunk", layout=layout, fp32_precision="exact")
    for a, b in zip(torch.autograd.grad(out, (q, k, v, gamma), g), torch.autograd.grad(want, (q, k, v, gamma), g)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("through", ("both", "out", "state"))
def test_state_gradients_equal_the_python_function(ext, through):
    q, k, v, s0, g, gs = _inputs(1)
    args = (q, k, v, 0.9, None, 1.0, "chunk", "bhnd", s0, True, "exact")
    assert register(ext, args, v, (B, H, D, D), LogDecay.from_rate_or_factor(0.9, False, H, torch.device("cpu")))
    got = ext.call(*args)
    want = rtkernels.causal_linear_attention(q, k, v, 0.9, method="chunk", initial_state=s0, return_state=True,
                                             fp32_precision="exact")
    pick = {"both": (0, 1), "out": (0,), "state": (1,)}[through]
    grads = [(g, gs)[i] for i in pick]
    a = torch.autograd.grad([got[i] for i in pick], (q, k, v, s0), grads, allow_unused=True)
    b = torch.autograd.grad([want[i] for i in pick], (q, k, v, s0), grads, allow_unused=True)
    for x, y in zip(a, b):
        assert (x is None) == (y is None) and (x is None or torch.equal(x, y))


def test_in_place_change_of_a_saved_input_raises(ext):
    q, k, v, _, g, _ = _inputs(2)
    args = (q, k, v, 0.9, None, 1.0, "chunk", "bhnd", None, False, "exact")
    assert register(ext, args, v, host_decay=LogDecay.from_rate_or_factor(0.9, False, H, torch.device("cpu")))
    out = ext.call(*args)
    with torch.no_grad():
        k.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward(g)


def test_second_derivative_raises(ext):
    q, k, v, _, g, _ = _inputs(3)
    w = g.clone().requires_grad_()
    args = (q, k, v, 0.9, None, 1.0, "chunk", "bhnd", None, False, "exact")
    assert register(ext, args, v, host_decay=LogDecay.from_rate_or_factor(0.9, False, H, torch.device("cpu")))
    (gq,) = torch.autograd.grad(ext.call(*args), q, w, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        gq.sum().backward()


def test_float32_is_keyed_by_torch_matmul_setting(ext):
    """fp32_precision None follows torch.get_float32_matmul_precision(): the entry reads it on each
    call, so a changed setting misses (Python's path then plans for it) and the old one hits again."""
    q = torch.randn(B, H, N, D, dtype=torch.float32)
    args = (q, q, q, 0.9, None, 1.0, "chunk", "bhnd", None, False, None)
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        with torch.no_grad():
            assert register(ext, args, q, grad=False)
            assert ext.call(*args) is not compiled_call.MISS
            for setting in ("high", "medium"):
                torch.set_float32_matmul_precision(setting)
                assert ext.call(*args) is compiled_call.MISS, setting
            torch.set_float32_matmul_precision("highest")
            assert ext.call(*args) is not compiled_call.MISS
            q16 = q.to(torch.bfloat16)  # other dtypes ignore the setting
            args16 = (q16, q16, q16) + args[3:]
            assert register(ext, args16, q16, grad=False)
            torch.set_float32_matmul_precision("high")
            assert ext.call(*args16) is not compiled_call.MISS
    finally:
        torch.set_float32_matmul_precision(previous)


def test_saved_tensor_hooks_apply_as_on_the_python_function(ext):
    """torch.autograd.graph.saved_tensors_hooks (activation offloading, checkpointing tools) pack
    and unpack the node's saved inputs as they do the Python Function's, and the gradients match."""
    q, k, v, s0, g, _ = _inputs(4)
    args = (q, k, v, 0.9, None, 1.0, "chunk", "bhnd", s0, False, "exact")
    assert register(ext, args, v, host_decay=LogDecay.from_rate_or_factor(0.9, False, H, torch.device("cpu")))

    def run(fn):
        packed, unpacked = [], []

        def pack(t):
            packed.append(t.shape)
            return t.clone()  # a copy, as an offloading hook makes

        def unpack(t):
            unpacked.append(t.shape)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            out = fn()
        grads = torch.autograd.grad(out, (q, k, v, s0), g)
        return sorted(packed), sorted(unpacked), grads

    got = run(lambda: ext.call(*args))
    want = run(lambda: rtkernels.causal_linear_attention(q, k, v, 0.9, method="chunk", initial_state=s0,
                                                         fp32_precision="exact"))
    assert got[0] == want[0] and len(got[0]) == 4  # q, k, v and the initial state
    assert got[1] == want[1]
    for a, b in zip(got[2], want[2]):
        assert torch.equal(a, b)


def test_the_kept_temporary_reaches_the_backward_in_its_shape(ext):
    """A program's temporaries are allocated in the shapes registered (a split forward's slots, as
    Python's path allocates them), and the kept one reaches the node's backward as it is."""
    seen = []

    def spy(info, q, k, v, decay, s0, kept, *rest):
        seen.append(None if kept is None else (tuple(kept.shape), kept.dtype))
        return compiled_call.node_backward(info, q, k, v, decay, s0, kept, *rest)

    init(ext, spy)
    try:
        q, k, v, _, g, _ = _inputs(5)
        args = (q, k, v, 0.9, None, 1.0, "chunk", "bhnd", None, False, "exact")
        slots = (3, B * H, D, D)
        assert register(ext, args, v, host_decay=LogDecay.from_rate_or_factor(0.9, False, H, torch.device("cpu")),
                        temps=((7,), slots), keep=1)
        ext.call(*args).backward(g)
        assert seen == [(slots, torch.float32)]
    finally:
        init(ext, compiled_call.node_backward)
