"""Pieces shared by the torch paths of every method.

Tensors are ``[B, H, ..., n, D]`` (the head dimension second; optional block dimensions between
the head and the token dimension), already in the compute dtype (float64 for float64 inputs,
float32 otherwise). ``log_decay`` is the per-head ``log(gamma)``, shape ``[H]``, values <= 0.
Only non-negative powers of gamma are ever formed (DESIGN.md §1), so nothing overflows for any
gamma in (0, 1] and any sequence length.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..decay import LogDecay
from ..runtime.dtypes import compute_dtype

__all__ = ["decay_powers", "causal_decay_matrix", "causal_apply", "intra_chunk", "inter_chunk",
           "block_state", "state_update", "carry_state", "zero_state", "TorchForward", "run_torch_path"]


def _per_head(x: torch.Tensor, ndim: int) -> torch.Tensor:
    """View ``x`` of shape ``[H, *rest]`` as ``[H, 1, ..., 1, *rest]`` with ``ndim`` dimensions."""
    return x.view(x.shape[0], *([1] * (ndim - x.dim())), *x.shape[1:])


def decay_powers(log_decay: torch.Tensor, n: int, start: int = 0, ndim: int = 4) -> torch.Tensor:
    """gamma_h ** (start + t) for t = 0 .. n-1, shaped ``[H, 1.., n, 1]`` to broadcast against a
    ``[B, H, .., n, D]`` tensor with ``ndim`` dimensions (start >= 0)."""
    t = torch.arange(start, start + n, device=log_decay.device, dtype=log_decay.dtype)
    return _per_head(torch.exp(log_decay[:, None] * t[None, :])[..., None], ndim - 1)


def causal_decay_matrix(log_decay: torch.Tensor, n: int, ndim: int = 4) -> torch.Tensor:
    """M[t, s] = gamma_h ** (t - s) for t >= s and exactly 0 above the diagonal, shaped
    ``[H, 1.., n, n]`` for ``ndim``-dimensional operands."""
    t = torch.arange(n, device=log_decay.device, dtype=log_decay.dtype)
    dist = t[:, None] - t[None, :]
    m = torch.exp(log_decay[:, None, None] * dist.clamp(min=0))
    m = torch.where(dist >= 0, m, torch.zeros((), dtype=m.dtype, device=m.device))
    return _per_head(m, ndim - 1)


def causal_apply(a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``a @ x`` for a lower-triangular ``a`` (``[..., n, n]``), with the causal sum's NaN semantics.

    A dense product multiplies the zeros above the diagonal with every row of ``x``, so a NaN (or
    Inf) in row j of ``x`` would leak into the rows i < j, which the causal sum never reaches. Here
    non-finite entries of ``x`` are taken out of the product and put back as NaN into exactly the
    entries (rows i >= j, same column) that the causal sum reaches.
    """
    bad = ~torch.isfinite(x)
    clean = torch.where(bad, torch.zeros((), dtype=x.dtype, device=x.device), x)
    out = a @ clean
    reached = torch.cumsum(bad.to(torch.int32), dim=-2) > 0
    return torch.where(reached, torch.full((), float("nan"), dtype=out.dtype, device=out.device), out)


def intra_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor) -> torch.Tensor:
    """Within each block of n tokens: sum_{s <= t} gamma^(t-s) (q_t . k_s) v_s, ``[..., n, Dv]``.

    Work O(n^2 (Dk + Dv)), memory O(n^2) per block. The mask is a select, not a product, so a NaN
    in k_s reaches the rows t >= s only.
    """
    n = q.shape[-2]
    m = causal_decay_matrix(log_decay, n, q.dim())
    lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    scores = q @ k.transpose(-1, -2)
    a = torch.where(lower, scores * m, torch.zeros((), dtype=scores.dtype, device=scores.device))
    return causal_apply(a, v)


def inter_chunk(q: torch.Tensor, state: torch.Tensor, log_decay: torch.Tensor) -> torch.Tensor:
    """What the state carried into a block adds: gamma^(t+1) q_t S, ``[.., n, Dv]``."""
    return decay_powers(log_decay, q.shape[-2], start=1, ndim=q.dim()) * (q @ state)


def block_state(k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor) -> torch.Tensor:
    """A block's own state: sum_s gamma^(n-1-s) k_s^T v_s, ``[.., Dk, Dv]``."""
    w = decay_powers(log_decay, k.shape[-2], ndim=k.dim()).flip(-2)  # gamma^(n-1-s)
    return (k * w).transpose(-1, -2) @ v


def state_update(state: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor) -> torch.Tensor:
    """State after a block of n tokens: gamma^n S + sum_s gamma^(n-1-s) k_s^T v_s."""
    n = k.shape[-2]
    carry = _per_head(torch.exp(log_decay * n)[:, None, None], state.dim() - 1)
    return carry * state + block_state(k, v, log_decay)


#: A torch path: (q, k, v, log_decay, initial_state or None) -> (output, final state or None),
#: everything in the compute dtype, shapes [B, H, N, D]; the output is unscaled.
TorchForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor], bool],
                        tuple[torch.Tensor, Optional[torch.Tensor]]]


def run_torch_path(fn: TorchForward, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   log_decay: "LogDecay", scale: float, out: torch.Tensor,
                   initial_state: Optional[torch.Tensor], need_state: bool) -> Optional[torch.Tensor]:
    """Run a torch path in the compute dtype, write ``scale * output`` into ``out`` and return the
    final state (compute dtype) when ``need_state``."""
    cdt = compute_dtype(q.dtype)
    s0 = None if initial_state is None else initial_state.to(cdt)
    o, state = fn(q.to(cdt), k.to(cdt), v.to(cdt), log_decay.tensor(cdt), s0, need_state)
    if scale != 1.0:
        o = o * scale
    out.copy_(o)
    return state


def carry_state(o: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                log_decay: torch.Tensor, initial_state: Optional[torch.Tensor],
                need_state: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Give a whole-sequence method (one that ignores states) the state interface: add what
    ``initial_state`` contributes to the output ``o`` and compute the final state if asked."""
    if initial_state is not None:
        o = o + inter_chunk(q, initial_state, log_decay)
    state = None
    if need_state:
        state = (block_state(k, v, log_decay) if initial_state is None
                 else state_update(initial_state, k, v, log_decay))
    return o, state


def zero_state(q: torch.Tensor, v: torch.Tensor, initial_state: Optional[torch.Tensor]) -> torch.Tensor:
    """``initial_state`` or a zero ``[B, H, Dk, Dv]`` state in the dtype of ``q``."""
    if initial_state is not None:
        return initial_state
    b, h, _, dk = q.shape
    return torch.zeros(b, h, dk, v.shape[-1], dtype=q.dtype, device=q.device)
