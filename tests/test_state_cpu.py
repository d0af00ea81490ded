"""States on the CPU: ``initial_state`` / ``return_state``, sequences cut into pieces, empty sequences."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rtkernels
from inputs import (GAMMA_MIN, LAYOUTS, METHOD_NAMES, assert_unchanged, check_output_format,
                    check_state_format, compute_state_dtype, layout_shape, make_qkv, make_state, seq_dim,
                    seq_slice, state_tolerance_dtype)
from reference import reference
from tolerances import assert_close

attention = rtkernels.causal_linear_attention

ALL_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
B, H, N, DK, DV = 2, 3, 150, 24, 40
#: One head keeps everything, one forgets almost at once, one in between.
GAMMAS = torch.tensor([1.0, 0.9, GAMMA_MIN], dtype=torch.float64)
#: Split points: the first and last token, block boundaries of the torch paths (16, 32, 64) and
#: points inside blocks.
SPLITS = (1, 17, 32, 64, 70, 128, N - 1)


def run_pieces(q, k, v, cuts, methods, layout, initial_state=None, **kwargs):
    """Run the sequence cut at ``cuts``, piece i with ``methods[i % len(methods)]``, each piece
    continuing from the state of the previous one: (concatenated output, final state)."""
    bounds = [0, *cuts, q.shape[seq_dim(layout)]]
    outs, state = [], initial_state
    for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        o, state = attention(*(seq_slice(x, lo, hi, layout) for x in (q, k, v)), method=methods[i % len(methods)],
                             layout=layout, initial_state=state, return_state=True, **kwargs)
        check_output_format(o, seq_slice(q, lo, hi, layout), v, layout)
        check_state_format(state, q, v, layout)
        outs.append(o)
    return torch.cat(outs, dim=seq_dim(layout)), state


@pytest.mark.parametrize("dtype", (torch.float64, torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("method", METHOD_NAMES)
def test_two_pieces_equal_the_whole(method, layout, dtype):
    q, k, v = make_qkv(1, B, H, N, DK, DV, dtype, layout)
    whole, s_whole = attention(q, k, v, GAMMAS, method=method, layout=layout, return_state=True)
    check_output_format(whole, q, v, layout)
    check_state_format(s_whole, q, v, layout)
    ref, s_ref = reference(q, k, v, GAMMAS, layout=layout)
    sdt = state_tolerance_dtype(dtype)
    assert_close(whole, ref, dtype, "whole", n=N)
    assert_close(s_whole, s_ref, sdt, "final state of the whole", n=N)
    for cut in SPLITS:
        out, state = run_pieces(q, k, v, [cut], [method], layout, decay=GAMMAS)
        assert_close(out, ref, dtype, f"cut at {cut}", n=N)
        assert_close(out, whole.double(), dtype, f"cut at {cut} vs whole", n=N)
        assert_close(state, s_ref, sdt, f"final state, cut at {cut}", n=N)
        assert_close(state, s_whole.double(), sdt, f"final state, cut at {cut} vs whole", n=N)


@pytest.mark.parametrize("layout", LAYOUTS)
@settings(max_examples=15)
@given(n=st.integers(2, 300), data=st.data(), seed=st.integers(0, 2**31 - 1),
       dtype=st.sampled_from((torch.float64, torch.float32)), form=st.sampled_from(("decay", "decay_rate")))
def test_many_pieces_mixed_methods(layout, n, data, seed, dtype, form):
    """Cut anywhere, any number of times, each piece by a different method: states are the one
    interface between methods, so the pieces must still add up to the whole."""
    cuts = sorted(data.draw(st.sets(st.integers(1, n - 1), min_size=1, max_size=min(5, n - 1)), "cuts"))
    methods = data.draw(st.lists(st.sampled_from(METHOD_NAMES), min_size=len(cuts) + 1,
                                 max_size=len(cuts) + 1), "methods")
    q, k, v = make_qkv(seed, 1, 3, n, 7, 9, dtype, layout)
    s0 = make_state(seed + 1, 1, 3, 7, 9, compute_state_dtype(dtype))
    decay = {"decay": GAMMAS} if form == "decay" else {"decay_rate": -torch.log(GAMMAS)}
    out, state = run_pieces(q, k, v, cuts, methods, layout, initial_state=s0, **decay)
    ref, s_ref = reference(q, k, v, GAMMAS, layout=layout, initial_state=s0)
    assert_close(out, ref, dtype, f"cuts {cuts}, methods {methods}", n=n)
    assert_close(state, s_ref, state_tolerance_dtype(dtype), f"final state, cuts {cuts}, methods {methods}", n=n)


@pytest.mark.parametrize("state_dtype", (torch.float32, torch.float64), ids=str)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("method", METHOD_NAMES)
def test_initial_state_matches_reference(method, layout, dtype, state_dtype):
    n = 97
    q, k, v = make_qkv(3, B, H, n, DK, DV, dtype, layout)
    s0 = make_state(4, B, H, DK, DV, state_dtype)
    copies = [x.clone() for x in (q, k, v, s0)]
    out, state = attention(q, k, v, GAMMAS, method=method, layout=layout, initial_state=s0, return_state=True)
    assert_unchanged(copies, [q, k, v, s0])
    check_output_format(out, q, v, layout)
    check_state_format(state, q, v, layout)
    ref, s_ref = reference(q, k, v, GAMMAS, layout=layout, initial_state=s0)
    assert_close(out, ref, dtype, "output with initial_state", n=n)
    assert_close(state, s_ref, state_tolerance_dtype(dtype), "final state with initial_state", n=n)
    # the initial state matters: without it the output is different (so the check above can fail)
    plain = attention(q, k, v, GAMMAS, method=method, layout=layout)
    assert (plain.double() - ref).abs().max() > 0.1 * ref.abs().max()
    # without return_state the same call gives the output alone
    alone = attention(q, k, v, GAMMAS, method=method, layout=layout, initial_state=s0)
    assert isinstance(alone, torch.Tensor)
    assert_close(alone, out.double(), dtype, "return_state=False vs True", n=n)


@pytest.mark.parametrize("method", METHOD_NAMES)
def test_initial_state_of_one_token(method):
    """N = 1 with an initial state: o_0 = scale (gamma q_0 S_0 + (q_0 . k_0) v_0)."""
    q, k, v = make_qkv(5, 1, 3, 1, 4, 6, torch.float64)
    s0 = make_state(6, 1, 3, 4, 6, torch.float64)
    out, state = attention(q, k, v, GAMMAS, method=method, scale=0.5, initial_state=s0, return_state=True)
    g = GAMMAS.view(1, 3, 1, 1)
    expect = 0.5 * (g * (q @ s0) + (q * k).sum(-1, keepdim=True) * v)
    assert_close(out, expect, torch.float64, "one token")
    assert_close(state, g * s0 + k.transpose(-1, -2) @ v, torch.float64, "state after one token")


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("method", METHOD_NAMES)
def test_empty_sequence(method, layout, dtype):
    q, k, v = make_qkv(8, B, H, 0, DK, DV, dtype, layout)
    out = attention(q, k, v, GAMMAS, method=method, layout=layout)
    check_output_format(out, q, v, layout)
    assert out.shape == layout_shape(B, H, 0, DV, layout)

    out, state = attention(q, k, v, GAMMAS, method=method, layout=layout, return_state=True)
    check_output_format(out, q, v, layout)
    check_state_format(state, q, v, layout)
    assert torch.equal(state, torch.zeros_like(state)), "the state of an empty sequence is zero"

    s0 = make_state(9, B, H, DK, DV, compute_state_dtype(dtype))
    out, state = attention(q, k, v, GAMMAS, method=method, layout=layout, initial_state=s0, return_state=True)
    check_output_format(out, q, v, layout)
    check_state_format(state, q, v, layout)
    assert torch.equal(state, s0), "an empty sequence leaves the initial state as it is"
    assert state.data_ptr() != s0.data_ptr(), "the returned state must not alias initial_state"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("method", ["chunk", "auto"])
def test_empty_sequence_keeps_the_graph(method, layout):
    """N = 0 with inputs that require grad: the output and the state carry a grad_fn (nothing is
    detached silently); the gradients are zero for q, k, v, the decay, and the identity for the
    initial state (S_N = S_0)."""
    q, k, v = (x.requires_grad_(True) for x in make_qkv(8, B, H, 0, DK, DV, torch.float64, layout))
    gam = torch.as_tensor(GAMMAS, dtype=torch.float64).clone().requires_grad_(True)
    s0 = make_state(9, B, H, DK, DV, torch.float64).requires_grad_(True)
    out, state = attention(q, k, v, gam, method=method, layout=layout, initial_state=s0, return_state=True)
    assert out.grad_fn is not None and state.grad_fn is not None
    g_state = torch.randn_like(state)
    (out.sum() + (state * g_state).sum()).backward()
    assert torch.equal(s0.grad, g_state)
    for x in (q, k, v, gam):
        assert x.grad is not None and torch.equal(x.grad, torch.zeros_like(x))
    out = attention(q.detach(), k.detach(), v.detach(), GAMMAS, method=method, layout=layout)
    assert out.grad_fn is None and not out.requires_grad  # nothing requires grad: no graph


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_empty_sequence_state_dtype(dtype):
    """The returned state is float64 for float64 inputs and float32 otherwise, whatever the dtype of
    initial_state (float32 and float64 are both accepted): so it is for a non-empty sequence, and
    so it must be for an empty one."""
    other = torch.float32 if dtype == torch.float64 else torch.float64
    s0 = make_state(9, B, H, DK, DV, other)
    for n in (1, 0):
        q, k, v = make_qkv(8, B, H, n, DK, DV, dtype)
        _, state = attention(q, k, v, GAMMAS, initial_state=s0, return_state=True)
        assert state.dtype == compute_state_dtype(dtype), \
            f"N={n}: {other} initial_state with {dtype} inputs gave a {state.dtype} state"
        if n == 0:
            assert torch.equal(state, s0.to(state.dtype)), "an empty sequence leaves the initial state as it is"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("method", METHOD_NAMES)
def test_empty_piece_in_a_sequence(method, layout):
    """An empty piece between two others changes nothing."""
    q, k, v = make_qkv(10, B, H, 80, DK, DV, torch.float64, layout)
    out, state = run_pieces(q, k, v, [40, 40], [method], layout, decay=GAMMAS)
    ref, s_ref = reference(q, k, v, GAMMAS, layout=layout)
    assert_close(out, ref, torch.float64, "with an empty piece")
    assert_close(state, s_ref, torch.float64, "final state with an empty piece")
