"""``recursion``: divide and conquer on the sequence (LeetDecoding's recursion method).

Split the sequence at ``mid``. The two diagonal halves are the same problem again; the lower-left
block has rank at most Dk because for i >= mid > j, gamma^(i-j) = gamma^(i-mid) * gamma^(mid-j)
(both exponents non-negative), so it is

    (Q_hi ⊙ gamma^(i-mid)) · ((K_lo ⊙ gamma^(mid-j))^T V_lo).

Here the recursion runs bottom-up and level by level: blocks of ``BASE`` tokens are done densely,
then at each level every (lo, hi) pair of the level is combined in one batched product.
Work O(N log N · Dk · Dv) (LeetDecoding's Lemma 3.1: asymptotically worse than the O(N) methods),
memory O(N (Dk + Dv) + N Dk Dv / BASE). Torch operations on any device (a reference).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ._torch_common import carry_state, decay_powers, intra_chunk

#: Block size of the dense base case.
BASE = 32


def torch_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor,
                  initial_state: Optional[torch.Tensor], need_state: bool):
    b, h, n, dk = q.shape
    dv = v.shape[-1]
    padded = BASE
    while padded < n:
        padded *= 2
    # Zero rows appended at the end reach no real row (causality), so they change nothing.
    qp, kp, vp = (F.pad(x, (0, 0, 0, padded - n)) for x in (q, k, v))
    nb = padded // BASE
    o = intra_chunk(qp.view(b, h, nb, BASE, dk), kp.view(b, h, nb, BASE, dk),
                    vp.view(b, h, nb, BASE, dv), log_decay).reshape(b, h, padded, dv)
    size = BASE
    while size < padded:
        pairs = padded // (2 * size)
        q6, k6, v6 = (x.view(b, h, pairs, 2, size, x.shape[-1]) for x in (qp, kp, vp))
        k_lo = k6[:, :, :, 0] * decay_powers(log_decay, size, start=1, ndim=5).flip(-2)  # gamma^(mid-j)
        q_hi = q6[:, :, :, 1] * decay_powers(log_decay, size, start=0, ndim=5)          # gamma^(i-mid)
        low_rank = q_hi @ (k_lo.transpose(-1, -2) @ v6[:, :, :, 0])
        o.view(b, h, pairs, 2, size, dv)[:, :, :, 1] += low_rank
        size *= 2
    return carry_state(o[:, :, :n], q, k, v, log_decay, initial_state, need_state)
