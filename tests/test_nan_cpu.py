"""NaN inside q, k or v is data: it comes out as NaN in exactly the entries the causal sum reaches.

    NaN at q[b, h, i, c]  ->  output[b, h, i, :]
    NaN at k[b, h, j, c]  ->  output[b, h, i >= j, :]      (and row c of the final state)
    NaN at v[b, h, j, c]  ->  output[b, h, i >= j, c]      (and column c of the final state)

and everything else is finite and equal to the reference computed with that entry set to zero
(no entry outside those depends on it).
"""

from __future__ import annotations

import pytest
import torch

import rtkernels
from inputs import GAMMA_MIN, LAYOUTS, METHOD_NAMES, make_qkv, state_tolerance_dtype, to_bhnd
from reference import reference
from tolerances import assert_close

attention = rtkernels.causal_linear_attention

B, H, N, DK, DV = 2, 2, 150, 8, 6
AT_B, AT_H, AT_C = 1, 0, 3  # the (batch, head, column) of the NaN
#: The first token, a chunk boundary (64), the middle of a chunk (70), the last token.
POSITIONS = (0, 64, 70, N - 1)


def describe(mask: torch.Tensor) -> str:
    """Where a [B, H, N, D] mask is set, as '(b, h): rows r0..r1 (cols ...)' per (b, h)."""
    parts = []
    for b, h in sorted({(int(b), int(h)) for b, h, _, _ in mask.nonzero().tolist()}):
        rows = mask[b, h].any(-1).nonzero().flatten()
        cols = mask[b, h].any(-2).nonzero().flatten()
        parts.append(f"({b}, {h}): {len(rows)} rows {rows.min().item()}..{rows.max().item()}, "
                     f"columns {cols.tolist()}")
    return "; ".join(parts) or "nowhere"


def expected_nan(which: str, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(output mask [B, H, N, Dv], final-state mask [B, H, Dk, Dv]) of the entries a NaN reaches."""
    out = torch.zeros(B, H, N, DV, dtype=torch.bool)
    state = torch.zeros(B, H, DK, DV, dtype=torch.bool)
    if which == "q":
        out[AT_B, AT_H, pos, :] = True
    elif which == "k":
        out[AT_B, AT_H, pos:, :] = True
        state[AT_B, AT_H, AT_C, :] = True
    else:
        out[AT_B, AT_H, pos:, AT_C] = True
        state[AT_B, AT_H, :, AT_C] = True
    return out, state


@pytest.mark.parametrize("dtype", (torch.float64, torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("gamma", (GAMMA_MIN, 0.9))
@pytest.mark.parametrize("pos", POSITIONS)
@pytest.mark.parametrize("which", ("q", "k", "v"))
@pytest.mark.parametrize("method", METHOD_NAMES)
def test_nan_reaches_exactly_its_rows(method, which, pos, gamma, layout, dtype):
    qkv = dict(zip("qkv", make_qkv(pos, B, H, N, DK, DV, dtype, layout)))
    clean = {name: x.clone() for name, x in qkv.items()}
    to_bhnd(qkv[which], layout)[AT_B, AT_H, pos, AT_C] = float("nan")
    to_bhnd(clean[which], layout)[AT_B, AT_H, pos, AT_C] = 0.0
    decay = torch.tensor([gamma, 0.5], dtype=torch.float64)  # the NaN sits in head 0

    out, state = attention(qkv["q"], qkv["k"], qkv["v"], decay, method=method, layout=layout, return_state=True)
    o = to_bhnd(out, layout)
    want, want_state = expected_nan(which, pos)
    got = o.isnan()
    assert torch.equal(got, want), (f"NaN at {which}[{AT_B}, {AT_H}, {pos}, {AT_C}]: missing NaN at "
                                    f"{describe(want & ~got)}; unexpected NaN at {describe(got & ~want)}")
    assert torch.isfinite(o[~want]).all(), "non-finite values outside the entries the NaN reaches"
    got_state = state.isnan()
    assert torch.equal(got_state, want_state), (
        f"final state: NaN at {got_state.nonzero().tolist()[:8]}..., expected rows/columns "
        f"{want_state.nonzero().tolist()[:8]}...")

    ref, ref_state = reference(clean["q"], clean["k"], clean["v"], decay, layout=layout)
    assert_close(o[~want], to_bhnd(ref, layout)[~want], dtype, "the entries the NaN does not reach", n=N)
    assert_close(state[~want_state], ref_state[~want_state], state_tolerance_dtype(dtype),
                 "the state entries the NaN does not reach", n=N)
