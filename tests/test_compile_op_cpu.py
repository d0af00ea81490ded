"""The torch.library ops (rtkernels.ops) on the CPU: torch.compile(fullgraph=True) of a two-layer model
equals eager (forward and backward, decay trainable or not) and the fp64 reference; no graph break;
torch.library.opcheck; the eager call never takes the op; vmap, torch.func.grad and the errors.

Compiling is slow on two cores, so there are few compiled graphs: two with aot_eager, one with inductor."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import rtkernels
from rtkernels import api, ops
from rtkernels.decay import KIND_FACTOR, KIND_RATE

from reference import reference

B, N, E, H, D = 2, 21, 12, 3, 4  # N not a multiple of anything the methods chunk by


def _reference_attention(q, k, v, decay=None, *, decay_rate=None, scale=1.0, layout="bhnd", initial_state=None,
                         return_state=False, **_):
    """The fp64 reference with the library's signature (factors or rates, a tensor or a float)."""
    h = q.shape[1 if layout == "bhnd" else 2]
    gamma = decay if decay_rate is None else torch.exp(-torch.as_tensor(decay_rate, dtype=torch.float64))
    gamma = torch.as_tensor(gamma, dtype=torch.float64).expand(h)
    o, s = reference(q, k, v, gamma, scale, layout, initial_state)
    return (o, s) if return_state else o


class Layer(nn.Module):
    """Projections around one call: ``layout`` "bnhd" reads the heads straight from the projection;
    ``attention_dtype`` casts q, k, v for the call (mixed precision) and its output back."""

    def __init__(self, layout: str, rate: bool, trainable: bool, seed: int, sizes=(E, H, D), attention_dtype=None):
        super().__init__()
        e, h, d = sizes
        g = torch.Generator().manual_seed(seed)
        self.layout, self.rate, self.h, self.d, self.attention_dtype = layout, rate, h, d, attention_dtype
        self.qkv = nn.Parameter(torch.randn(e, 3 * h * d, generator=g) / math.sqrt(e))
        self.out = nn.Parameter(torch.randn(h * d, e, generator=g) / math.sqrt(h * d))
        decay = torch.linspace(0.05, 1.5, h) if rate else torch.linspace(0.5, 1.0, h)
        if trainable:
            self.decay = nn.Parameter(decay)
        else:
            self.register_buffer("decay", decay)

    def forward(self, x, attention, initial_state=None):
        b, n, _ = x.shape
        q, k, v = (x @ self.qkv).view(b, n, 3, self.h, self.d).unbind(2)  # [B, N, H, D] views
        if self.attention_dtype is not None:
            q, k, v = (t.to(self.attention_dtype) for t in (q, k, v))
        if self.layout == "bhnd":
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        arg = {"decay_rate": self.decay} if self.rate else {"decay": self.decay}
        o, state = attention(q, k, v, **arg, scale=self.d ** -0.5, layout=self.layout, initial_state=initial_state,
                             return_state=True)
        if self.layout == "bhnd":
            o = o.transpose(1, 2)
        return x + o.reshape(b, n, -1).to(x.dtype) @ self.out, state


class Model(nn.Module):
    """Two layers: factors in "bnhd", then rates in "bhnd" continuing from an initial state."""

    def __init__(self, trainable: bool, sizes=(E, H, D), attention_dtype=None):
        super().__init__()
        self.one = Layer("bnhd", rate=False, trainable=trainable, seed=1, sizes=sizes, attention_dtype=attention_dtype)
        self.two = Layer("bhnd", rate=True, trainable=trainable, seed=2, sizes=sizes, attention_dtype=attention_dtype)

    def forward(self, x, s0, attention=rtkernels.causal_linear_attention):
        y, _ = self.one(x, attention)
        y, state = self.two(torch.tanh(y), attention, s0)
        return y, state


def _inputs(sizes=(B, N, E, H, D), device="cpu", seed=0):
    """The model's input x ``[B, N, E]`` and initial state ``[B, H, D, D]`` (float32)."""
    b, n, e, h, d = sizes
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, n, e, generator=g).to(device)
    s0 = (torch.randn(b, h, d, d, generator=g) / d).to(device)
    return x, s0


def _run(model, fn, x, s0):
    """Output, state and every gradient (parameters, x, s0) of one forward and backward, as copies
    (a CUDA graph's replay reuses its memory)."""
    model.zero_grad(set_to_none=True)
    x, s0 = x.detach().clone().requires_grad_(), s0.detach().clone().requires_grad_()
    y, state = fn(x, s0)
    (y.float().square().mean() + state.square().mean()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return y.detach().clone(), state.detach().clone(), {"x": x.grad.clone(), "s0": s0.grad.clone(), **grads}


def _compare(got, want, **tol):
    for a, b in zip(got[:2], want[:2]):
        torch.testing.assert_close(a, b.to(a.dtype), **tol)
    assert got[2].keys() == want[2].keys()
    for name in got[2]:
        torch.testing.assert_close(got[2][name], want[2][name].to(got[2][name].dtype), **tol, msg=name)


def _check_model(trainable: bool, backend: str) -> None:
    torch.manual_seed(0)
    eager_model = Model(trainable)
    compiled_model = copy.deepcopy(eager_model)
    reference_model = copy.deepcopy(eager_model).double()
    x, s0 = _inputs()
    eager = _run(eager_model, eager_model, x, s0)
    compiled = _run(compiled_model, torch.compile(compiled_model, fullgraph=True, backend=backend), x, s0)
    _compare(compiled, eager, rtol=2e-5, atol=2e-6)
    assert ("one.decay" in compiled[2]) == trainable and all(g is not None for g in compiled[2].values())
    # and both equal the fp64 reference (the same model on reference attention, autograd's gradients)
    ref = _run(reference_model, lambda x, s0: reference_model(x, s0, _reference_attention), x.double(), s0.double())
    _compare(compiled, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("trainable", [True, False], ids=["decay-trainable", "decay-buffer"])
def test_compiled_model_equals_eager_aot_eager(trainable):
    _check_model(trainable, "aot_eager")


def test_compiled_model_equals_eager_inductor():
    _check_model(True, "inductor")


def test_one_graph_no_break_and_the_op_in_it():
    model = Model(trainable=True)
    x, s0 = _inputs()
    explained = torch._dynamo.explain(model)(x, s0)
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
    targets = [n.target for gm in explained.graphs for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.rtkernels.causal_linear_attention.default) == 2


def test_dynamic_shapes_and_symbolic_floats():
    """dynamic=True: the sequence length and the float decay and scale are symbols of one graph,
    checked and resolved when the op runs."""
    def f(q, gamma, scale):
        return rtkernels.causal_linear_attention(q, q, q, gamma, scale=scale, layout="bnhd")

    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend="aot_eager")
    for n, gamma, scale in ((10, 0.9, 0.5), (33, 0.7, 0.25)):
        q = torch.randn(2, n, H, D, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
        want = _reference_attention(q, q, q, gamma, scale=scale, layout="bnhd")
        torch.testing.assert_close(compiled(q, gamma, scale), want, rtol=1e-9, atol=1e-10)
    # checked while tracing (dynamo wraps the fake implementation's ValueError) or when the op runs
    with pytest.raises((ValueError, RuntimeError), match=r"decay must be a factor gamma in \(0, 1\], got 1.5"):
        compiled(q, 1.5, 0.5)


def _qkv(layout="bhnd", dtype=torch.float64, dv=5, grad=True):
    g = torch.Generator().manual_seed(3)
    shape = (B, H, N, D) if layout == "bhnd" else (B, N, H, D)
    q, k = (torch.randn(*shape, generator=g, dtype=dtype) / 3 for _ in range(2))
    v = torch.randn(*shape[:3], dv, generator=g, dtype=dtype)
    return tuple(t.requires_grad_(grad) for t in (q, k, v))


OPCHECK_CASES = {
    "float-decay": lambda: (*_qkv(dtype=torch.float32), None, KIND_FACTOR, 0.9, 0.5, "auto", "bhnd", None, False,
                            None),
    "factors-state": lambda: (*_qkv(), torch.tensor([0.9, 0.5, 1.0], dtype=torch.float64, requires_grad=True),
                              KIND_FACTOR, None, 1.0, "chunk", "bhnd",
                              torch.randn(B, H, D, 5, dtype=torch.float64, requires_grad=True), True, None),
    "rates-bnhd": lambda: (*_qkv("bnhd", torch.float32), torch.tensor([0.1, 0.0, 2.0], requires_grad=True),
                           KIND_RATE, None, 0.7, "scan", "bnhd", None, True, "exact"),
}


@pytest.mark.parametrize("case", OPCHECK_CASES)
def test_opcheck_forward(case):
    torch.library.opcheck(ops.forward_op, OPCHECK_CASES[case]())


def test_opcheck_backward():
    q, k, v = _qkv(grad=False)
    g = torch.Generator().manual_seed(4)
    grad_out, grad_state = torch.randn(B, H, N, 5, generator=g, dtype=torch.float64), torch.randn(
        B, H, D, 5, generator=g, dtype=torch.float64)
    decay, s0 = torch.tensor([0.9, 0.5, 1.0], dtype=torch.float64), torch.randn(B, H, D, 5, dtype=torch.float64)
    torch.library.opcheck(ops.backward_op, (grad_out, grad_state, q, k, v, decay, KIND_FACTOR, None, 0.5, "bhnd",
                                            s0, None, True, True))
    torch.library.opcheck(ops.backward_op, (grad_out, None, q, k, v, None, KIND_RATE, 0.2, 1.0, "bhnd", None, None,
                                            False, False))


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("rate", [False, True], ids=["factors", "rates"])
def test_op_equals_fp64_reference_with_gradients(layout, rate):
    """The op in eager mode (ops.causal_linear_attention) against the fp64 reference: output, final
    state and the gradients of q, k, v, the decay tensor and the initial state (autograd through
    the reference)."""
    q, k, v = _qkv(layout)
    values = [0.05, 0.4, 1.5] if rate else [0.5, 0.9, 1.0]
    decay = torch.tensor(values, dtype=torch.float64, requires_grad=True)
    s0 = torch.randn(B, H, D, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(5)).requires_grad_()
    arg = {"decay_rate": decay} if rate else {"decay": decay}
    inputs = (q, k, v, decay, s0)
    got = ops.causal_linear_attention(q, k, v, **arg, scale=0.6, layout=layout, initial_state=s0, return_state=True)
    want = _reference_attention(q, k, v, **arg, scale=0.6, layout=layout, initial_state=s0, return_state=True)
    weights = [torch.randn(t.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(6)) for t in want]
    grads_got = torch.autograd.grad(sum((w * t).sum() for w, t in zip(weights, got)), inputs)
    grads_want = torch.autograd.grad(sum((w * t).sum() for w, t in zip(weights, want)), inputs)
    for a, b in zip((*got, *grads_got), (*want, *grads_want)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
    assert got[0].is_contiguous() and grads_got[0].is_contiguous()


def test_op_equals_the_eager_call_bitwise():
    q, k, v = _qkv(dtype=torch.float32, grad=False)
    for arg in ({"decay": 0.8}, {"decay_rate": torch.tensor([0.1, 0.2, 0.3])}, {}):
        assert torch.equal(ops.causal_linear_attention(q, k, v, **arg, scale=0.3),
                           rtkernels.causal_linear_attention(q, k, v, **arg, scale=0.3))


def test_eager_calls_never_take_the_op(monkeypatch):
    def fail(*args):
        raise AssertionError("the eager call went through the op")

    monkeypatch.setattr(api, "op_call", fail)
    q, k, v = _qkv(dtype=torch.float32)
    rtkernels.causal_linear_attention(q, k, v, torch.tensor([0.5, 0.9, 1.0], requires_grad=True)).sum().backward()
    rtkernels.causal_linear_attention(q.detach(), k.detach(), v.detach(), 0.9)


def test_vmap_folds_into_the_batch():
    g = torch.Generator().manual_seed(7)
    qs, ks, vs = (torch.randn(3, B, H, N, D, generator=g).div(3).requires_grad_() for _ in range(3))
    s0 = torch.randn(B, H, D, D, generator=g).requires_grad_()
    decay = torch.tensor([0.5, 0.9, 1.0], requires_grad=True)
    inputs = (qs, ks, vs, s0, decay)

    def call(q, k, v, s):
        return rtkernels.causal_linear_attention(q, k, v, decay, initial_state=s, return_state=True)

    got = torch.func.vmap(call, in_dims=(0, 0, 0, None))(qs, ks, vs, s0)
    want = [call(q, k, v, s0) for q, k, v in zip(qs, ks, vs)]
    want = [torch.stack([w[i] for w in want]) for i in range(2)]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    # torch.autograd through the vmapped call: every gradient, the shared decay's included
    grads = torch.autograd.grad(got[0].square().sum() + got[1].sum(), inputs)
    for a, b in zip(grads, torch.autograd.grad(want[0].square().sum() + want[1].sum(), inputs)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # the backward op under vmap: a batch of incoming gradients at once
    out = ops.causal_linear_attention(qs[0], ks[0], vs[0], 0.9)
    basis = torch.randn(2, *out.shape, generator=g)
    batched = torch.autograd.grad(out, qs, basis, is_grads_batched=True, retain_graph=True)[0]
    for i in range(2):
        torch.testing.assert_close(batched[i], torch.autograd.grad(out, qs, basis[i], retain_graph=True)[0])
    with pytest.raises(NotImplementedError, match="decay tensor batched by vmap"):
        torch.func.vmap(lambda q, d: rtkernels.causal_linear_attention(q, q, q, d))(qs, torch.rand(3, H))
    with pytest.raises(NotImplementedError, match="torch.func transforms other than vmap"):
        torch.func.grad(lambda q: rtkernels.causal_linear_attention(q, q, q, 0.9).sum())(qs[0].detach())


def test_double_backward_is_a_clear_error():
    q, k, v = _qkv()
    out = ops.causal_linear_attention(q, k, v, 0.9)
    dq, = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="not twice differentiable"):
        dq.sum().backward()


def test_bad_input_names_the_argument():
    q, k, v = _qkv(dtype=torch.float32, grad=False)
    with pytest.raises(TypeError, match="scale must be a real number"):
        ops.causal_linear_attention(q, k, v, scale="1")
    with pytest.raises(TypeError, match="decay must be a float or a tensor"):
        ops.causal_linear_attention(q, k, v, [0.9, 0.9, 0.9])
    with pytest.raises(ValueError, match="decay must be a factor gamma in"):
        ops.causal_linear_attention(q, k, v, 1.5)
    with pytest.raises(ValueError, match="decay_rate must be a float or a tensor of shape"):
        ops.causal_linear_attention(q, k, v, decay_rate=torch.ones(2))
    with pytest.raises(ValueError, match="layout must be one of"):
        ops.causal_linear_attention(q, k, v, layout="nhd")
    with pytest.raises(ValueError, match="method must be one of"):
        ops.causal_linear_attention(q, k, v, method="fast")
    with pytest.raises(ValueError, match="not both"):
        ops.causal_linear_attention(q, k, v, 0.9, decay_rate=0.1)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        ops.causal_linear_attention(q.numpy(), k, v)
