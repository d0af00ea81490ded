"""The chunk method's torch path: every chunk's masked product and own state in batched
products, then a scan over the chunk states (any device, any dtype; fp32 accumulation for
16-bit inputs)."""

from __future__ import annotations

from typing import Optional

import torch

from .._torch_common import chunk_end_decays, inter_chunk, intra_chunk, scan_chunks, to_chunks, zero_state

__all__ = ["CHUNK", "torch_forward"]

#: Tokens per chunk of the torch path.
CHUNK = 64


def torch_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor,
                  initial_state: Optional[torch.Tensor], need_state: bool):
    b, h, n, _ = q.shape
    qc, kc, vc = (to_chunks(x, CHUNK) for x in (q, k, v))      # [B, H, nc, C, D], zero-padded
    to_end, carry, _ = chunk_end_decays(log_decay, n, CHUNK)
    own = (kc * to_end).transpose(-1, -2) @ vc                  # sum_s gamma^(L-1-s) k_s^T v_s
    states, final = scan_chunks(zero_state(q, v, initial_state), own, carry)  # S_c for every chunk
    o = intra_chunk(qc, kc, vc, log_decay) + inter_chunk(qc, states, log_decay)
    return o.reshape(b, h, -1, v.shape[-1])[:, :, :n], (final if need_state else None)
