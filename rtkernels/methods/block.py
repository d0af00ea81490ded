"""``block``: block-by-block with a carried state (Lightning Attention 2's block form).

For blocks of C tokens, in order, with S the Dk x Dv state after the previous blocks:

    O_c[t] = gamma^(t+1) q_t S + sum_{s <= t} gamma^(t-s) (q_t . k_s) v_s
    S     <- gamma^C S + sum_s gamma^(C-1-s) k_s^T v_s

Work O(N C (Dk + Dv) + N Dk Dv), memory O(N (Dk + Dv) + C^2 + Dk Dv) per (batch, head).
"""

from __future__ import annotations

from typing import Optional

import torch

from ._torch_common import inter_chunk, intra_chunk, state_update, zero_state

#: Tokens per block of the torch path.
BLOCK = 64


def torch_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor,
                  initial_state: Optional[torch.Tensor], need_state: bool):
    state = zero_state(q, v, initial_state)
    outs = []
    for c0 in range(0, q.shape[-2], BLOCK):
        qc, kc, vc = (x[:, :, c0:c0 + BLOCK] for x in (q, k, v))
        outs.append(intra_chunk(qc, kc, vc, log_decay) + inter_chunk(qc, state, log_decay))
        state = state_update(state, kc, vc, log_decay)
    return torch.cat(outs, dim=-2), (state if need_state else None)
