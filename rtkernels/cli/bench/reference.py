"""The bench's fp64 reference: written from the formula, sharing no code with rtkernels' methods.

Blocks of ``BLOCK`` tokens: inside a block the masked product ``(q kᵀ ∘ M) v`` with
``M[i, j] = γ^(i−j)`` for j ≤ i; across blocks an fp64 state ``S ← γ^L S + Σ_j γ^(L−1−j) k_jᵀ v_j``
read as ``γ^(i+1) q_i S``. Exact in fp64 up to rounding, O(N · BLOCK · D) work and O(BLOCK²)
memory per head, so it serves every bench shape (also a million tokens), and torch autograd through
it gives the fp64 gradients of q, k, v and γ.
"""

from __future__ import annotations

import torch

__all__ = ["BLOCK", "head_reference"]

BLOCK = 1024


def head_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """``o[i] = Σ_{j≤i} γ^(i−j) (q_i · k_j) v_j`` of one head in fp64: q, k ``[N, Dk]``, v ``[N, Dv]``,
    ``gamma`` a 0-d fp64 tensor in (0, 1] (may require grad). Differentiable."""
    q, k, v = (t.to(torch.float64) for t in (q, k, v))
    n, dk, dv = q.shape[0], q.shape[1], v.shape[1]
    lg = torch.log(gamma.to(torch.float64))
    state = torch.zeros(dk, dv, dtype=torch.float64, device=q.device)
    outs = []
    for start in range(0, n, BLOCK):
        qb, kb, vb = q[start:start + BLOCK], k[start:start + BLOCK], v[start:start + BLOCK]
        length = qb.shape[0]
        t = torch.arange(length, dtype=torch.float64, device=q.device)
        dist = t[:, None] - t[None, :]
        mask = torch.where(dist >= 0, torch.exp(lg * dist.clamp(min=0)), torch.zeros((), dtype=torch.float64,
                                                                                      device=q.device))
        outs.append((qb @ kb.T * mask) @ vb + torch.exp(lg * (t + 1))[:, None] * (qb @ state))
        state = torch.exp(lg * length) * state + (kb * torch.exp(lg * (length - 1 - t))[:, None]).T @ vb
    return torch.cat(outs)
