"""``chunk``: the chunked form, every chunk at once (the flagship's algorithm).

With chunks of C tokens and S_c the state entering chunk c:

    O_c[t]  = gamma^(t+1) q_t S_c + sum_{s <= t} gamma^(t-s) (q_t . k_s) v_s
    S_{c+1} = gamma^C S_c + sum_s gamma^(C-1-s) k_s^T v_s

Only non-negative powers of gamma appear, so it is safe for every gamma in (0, 1] and any N.
The torch path computes every chunk's masked product and own state in batched products, then
scans the chunk states. Work O(N C (Dk + Dv) + N Dk Dv), memory O(N (Dk + Dv) + N Dk Dv / C).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ._torch_common import block_state, inter_chunk, intra_chunk, state_update, zero_state

#: Tokens per chunk of the torch path.
CHUNK = 64


def torch_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor,
                  initial_state: Optional[torch.Tensor], need_state: bool):
    b, h, n, dk = q.shape
    dv = v.shape[-1]
    nc = -(-n // CHUNK)
    # Zero rows appended at the end change no real output; the final state is taken before them.
    qc, kc, vc = (F.pad(x, (0, 0, 0, nc * CHUNK - n)).view(b, h, nc, CHUNK, x.shape[-1])
                  for x in (q, k, v))
    own = block_state(kc, vc, log_decay)                        # [B, H, nc, Dk, Dv]
    carry = torch.exp(log_decay * CHUNK).view(-1, 1, 1)
    state = zero_state(q, v, initial_state)
    entering = []
    for c in range(nc):
        entering.append(state)
        if c + 1 < nc:
            state = carry * state + own[:, :, c]
    states = torch.stack(entering, dim=2)                       # S_c for every chunk
    o = intra_chunk(qc, kc, vc, log_decay) + inter_chunk(qc, states, log_decay)
    o = o.reshape(b, h, nc * CHUNK, dv)[:, :, :n]
    final = None
    if need_state:
        last = (nc - 1) * CHUNK
        final = state_update(state, k[:, :, last:], v[:, :, last:], log_decay)
    return o, final
