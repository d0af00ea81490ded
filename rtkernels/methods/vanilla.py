"""``vanilla``: the quadratic form, the reference every other method is checked against.

    O = scale * ((Q K^T) ⊙ M) V,   M[i, j] = gamma^(i-j) for i >= j, 0 otherwise

Work O(N^2 (Dk + Dv)), memory O(N^2) per (batch, head). Runs through torch operations on any
device (on a GPU too: it is a reference, not a kernel).
"""

from __future__ import annotations

from typing import Optional

import torch

from ._torch_common import carry_state, intra_chunk


def torch_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor,
                  initial_state: Optional[torch.Tensor], need_state: bool):
    """The whole sequence as one masked block (see :func:`intra_chunk`)."""
    o = intra_chunk(q, k, v, log_decay)
    return carry_state(o, q, k, v, log_decay, initial_state, need_state)
