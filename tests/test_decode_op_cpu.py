"""The decode step as ``torch.ops.rtkernels.decode``: torch.library.opcheck, torch.compile with
fullgraph (the pool updated in place as the eager step updates it, T = 1 and T = 3, both layouts,
indices with padding, a decay tensor), the layer's generation step compiled whole, and the errors
for what the op does not do. The eager step never takes the op."""

from __future__ import annotations

import pytest
import torch

import rtkernels
from rtkernels import decode_op
from rtkernels.decay import KIND_FACTOR, KIND_RATE


def _step_inputs(b=2, h=3, t=1, dk=8, dv=5, slots=4, layout="bhnd", seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (lambda d: (b, h, t, d)) if layout == "bhnd" else (lambda d: (b, t, h, d))
    q, k = (torch.randn(shape(dk), generator=g) / dk ** 0.5 for _ in range(2))
    v = torch.randn(shape(dv), generator=g)
    pool = torch.randn(slots, h, dk, dv, generator=g) / 4
    return q, k, v, pool


def test_opcheck():
    q, k, v, pool = _step_inputs()
    idx = torch.tensor([2, -1], dtype=torch.int32)
    torch.library.opcheck(decode_op.decode_op, (q, k, v, pool, torch.tensor([0.9, 0.5, 1.0]), KIND_FACTOR, None,
                                                0.7, idx, "bhnd"))
    q, k, v, pool = _step_inputs(t=3, layout="bnhd")
    torch.library.opcheck(decode_op.decode_op, (q, k, v, pool, None, KIND_RATE, 0.1, 1.0, None, "bnhd"))


@pytest.mark.parametrize("layout", ("bhnd", "bnhd"))
@pytest.mark.parametrize("t", (1, 3))
@pytest.mark.parametrize("decay", ("tensor", "float"))
def test_compiled_step_equals_eager(layout, t, decay):
    # step's code object is shared by every case: without a reset, the cases' guards add up to
    # dynamo's recompile limit (8) when they run on their own, and fullgraph makes that an error
    torch._dynamo.reset()
    q, k, v, pool = _step_inputs(t=t, layout=layout, seed=t)
    gamma = torch.tensor([0.9, 0.99, 0.5]) if decay == "tensor" else 0.95
    idx = torch.tensor([3, -1], dtype=torch.int32)  # sequence 1 is padding: its row stays as it is

    def step(q, k, v, pool, idx):
        return rtkernels.decode(q, k, v, pool, gamma, scale=0.5, state_indices=idx, layout=layout)

    eager_pool = pool.clone()
    want = step(q, k, v, eager_pool, idx)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got_pool = pool.clone()
    got = compiled(q, k, v, got_pool, idx)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(got_pool, eager_pool, rtol=0, atol=0)
    # a second step continues from the updated pool in both
    want2 = step(k, q, v, eager_pool, idx)
    got2 = compiled(k, q, v, got_pool, idx)
    torch.testing.assert_close(got2[0], want2[0], rtol=0, atol=0)
    torch.testing.assert_close(got_pool, eager_pool, rtol=0, atol=0)


def test_compiled_steps_equal_one_prefill():
    """Steps of a compiled loop reproduce the whole sequence's call (the op's mutation is ordered)."""
    q, k, v, _ = _step_inputs(b=1, h=2, t=6, dk=4, dv=3)
    gamma = torch.tensor([0.8, 0.97])
    full, state = rtkernels.causal_linear_attention(q, k, v, gamma, return_state=True)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def run(q, k, v, pool):
        outs = [rtkernels.decode(q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], pool, gamma)
                for i in range(q.shape[2])]
        return torch.cat(outs, dim=2)

    pool = torch.zeros(1, 2, 4, 3)
    got = run(q, k, v, pool)
    torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pool, state, rtol=1e-5, atol=1e-6)


def test_layer_step_compiles_whole():
    from rtkernels.nn import DecayingLinearAttention

    torch.manual_seed(0)
    layer = DecayingLinearAttention(16, 2).eval()
    x = torch.randn(2, 1, 16)
    pool = layer.init_state(3)
    pool.normal_()
    idx = torch.tensor([2, 0], dtype=torch.int32)
    eager_pool = pool.clone()
    want = layer.step(x, eager_pool, idx)
    got = torch.compile(layer.step, fullgraph=True, backend="aot_eager")(x, pool, idx)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pool, eager_pool, rtol=1e-5, atol=1e-6)


def test_malformed_step_fails_while_tracing_with_the_eager_message():
    q, k, v, pool = _step_inputs()
    bad_pool = torch.zeros(4, 3, 7, 5)  # Dk 7 instead of 8
    with pytest.raises(Exception, match=r"state must be a pool of shape"):
        torch.compile(lambda q, k, v, s: rtkernels.decode(q, k, v, s, 0.9), fullgraph=True,
                      backend="aot_eager")(q, k, v, bad_pool)


def test_bad_decay_fails_while_tracing():
    q, k, v, pool = _step_inputs()
    with pytest.raises(Exception, match=r"decay"):
        torch.compile(lambda q, k, v, s: rtkernels.decode(q, k, v, s, 1.5), fullgraph=True,
                      backend="aot_eager")(q, k, v, pool)


def test_vmap_is_refused_with_a_clear_error():
    q, k, v, pool = _step_inputs()
    with pytest.raises(NotImplementedError, match="fold the extra dimension"):
        torch.func.vmap(lambda q: rtkernels.decode(q, k, v, pool, 0.9))(q.unsqueeze(0).expand(2, *q.shape))


def test_eager_step_never_takes_the_op(monkeypatch):
    q, k, v, pool = _step_inputs()

    def boom(*args, **kwargs):
        raise AssertionError("the eager step took the op")

    monkeypatch.setattr(rtkernels.decode_op, "decode_op", boom)
    rtkernels.decode(q, k, v, pool, 0.9)


def test_export_keeps_the_op_and_its_mutation():
    class Step(torch.nn.Module):
        def forward(self, q, k, v, pool):
            return rtkernels.decode(q, k, v, pool, 0.9, scale=0.5)

    q, k, v, pool = _step_inputs()
    ep = torch.export.export(Step(), (q, k, v, pool.clone()))
    assert "torch.ops.rtkernels.decode" in ep.graph_module.code
    got_pool, want_pool = pool.clone(), pool.clone()
    got = ep.module()(q, k, v, got_pool)
    want = Step()(q, k, v, want_pool)
    assert torch.equal(got, want) and torch.equal(got_pool, want_pool)
