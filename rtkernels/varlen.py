r"""Packed variable-length batches: S sequences end to end in one ``[1, H, N, D]`` batch.

``cu_seqlens`` (``[S + 1]`` integers, ``0 = cu[0] <= cu[1] <= ... <= cu[S] = N``) cuts the N tokens
into sequences; sequence s is tokens ``cu[s] .. cu[s+1]-1`` (it may be empty) and attends only
within itself, from its own initial state ``S0[s]`` (or zero)::

    o_i = scale * ( sum_{j in seg(i), j <= i} gamma^(i-j) (q_i . k_j) v_j  +  gamma^(p_i+1) q_i S0[seg(i)] )
    F[s] = sum_{j in s} gamma^(e_s-j) k_j^T v_j  +  gamma^(len_s) S0[s]          (the final state)

with ``seg(i)`` the sequence of token i, ``p_i = i - cu[seg(i)]`` its position in it and ``e_s``
the last token of s. Nothing here reads a value of ``cu_seqlens`` on the host: every index is a
device tensor and every shape follows from N, S and the chunk size, so a CUDA call never syncs
and can be captured in a CUDA graph.

Two implementations give this answer. CUDA fp16/bf16/fp32 inputs the chunk kernel takes, with a
decay that does not require grad, run the chunk kernels with the offsets read on the device
(:mod:`rtkernels.methods.chunk.packed`: one CTA per sequence, head and value tile, never a split
sequence; the kernel backward's passes restart at every sequence too). Everything else runs this
module's torch path (:func:`varlen_attention`), also what torch.compile traces.

The torch path's algorithm, in torch operations (any device; autograd differentiates it), chunks of C tokens:

- ``seg = searchsorted(cu[1:], arange(N), right=True)``: the sequence of each token.
- Intra-chunk: ``A[t, s] = (q_t . k_s) gamma^(t-s)`` for ``s <= t`` and ``seg_t == seg_s``, else 0;
  the output gets ``A V``.
- Inter-chunk: ``X_c`` is the k-v state (initial states left out) of the sequence of the token just
  before chunk c, after that token. Sequences are contiguous, so the state after chunk c belongs
  to the sequence of its last token, ``sigma_c``: ``X_{c+1} = [sigma_c began before chunk c]
  gamma^C X_c + sum_t [seg_t == sigma_c] gamma^(C-1-t) k_t^T v_t`` (a scan over the chunks). Token
  t of chunk c reads it only if it continues that sequence: ``+ [seg_t == seg(cC-1)] gamma^(t+1) q_t X_c``.
- Initial states, kept out of X: every token adds ``gamma^(p_i+1) q_i S0[seg_i]`` (the state
  gathered per token, a block of C tokens at a time, recomputed in the backward).
- Final states: ``F[s] = [s began before its last chunk] gamma^(t_e+1) X_{c_e} + sum over the
  tokens j of s in that chunk of gamma^(e_s-j) k_j^T v_j + gamma^(len_s) S0[s]`` (``c_e, t_e``:
  chunk and row of e_s); the middle sum is one rank-1 update per token, added into its sequence's
  slot (``index_add``), the weights zero outside the last chunk of each sequence.

Only non-negative powers of gamma are formed, so nothing overflows. Work per head
O(N C (Dk + Dv) + N Dk Dv) (the chunked torch path's, plus O(N Dk Dv) for the initial states and
again for the final states when they are asked for); memory O(N C + (N / C) Dk Dv) per head, and
O(C Dk Dv) temporaries per block of C tokens; sequential in the N / C chunks (a Python loop, no
data-dependent control flow). Computed in float32 (float64 for float64 inputs).

Invalid values of a CPU ``cu_seqlens`` raise ``ValueError`` (:func:`check_cu_seqlens_values`). A
CUDA one cannot be read without a sync: every index is clamped into range (no out-of-bounds access)
and, unless ``cu[0] == 0``, ``cu[S] == N`` and ``cu`` is non-decreasing, every output and final state
is NaN (on the kernels: the gradients too). On the torch path a NaN or Inf in the inputs of one
sequence may reach the other sequences that share a chunk with it (the dense chunk products
multiply it by zeros); finite inputs give exact results. The kernels keep it in its sequence.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .decay import KIND_LOG, LogDecay, device_log
from .jit.dtypes import compute_dtype
from .methods._torch_common import scan_chunks, to_chunks

__all__ = ["CHUNK", "check_cu_seqlens", "check_cu_seqlens_values", "varlen_attention"]

#: Tokens per chunk of the varlen path (also the block of the per-token state products).
CHUNK = 64


def check_cu_seqlens(cu: torch.Tensor, n: int, device: torch.device) -> int:
    """Check what the host knows of ``cu_seqlens`` without reading it (dtype, shape, device) for a
    packed batch of ``n`` tokens on ``device``; returns S, the number of sequences."""
    if cu.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens must be an int32 or int64 tensor of sequence offsets, got dtype "
                        f"{str(cu.dtype).replace('torch.', '')}")
    if cu.dim() != 1 or cu.shape[0] < 1:
        raise ValueError(f"cu_seqlens must be a 1-D tensor [S + 1] of offsets 0 = cu[0] <= ... <= cu[S] = N, "
                         f"got shape {tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"cu_seqlens must be on the device of q ({device}), got {cu.device}")
    s = cu.shape[0] - 1
    if s == 0 and n > 0:
        raise ValueError(f"cu_seqlens has shape [1] (no sequences) but the batch holds N = {n} tokens; "
                         f"it must end at N: cu_seqlens[S] = {n}")
    return s


def check_cu_seqlens_values(cu: torch.Tensor, n: int) -> None:
    """``ValueError`` unless the CPU tensor ``cu`` starts at 0, never decreases and ends at ``n``."""
    vals = cu.tolist()
    if vals[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got cu_seqlens[0] = {vals[0]}")
    if vals[-1] != n:
        raise ValueError(f"cu_seqlens must end at N = {n} (the packed sequence length), got "
                         f"cu_seqlens[{len(vals) - 1}] = {vals[-1]}")
    for i in range(1, len(vals)):
        if vals[i] < vals[i - 1]:
            raise ValueError(f"cu_seqlens must be non-decreasing, got cu_seqlens[{i - 1}] = {vals[i - 1]} > "
                             f"cu_seqlens[{i}] = {vals[i]}")


def _log_gamma(log_decay: LogDecay, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[H]`` log(gamma) in ``dtype`` on ``device``, with autograd history back to a decay tensor
    that requires grad (a CPU tensor's tracked log, or a CUDA tensor's factors or rates)."""
    src = log_decay.source
    if src is None:
        return log_decay.tensor(dtype)
    if log_decay.source_kind == KIND_LOG:
        return src.to(device=device, dtype=dtype)
    return device_log(src, log_decay.source_kind, dtype)  # differentiable: the kernels' clamped log


def _state_products(q: torch.Tensor, s0: torch.Tensor, seg: torch.Tensor) -> torch.Tensor:
    """``y[h, i] = q[h, i] @ s0[seg[i], h]`` for ``q`` ``[H, T, Dk]``, ``s0`` ``[S, H, Dk, Dv]``."""
    return torch.einsum("htk,thkv->htv", q, s0.index_select(0, seg))


def _initial_state_term(q: torch.Tensor, s0: torch.Tensor, seg: torch.Tensor) -> torch.Tensor:
    """``q_i @ S0[seg_i]`` for every token, ``[H, N, Dv]``: blocks of :data:`CHUNK` tokens, each
    block's gathered states recomputed in the backward (checkpoint) rather than kept, so autograd
    holds O(C Dk Dv) of them at a time instead of O(N Dk Dv)."""
    track = torch.is_grad_enabled() and (q.requires_grad or s0.requires_grad)
    parts = []
    for lo in range(0, q.shape[1], CHUNK):
        args = (q[:, lo:lo + CHUNK], s0, seg[lo:lo + CHUNK])
        parts.append(checkpoint(_state_products, *args, use_reentrant=False, preserve_rng_state=False)
                     if track else _state_products(*args))
    return torch.cat(parts, dim=1)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     log_decay: LogDecay, scale: float, initial_state: Optional[torch.Tensor], need_state: bool,
                     checked_values: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The packed call (module docstring) on ``[1, H, N, D]`` views: ``(output [1, H, N, Dv] in the
    input dtype, final states [S, H, Dk, Dv] in the compute dtype or None)``, with autograd history
    to q, k, v, ``initial_state`` (``[S, H, Dk, Dv]``) and a decay tensor that requires grad.
    ``checked_values``: the host has validated ``cu_seqlens`` (else an invalid one gives NaN)."""
    cdt = compute_dtype(q.dtype)
    dev = q.device
    _, h, n, dk = q.shape
    dv = v.shape[3]
    s = cu_seqlens.shape[0] - 1
    lg = _log_gamma(log_decay, cdt, dev)
    s0 = None if initial_state is None else initial_state.to(cdt)
    cu = cu_seqlens.to(torch.int64)
    zero = torch.zeros((), dtype=cdt, device=dev)
    # an invalid cu_seqlens on the device: NaN in every output and state, decided with no sync
    poison = None if checked_values else torch.where(
        (cu[0] == 0) & (cu[-1] == n) & (cu[1:] >= cu[:-1]).all(), zero, torch.full((), math.nan, dtype=cdt, device=dev))
    if n == 0:  # every sequence is empty: its state is its initial state
        tied = sum((x.sum() for x in (q, k, v) if x.requires_grad), zero) * 0  # still a function of q, k, v
        if poison is not None:
            tied = tied + poison
        out = torch.zeros(1, h, 0, dv, dtype=cdt, device=dev) + tied
        state = None
        if need_state:
            state = (s0 if s0 is not None else torch.zeros(s, h, dk, dv, dtype=cdt, device=dev)) + tied
        return out.to(q.dtype), state

    c = CHUNK
    nc = -(-n // c)
    idx = torch.arange(n, device=dev)
    # the sequence of each token; clamped so that an invalid cu_seqlens still indexes in range
    seg = torch.searchsorted(cu[1:], idx, right=True).clamp_(max=s - 1)
    segc = F.pad(seg, (0, nc * c - n), value=s).view(nc, c)  # the padding rows: a sequence of their own
    prev = torch.cat([segc.new_full((1,), -1), segc[:-1, -1]])  # the sequence of the token before each chunk
    last = segc[:, -1]
    t = torch.arange(c, device=dev)
    qc, kc, vc = (to_chunks(x.to(cdt), c)[0] for x in (q, k, v))  # [H, nc, C, D]

    # intra-chunk: the causal decay mask, cut where the sequence changes
    keep = (segc[:, :, None] == segc[:, None, :]) & (t[:, None] >= t[None, :])  # [nc, C, C]
    dist = (t[:, None] - t[None, :]).clamp(min=0).to(cdt)
    mask = torch.exp(lg[:, None, None] * dist)[:, None]                          # [H, 1, C, C]
    o = torch.where(keep, (qc @ kc.transpose(-1, -2)) * mask, zero) @ vc        # [H, nc, C, Dv]

    # inter-chunk: X_c, the k-v state of the sequence running into chunk c
    to_end = torch.exp(lg[:, None, None] * (c - 1 - t).to(cdt))                 # [H, 1, C]: gamma^(C-1-t)
    own_w = torch.where(segc == last[:, None], to_end, zero)                    # [H, nc, C]
    own = (kc * own_w[..., None]).transpose(-1, -2) @ vc                        # [H, nc, Dk, Dv]
    carry = torch.where(last == prev, torch.exp(lg * c)[:, None], zero)          # [H, nc]
    first = torch.zeros(1, h, dk, dv, dtype=cdt, device=dev)
    entering, _ = scan_chunks(first, own[None], carry[..., None, None])
    x = entering[0]                                                             # [H, nc, Dk, Dv]
    from_start = torch.exp(lg[:, None, None] * (t + 1).to(cdt))                 # [H, 1, C]: gamma^(t+1)
    in_w = torch.where(segc == prev[:, None], from_start, zero)
    o = o + in_w[..., None] * (qc @ x)
    o = o.reshape(h, nc * c, dv)[:, :n]

    pos = (idx - cu.index_select(0, seg)).clamp(0, n).to(cdt)                   # p_i
    if s0 is not None:
        o = o + torch.exp(lg[:, None] * (pos + 1))[..., None] * _initial_state_term(q[0].to(cdt), s0, seg)
    o = o * scale

    state = None
    if need_state:
        lens = (cu[1:] - cu[:-1]).clamp(0, n)
        end = (cu[1:] - 1).clamp(0, n - 1)
        ce = torch.div(end, c, rounding_mode="floor")
        te = (end - ce * c).to(cdt)
        # what X carries in: sequences that began before the chunk of their last token
        before = (lens > 0) & (cu[:-1] < ce * c)
        w_carry = torch.where(before, torch.exp(lg[:, None] * (te + 1)), zero)  # [H, S]
        state = (w_carry[..., None, None] * x.index_select(1, ce)).transpose(0, 1)  # [S, H, Dk, Dv]
        # the tokens of each sequence in the chunk of its last token, decayed to that token
        tok_end = end.index_select(0, seg)
        in_last = torch.div(idx, c, rounding_mode="floor") == torch.div(tok_end, c, rounding_mode="floor")
        w_tok = torch.where(in_last, torch.exp(lg[:, None] * (tok_end - idx).clamp(min=0).to(cdt)), zero)
        kw = (k[0].to(cdt) * w_tok[..., None]).transpose(0, 1)                  # [N, H, Dk]
        vt = v[0].to(cdt).transpose(0, 1)                                       # [N, H, Dv]
        state = state.contiguous()
        for lo in range(0, n, c):  # one rank-1 update per token, added into its sequence's slot
            state.index_add_(0, seg[lo:lo + c], kw[lo:lo + c, :, :, None] * vt[lo:lo + c, :, None, :])
        if s0 is not None:
            state = state + torch.exp(lg[None, :] * lens[:, None].to(cdt))[..., None, None] * s0
    if poison is not None:
        o = o + poison
        state = None if state is None else state + poison
    return o[None].to(q.dtype), state
