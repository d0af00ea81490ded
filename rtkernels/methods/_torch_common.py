"""Pieces shared by the torch paths of every method.

Tensors are ``[B, H, ..., n, D]`` (the head dimension second; optional block dimensions between
the head and the token dimension), already in the compute dtype (float64 for float64 inputs,
float32 otherwise). ``log_decay`` is the per-head ``log(gamma)``, shape ``[H]``, values <= 0.
Only non-negative powers of gamma are ever formed (docs/design.md), so nothing overflows for any
gamma in (0, 1] and any sequence length.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ..decay import LogDecay
from ..jit.dtypes import compute_dtype

__all__ = ["decay_powers", "causal_decay_matrix", "causal_mask", "causal_apply", "intra_chunk", "inter_chunk",
           "block_state", "state_update", "carry_state", "zero_state", "to_chunks", "chunk_end_decays",
           "scan_chunks", "TorchForward", "run_torch_path"]


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


def causal_apply(a: torch.Tensor, x: torch.Tensor, upper: bool = False) -> torch.Tensor:
    """``a @ x`` for a lower-triangular ``a`` (``[..., n, n]``), with the causal sum's NaN semantics;
    with ``upper``, ``a`` is upper-triangular (the transposed, anti-causal sums of a backward pass).

    A dense product multiplies the zeros above the diagonal with every row of ``x``, so a NaN (or
    Inf) in row j of ``x`` would leak into the rows i < j, which the causal sum never reaches. Here
    non-finite entries of ``x`` are taken out of the product and put back as NaN into exactly the
    entries (rows i >= j, same column; rows i <= j with ``upper``) that the sum reaches.
    """
    bad = ~torch.isfinite(x)
    clean = torch.where(bad, torch.zeros((), dtype=x.dtype, device=x.device), x)
    out = a @ clean
    hits = bad.to(torch.int32)
    reached = (hits.flip(-2).cumsum(dim=-2).flip(-2) if upper else torch.cumsum(hits, dim=-2)) > 0
    return torch.where(reached, torch.full((), float("nan"), dtype=out.dtype, device=out.device), out)


def causal_mask(scores: torch.Tensor, log_decay: torch.Tensor) -> torch.Tensor:
    """``scores[.., t, s] * gamma^(t-s)`` for s <= t and exactly 0 above the diagonal, ``[..., n, n]``.

    The mask is a select, not a product, so a NaN score stays NaN where the causal sum reaches it
    (s <= t) and nowhere else.
    """
    n = scores.shape[-1]
    m = causal_decay_matrix(log_decay, n, scores.dim())
    lower = torch.ones(n, n, dtype=torch.bool, device=scores.device).tril()
    return torch.where(lower, scores * m, torch.zeros((), dtype=scores.dtype, device=scores.device))


def intra_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor) -> torch.Tensor:
    """Within each block of n tokens: sum_{s <= t} gamma^(t-s) (q_t . k_s) v_s, ``[..., n, Dv]``.

    Work O(n^2 (Dk + Dv)), memory O(n^2) per block. A NaN in k_s reaches the rows t >= s only
    (see :func:`causal_mask` and :func:`causal_apply`).
    """
    return causal_apply(causal_mask(q @ k.transpose(-1, -2), log_decay), v)


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


def to_chunks(x: torch.Tensor, c: int) -> torch.Tensor:
    """``[B, H, N, D]`` -> ``[B, H, ceil(N / c), c, D]``, the last chunk padded with zero rows
    (zero rows at the end reach no real row, by causality)."""
    b, h, n, d = x.shape
    nc = -(-n // c)
    return F.pad(x, (0, 0, 0, nc * c - n)).view(b, h, nc, c, d)


def chunk_end_decays(log_decay: torch.Tensor, n: int, c: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decays to the end of each chunk of :func:`to_chunks`, whose real length is L = c (the last
    one: whatever is left of the n tokens).

    Returns ``(to_end, carry, exponent)``: ``to_end[h, chunk, t, 0] = gamma_h^(L-1-t)`` (for the
    padded rows t >= L the exponent is taken as 0; they hold zeros), ``carry[h, chunk, 0, 0] =
    gamma_h^L``, and ``exponent`` the int64 ``[chunks, c]`` of L-1-t (0 on the padded rows). All
    exponents are non-negative.
    """
    nc = -(-n // c)
    dev = log_decay.device
    lengths = (n - c * torch.arange(nc, device=dev)).clamp(max=c)               # L per chunk
    exponent = (lengths[:, None] - 1 - torch.arange(c, device=dev)[None, :]).clamp(min=0)
    lg = log_decay.view(-1, 1, 1)
    to_end = torch.exp(lg * exponent.to(log_decay.dtype))[..., None]
    carry = torch.exp(lg[:, :, 0] * lengths.to(log_decay.dtype))[..., None, None]
    return to_end, carry, exponent


def scan_chunks(first: torch.Tensor, own: torch.Tensor, carry: torch.Tensor,
                reverse: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The state recurrence over chunks: ``X = first``, then for each chunk c in order (from the
    last to the first with ``reverse``) ``X <- carry_c * X + own_c``.

    ``first``: ``[B, H, Dk, Dv]``; ``own``: ``[B, H, chunks, Dk, Dv]``; ``carry``: ``[H, chunks, 1, 1]``.
    Returns ``(entering, last)``: the state entering each chunk, ``[B, H, chunks, Dk, Dv]`` in chunk
    order, and the state after the last chunk processed. Work O(chunks Dk Dv), sequential in chunks.
    """
    nc = own.shape[2]
    order = range(nc - 1, -1, -1) if reverse else range(nc)
    entering: list[Optional[torch.Tensor]] = [None] * nc
    state = first
    for c in order:
        entering[c] = state
        state = torch.addcmul(own[:, :, c], carry[:, c], state)  # one launch a chunk, not two
    return torch.stack(entering, dim=2), state


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
