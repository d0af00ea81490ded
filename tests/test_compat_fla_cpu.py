"""rtkernels.compat.fla on the CPU: chunk_simple_gla and fused_recurrent_simple_gla against a plain fp64
loop over tokens (outputs, final states and every gradient), fla's defaults, and the errors for what is
not supported."""

from __future__ import annotations

import math

import pytest
import torch

from rtkernels.compat.fla import chunk_simple_gla, fused_recurrent_simple_gla

CALLS = [chunk_simple_gla, fused_recurrent_simple_gla]
B, T, H, K, V = 2, 19, 3, 5, 4


def loop(q, k, v, g_gamma, scale, initial_state):
    """fla's recurrence token by token in float64: S_t = exp(g_gamma) S_{t-1} + k_t^T v_t,
    o_t = scale q_t S_t; ``[B, T, H, D]`` in, (o ``[B, T, H, V]``, S ``[B, H, K, V]``) out."""
    q, k, v = (x.double() for x in (q, k, v))
    b, t, h, dk = q.shape
    state = torch.zeros(b, h, dk, v.shape[-1], dtype=torch.float64) if initial_state is None \
        else initial_state.double()
    gamma = torch.ones(h, dtype=torch.float64) if g_gamma is None else torch.exp(torch.as_tensor(g_gamma).double())
    gamma = gamma.expand(h).view(1, h, 1, 1)
    outs = []
    for i in range(t):
        state = gamma * state + k[:, i, :, :, None] * v[:, i, :, None, :]
        outs.append(scale * (q[:, i, :, :, None] * state).sum(-2))
    return torch.stack(outs, 1), state


def _inputs(dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, K, generator=g, dtype=dtype) / 2 for _ in range(2))
    v = torch.randn(B, T, H, V, generator=g, dtype=dtype)
    s0 = torch.randn(B, H, K, V, generator=g, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    return q, k, v, s0


@pytest.mark.parametrize("call", CALLS, ids=lambda c: c.__name__)
def test_outputs_states_and_gradients_equal_the_fp64_loop(call):
    q, k, v, s0 = (x.requires_grad_() for x in _inputs())
    g_gamma = torch.log(torch.tensor([0.5, 0.9, 1.0], dtype=torch.float64)).requires_grad_()
    inputs = (q, k, v, s0, g_gamma)
    o, state = call(q, k, v, g_gamma=g_gamma, scale=0.7, initial_state=s0, output_final_state=True)
    ro, rs = loop(q, k, v, g_gamma, 0.7, s0)
    assert o.shape == (B, T, H, V) and state.shape == (B, H, K, V)
    torch.testing.assert_close(o, ro, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(state, rs, rtol=1e-10, atol=1e-12)
    g = torch.Generator().manual_seed(1)
    wo, ws = torch.randn(o.shape, generator=g, dtype=torch.float64), torch.randn(state.shape, generator=g,
                                                                                 dtype=torch.float64)
    got = torch.autograd.grad((o * wo).sum() + (state * ws).sum(), inputs)
    want = torch.autograd.grad((ro * wo).sum() + (rs * ws).sum(), inputs)
    for name, a, b in zip(("dq", "dk", "dv", "dinitial_state", "dg_gamma"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=name)


@pytest.mark.parametrize("call", CALLS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fla_defaults(call, dtype):
    """scale defaults to K ** -0.5, no g_gamma means no decay, no final state unless asked; the
    output keeps the input dtype, the state is float32 (a 16-bit initial state is taken too)."""
    q, k, v, s0 = _inputs(dtype)
    o, state = call(q, k, v)
    assert state is None and o.dtype == dtype
    ro, _ = loop(q, k, v, None, K ** -0.5, None)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(o.double(), ro, rtol=tol, atol=tol)
    o, state = call(q, k, v, None, -0.1, None, s0.to(dtype), True)  # fla's positional order, a float g_gamma
    ro, rs = loop(q, k, v, -0.1, K ** -0.5, s0.to(dtype))
    assert state.dtype == torch.float32
    torch.testing.assert_close(o.double(), ro, rtol=tol, atol=tol)
    torch.testing.assert_close(state.double(), rs, rtol=tol, atol=tol)


@pytest.mark.parametrize("call", CALLS, ids=lambda c: c.__name__)
def test_a_long_sequence_in_pieces_equals_one_call(call):
    """What fla users do without cu_seqlens: the final state of one piece is the next one's start."""
    q, k, v, _ = _inputs()
    g_gamma = torch.tensor([-0.3, -0.01, 0.0], dtype=torch.float64)
    whole, end = call(q, k, v, g_gamma=g_gamma, output_final_state=True)
    first, mid = call(q[:, :7], k[:, :7], v[:, :7], g_gamma=g_gamma, output_final_state=True)
    second, end2 = call(q[:, 7:], k[:, 7:], v[:, 7:], g_gamma=g_gamma, initial_state=mid, output_final_state=True)
    torch.testing.assert_close(torch.cat([first, second], 1), whole, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(end2, end, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("call", CALLS, ids=lambda c: c.__name__)
def test_what_is_not_supported_says_so(call):
    q, k, v, _ = _inputs(torch.float32)
    name = call.__name__
    with pytest.raises(NotImplementedError, match=rf"{name}: per-token gates g"):
        call(q, k, v, g=torch.zeros(B, T, H))
    with pytest.raises(NotImplementedError, match="head_first=True"):
        call(q, k, v, head_first=True)
    with pytest.raises(TypeError, match="unexpected keyword argument 'chunk_sizes'"):
        call(q, k, v, chunk_sizes=64)
    call(q, k, v, head_first=False)  # fla's default is accepted
    with pytest.raises(ValueError, match=r"g_gamma must be the per-head log decay, shape \[H\] = \[3\]"):
        call(q, k, v, g_gamma=torch.zeros(B, T, H))
    with pytest.raises(ValueError, match="g_gamma must be a log decay <= 0"):
        call(q, k, v, g_gamma=torch.tensor([-0.1, 0.2, 0.0]))
    with pytest.raises(ValueError, match="g_gamma must be a log decay <= 0"):
        call(q, k, v, g_gamma=math.nan)
    with pytest.raises(TypeError, match="output_final_state must be a bool"):
        call(q, k, v, output_final_state=1)


def test_fused_recurrent_options_not_supported():
    q, k, v, _ = _inputs(torch.float32)
    with pytest.raises(NotImplementedError, match="reverse=True"):
        fused_recurrent_simple_gla(q, k, v, reverse=True)
    with pytest.raises(NotImplementedError, match="state_v_first=True"):
        fused_recurrent_simple_gla(q, k, v, state_v_first=True)


# ----------------------------------------------------------------------------- packed sequences

LENS = (4, 0, 70, 1)


def _packed(seed=0):
    """fla's packed form: [1, T, H, D] inputs, [S, H, K, V] initial states, cu_seqlens (int64)."""
    g = torch.Generator().manual_seed(seed)
    t = sum(LENS)
    q, k = (torch.randn(1, t, H, K, generator=g, dtype=torch.float64) / 2 for _ in range(2))
    v = torch.randn(1, t, H, V, generator=g, dtype=torch.float64)
    s0 = torch.randn(len(LENS), H, K, V, generator=g, dtype=torch.float64)
    cu = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()])
    return q, k, v, s0, cu


def _loop_per_sequence(q, k, v, g_gamma, scale, s0, cu):
    outs, states = [], []
    for s in range(len(cu) - 1):
        lo, hi = int(cu[s]), int(cu[s + 1])
        if hi == lo:  # an empty sequence: no output, its initial state
            states.append(s0[s])
            continue
        o, st = loop(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], g_gamma, scale, s0[s:s + 1])
        outs.append(o)
        states.append(st[0])
    return torch.cat(outs, 1), torch.stack(states)


@pytest.mark.parametrize("call", CALLS, ids=lambda c: c.__name__)
def test_cu_seqlens_equals_the_loop_per_sequence(call):
    """Outputs, final states [S, H, K, V] and every gradient; an empty sequence keeps its state."""
    q, k, v, s0, cu = (x.requires_grad_() if x.is_floating_point() else x for x in _packed())
    g_gamma = torch.log(torch.tensor([0.5, 0.9, 1.0], dtype=torch.float64)).requires_grad_()
    o, state = call(q, k, v, g_gamma=g_gamma, scale=0.7, initial_state=s0, output_final_state=True, cu_seqlens=cu)
    ro, rs = _loop_per_sequence(q, k, v, g_gamma, 0.7, s0, cu)
    assert o.shape == q.shape[:3] + (V,) and state.shape == (len(LENS), H, K, V)
    torch.testing.assert_close(o, ro, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(state, rs, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(state[1], s0[1], rtol=0, atol=0)
    inputs = (q, k, v, s0, g_gamma)
    got = torch.autograd.grad(o.sum() + (state * 2).sum(), inputs)
    want = torch.autograd.grad(ro.sum() + (rs * 2).sum(), inputs)
    for name, a, b in zip(("dq", "dk", "dv", "dinitial_state", "dg_gamma"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=name)


def test_cu_seqlens_cpu_is_fla_host_copy():
    """Alone it is used (on q's device); next to cu_seqlens its values are checked on the host."""
    q, k, v, s0, cu = _packed()
    want, _ = chunk_simple_gla(q, k, v, g_gamma=-0.2, cu_seqlens=cu)
    alone, _ = chunk_simple_gla(q, k, v, g_gamma=-0.2, cu_seqlens_cpu=cu.to(torch.int32))
    both, _ = chunk_simple_gla(q, k, v, g_gamma=-0.2, cu_seqlens=cu, cu_seqlens_cpu=cu)
    torch.testing.assert_close(alone, want, rtol=0, atol=0)
    torch.testing.assert_close(both, want, rtol=0, atol=0)
    bad = cu.clone()
    bad[1] = 80
    with pytest.raises(ValueError, match="cu_seqlens must be non-decreasing"):
        chunk_simple_gla(q, k, v, cu_seqlens=cu, cu_seqlens_cpu=bad)
    with pytest.raises(ValueError, match="batch size 1"):
        chunk_simple_gla(*(torch.cat([x, x]) for x in (q, k, v)), cu_seqlens=cu)
    with pytest.raises(ValueError, match=r"initial_state must have shape \[S, H, Dk, Dv\]"):
        chunk_simple_gla(q, k, v, initial_state=s0[:2], cu_seqlens=cu)
