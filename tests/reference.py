"""An fp64 reference written independently of the library: the masked N x N product.

It is plain torch operations, so autograd differentiates it: the gradient tests compare the
library's backward with autograd through this function."""

from __future__ import annotations

from typing import Optional

import torch


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gamma: torch.Tensor,
              scale: float = 1.0, layout: str = "bhnd",
              initial_state: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, final state) in float64, on the device of ``q`` (a GPU computes it in seconds).

    ``gamma``: per-head factors in (0, 1], shape [H]. Inputs in ``layout``; the output comes back
    in the same layout, the state as [B, H, Dk, Dv]. Differentiable with respect to every tensor
    argument that requires grad (the cast to float64 keeps the autograd history).
    """
    dev = q.device
    q, k, v = (x.to(dev, torch.float64) for x in (q, k, v))
    if layout == "bnhd":
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    g = gamma.to(dev, torch.float64)
    n = q.shape[2]
    i = torch.arange(n, dtype=torch.float64, device=dev)
    dist = i[:, None] - i[None, :]
    lg = torch.log(g)[:, None, None]
    m = torch.where(dist >= 0, torch.exp(lg * dist.clamp(min=0)), torch.zeros((), dtype=torch.float64, device=dev))
    o = ((q @ k.transpose(-1, -2)) * m) @ v
    # final state S_N = sum_j gamma^(N-1-j) k_j^T v_j (+ gamma^N S_0)
    w = torch.exp(lg[:, :, 0] * (n - 1 - i))[..., None]  # [H, N, 1]
    state = (k * w).transpose(-1, -2) @ v
    if initial_state is not None:
        s0 = initial_state.to(dev, torch.float64)
        o = o + torch.exp(lg[:, :, 0] * (i + 1))[..., None] * (q @ s0)
        state = state + torch.exp(torch.log(g) * n).view(-1, 1, 1) * s0
    o = o * scale
    if layout == "bnhd":
        o = o.transpose(1, 2)
    return o.contiguous(), state


def nan_reach(shape: tuple, where: str, b: int, h: int, row: int, col: int) -> torch.Tensor:
    """The outputs (a bool ``[B, H, N, Dv]`` mask) that a NaN put into ``where`` ("q", "k" or "v")
    at ``[b, h, row, col]`` reaches: q_i -> row i; k_j -> rows >= j; v_j[c] -> rows >= j, column c."""
    expected = torch.zeros(shape, dtype=torch.bool)
    if where == "q":
        expected[b, h, row, :] = True
    elif where == "k":
        expected[b, h, row:, :] = True
    else:
        expected[b, h, row:, col] = True
    return expected
