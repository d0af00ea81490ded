"""``fleet``: FleetAttention, rank by rank (LeetDecoding's FleetAttention method).

(Q K^T) ⊙ M = sum_r diag(q_{:,r}) L_gamma diag(k_{:,r}), so for each rank r = 0 .. Dk-1 a
discounted prefix sum of the value rows

    y_{i,r} = gamma y_{i-1,r} + k_{i,r} v_i           (a Dv-vector per rank)
    o_i     = scale * sum_r q_{i,r} y_{i,r}

The ranks and value columns are independent; the sum over r is a fixed-order reduction.
Work O(N Dk Dv), memory O(N (Dk + Dv) + C Dk Dv) per (batch, head). The torch path runs the
prefix sums C tokens at a time as a product with the C x C decay matrix L_gamma.
"""

from __future__ import annotations

from typing import Optional

import torch

from ._torch_common import causal_apply, causal_decay_matrix, decay_powers, zero_state

#: Tokens per step of the torch path (its memory is C * Dk * Dv per (batch, head)).
BLOCK = 16


def torch_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor,
                  initial_state: Optional[torch.Tensor], need_state: bool):
    b, h, n, dk = q.shape
    dv = v.shape[-1]
    y = zero_state(q, v, initial_state).reshape(b, h, 1, dk * dv)  # row r of the state is y_r
    outs = []
    for c0 in range(0, n, BLOCK):
        qc, kc, vc = (x[:, :, c0:c0 + BLOCK] for x in (q, k, v))
        c = qc.shape[-2]
        x = (kc[..., :, None] * vc[..., None, :]).reshape(b, h, c, dk * dv)  # k_{s,r} v_s
        y_all = causal_apply(causal_decay_matrix(log_decay, c), x) + decay_powers(log_decay, c, start=1) * y
        outs.append(torch.einsum("bhtr,bhtrd->bhtd", qc, y_all.view(b, h, c, dk, dv)))
        y = y_all[:, :, -1:]
    state = y.reshape(b, h, dk, dv) if need_state else None
    return torch.cat(outs, dim=-2), state
