"""Property tests on the CPU: every method, every decay form and layout, against the fp64 reference.

The inputs are rounded to the test dtype before the reference sees them, so the tolerances of
tests/tolerances.py only have to cover the accumulation and the rounding of the output.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import rtkernels
from inputs import (GAMMA_MIN, LAYOUTS, METHOD_NAMES, SPECIAL_N, Problem, assert_unchanged, check_output_format,
                    make_qkv, problems)
from reference import reference
from tolerances import assert_close

attention = rtkernels.causal_linear_attention

FULL_DTYPES = (torch.float64, torch.float32)
HALF_DTYPES = (torch.float16, torch.bfloat16)


def check_against_reference(method: str, p: Problem, dtype: torch.dtype) -> None:
    c = p.build(dtype)
    inputs = [c.q, c.k, c.v, *(x for x in c.kwargs.values() if isinstance(x, torch.Tensor))]
    copies = [x.clone() for x in inputs]
    out = attention(c.q, c.k, c.v, method=method, **c.kwargs)
    assert_unchanged(copies, inputs)
    check_output_format(out, c.q, c.v, c.layout)
    ref, _ = reference(c.q, c.k, c.v, c.gamma, c.scale, c.layout)
    assert_close(out, ref, dtype, what=f"method={method} {dtype} {p}", n=p.n)


def test_every_method_is_tested():
    assert set(METHOD_NAMES) == set(rtkernels.METHODS) | {"auto"}


@pytest.mark.parametrize("dtype", FULL_DTYPES, ids=str)
@pytest.mark.parametrize("method", METHOD_NAMES)
@given(p=problems(max_n=300))
# The extremes, always run: one token; the longest sequence with no decay next to gamma = 1e-6;
# fp32 per-head rates with strided inputs; shared float factor and rate; a block size exactly.
@example(p=Problem(b=1, h=1, n=1, dk=1, dv=1, gammas=(GAMMA_MIN,)))
@example(p=Problem(b=2, h=3, n=300, dk=80, dv=80, layout="bnhd", gammas=(1.0, GAMMA_MIN, 1 - 1e-6)))
@example(p=Problem(b=3, h=2, n=257, dk=63, dv=65, form="rate_tensor", gammas=(GAMMA_MIN, 1.0),
                   decay_dtype=torch.float32, scale=2.5, memory="strided"))
@example(p=Problem(b=1, h=3, n=127, dk=1, dv=80, form="decay_float", gammas=(0.5,) * 3, memory="transposed"))
@example(p=Problem(b=2, h=2, n=129, dk=80, dv=1, layout="bnhd", form="rate_float", gammas=(GAMMA_MIN,) * 2))
@example(p=Problem(b=1, h=1, n=64, dk=16, dv=16, form="none", gammas=(1.0,), scale=0.1))
def test_matches_reference(method, dtype, p):
    check_against_reference(method, p, dtype)


@pytest.mark.parametrize("method", METHOD_NAMES)
@given(p=problems(max_n=130), dtype=st.sampled_from(HALF_DTYPES))
@example(p=Problem(b=2, h=2, n=130, dk=80, dv=80, layout="bnhd", gammas=(1.0, GAMMA_MIN)), dtype=torch.float16)
@example(p=Problem(b=2, h=2, n=130, dk=80, dv=80, layout="bnhd", gammas=(1.0, GAMMA_MIN)), dtype=torch.bfloat16)
def test_half_precision_matches_reference(method, p, dtype):
    """float16 and bfloat16 inputs are computed in float32 and rounded once, to the input dtype."""
    check_against_reference(method, p, dtype)


@pytest.mark.parametrize("method", METHOD_NAMES)
@settings(max_examples=10)
@given(scale=st.floats(0.1, 3.0), seed=st.integers(0, 2**31 - 1), layout=st.sampled_from(LAYOUTS),
       dtype=st.sampled_from(FULL_DTYPES + HALF_DTYPES))
def test_scale_multiplies_the_output(method, scale, seed, layout, dtype):
    q, k, v = make_qkv(seed, 2, 2, 77, 12, 20, dtype, layout)
    decay = torch.tensor([0.95, 0.3], dtype=torch.float64)
    plain = attention(q, k, v, decay, method=method, layout=layout)
    scaled = attention(q, k, v, decay, method=method, layout=layout, scale=scale)
    check_output_format(scaled, q, v, layout)
    ref, _ = reference(q, k, v, decay, scale, layout)
    assert_close(scaled, ref, dtype, what=f"scale={scale}")
    assert_close(scaled, plain.double() * scale, dtype, what=f"scale={scale} vs scale=1 times {scale}")


@pytest.mark.parametrize("dtype", FULL_DTYPES + HALF_DTYPES, ids=str)
@pytest.mark.parametrize("method", METHOD_NAMES)
def test_layouts_are_transposes(method, dtype):
    """layout="bnhd" on x gives the transpose of layout="bhnd" on x.transpose(1, 2), and each output
    is contiguous in its own layout."""
    q, k, v = make_qkv(7, 2, 3, 70, 9, 11, dtype, "bnhd")
    decay = torch.tensor([1.0, 0.9, GAMMA_MIN], dtype=torch.float64)
    out_bnhd = attention(q, k, v, decay, method=method, layout="bnhd")
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    out_bhnd = attention(qt, kt, vt, decay, method=method, layout="bhnd")
    check_output_format(out_bnhd, q, v, "bnhd")
    check_output_format(out_bhnd, qt, vt, "bhnd")
    assert_close(out_bnhd.transpose(1, 2), out_bhnd.double(), dtype, what="bnhd vs transposed bhnd")
    # the heads really are axis 2 in bnhd: head 2 (gamma = 1e-6) is nearly diagonal, head 0 is not
    ref, _ = reference(q, k, v, decay, layout="bnhd")
    assert_close(out_bnhd, ref, dtype, what="bnhd vs reference")


@pytest.mark.parametrize("method", METHOD_NAMES)
def test_decay_forms_agree(method):
    """decay=gamma, decay=[gamma]*H, decay_rate=-log(gamma) and decay_rate=[-log(gamma)]*H are the
    same operator (and decay=None is gamma = 1)."""
    q, k, v = make_qkv(11, 1, 2, 90, 8, 8, torch.float64)
    g = 0.8
    f64 = dict(dtype=torch.float64)
    forms = [dict(decay=g), dict(decay=torch.tensor([g, g], **f64)), dict(decay_rate=-math.log(g)),
             dict(decay_rate=torch.tensor([-math.log(g)] * 2, **f64))]
    outs = [attention(q, k, v, method=method, **kw) for kw in forms]
    for kw, out in zip(forms, outs):
        assert_close(out, outs[0], torch.float64, what=str(kw))
    assert_close(attention(q, k, v, method=method), attention(q, k, v, 1.0, method=method), torch.float64,
                 what="decay=None vs decay=1.0")
    # and a different gamma gives a different answer, so the comparisons above can fail
    assert not torch.allclose(outs[0], attention(q, k, v, 0.81, method=method))


@pytest.mark.parametrize("dtype", FULL_DTYPES, ids=str)
@pytest.mark.parametrize("n", SPECIAL_N)
@pytest.mark.parametrize("method", METHOD_NAMES)
def test_sequence_length_sweep(method, n, dtype):
    """Every block-size neighbour and the primes, whatever hypothesis happens to draw: per-head
    decay spanning the range, odd head sizes, both layouts (by the parity of n)."""
    layout = LAYOUTS[n % 2]
    p = Problem(b=2, h=3, n=n, dk=33, dv=17, layout=layout, gammas=(1.0, 0.97, GAMMA_MIN), seed=n)
    check_against_reference(method, p, dtype)


#: Decays at and beyond the end of the drawn range: gamma underflowing to 0 (and below the smallest
#: float32), finite rates beyond the float32 range, the largest float. All are valid arguments.
EXTREME_DECAYS = [dict(decay=1e-30), dict(decay=5e-324), dict(decay_rate=50.0), dict(decay_rate=1e3),
                  dict(decay_rate=1e39), dict(decay_rate=1e300), dict(decay_rate=sys.float_info.max),
                  dict(decay_rate=torch.tensor([1e39, 0.0, 1e300], dtype=torch.float64))]


@pytest.mark.parametrize("dtype", FULL_DTYPES, ids=str)
@pytest.mark.parametrize("method", METHOD_NAMES)
def test_extreme_decay(method, dtype):
    """gamma -> 0 leaves only the diagonal: o_i = scale (q_i . k_i) v_i and S_N = k_{N-1}^T v_{N-1}."""
    q, k, v = make_qkv(13, 2, 3, 70, 10, 12, dtype)
    for kwargs in EXTREME_DECAYS:
        value = torch.as_tensor(next(iter(kwargs.values())), dtype=torch.float64).expand(3)
        gamma = torch.exp(-value) if "decay_rate" in kwargs else value
        ref, ref_state = reference(q, k, v, gamma.clamp(min=1e-300), 1.5)  # gamma^1 is 0 either way
        out, state = attention(q, k, v, method=method, scale=1.5, return_state=True, **kwargs)
        assert_close(out, ref, dtype, f"{kwargs}", n=70)
        assert_close(state, ref_state, dtype, f"final state, {kwargs}", n=70)


@pytest.mark.parametrize("method", METHOD_NAMES)
def test_decay_follows_its_current_values(method):
    """Decays may be normalised and cached between calls: a decay tensor changed in place, and
    calls alternating between decays, still get the decay they pass, bit for bit every time."""
    q, k, v = make_qkv(17, 1, 2, 40, 5, 6, torch.float64)
    decay = torch.tensor([0.9, 0.5], dtype=torch.float64)
    first = attention(q, k, v, decay, method=method)
    decay[0] = 0.2  # in place
    second = attention(q, k, v, decay, method=method)
    assert_close(second, reference(q, k, v, decay)[0], torch.float64, "after an in-place change of decay")
    assert not torch.allclose(first, second)
    for kwargs, expect in ((dict(decay=torch.tensor([0.9, 0.5], dtype=torch.float64)), first),
                           (dict(decay_rate=-torch.log(decay)), second), (dict(decay=0.9), None)):
        again = attention(q, k, v, method=method, **kwargs)
        if expect is not None:
            assert_close(again, expect.double(), torch.float64, f"repeated call with {kwargs}")
        assert torch.equal(attention(q, k, v, method=method, **kwargs), again), "a repeated call differs"
