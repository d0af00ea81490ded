r"""Packed variable-length batches (``cu_seqlens``, :mod:`rtkernels.varlen`) on the chunk kernels.

S sequences end to end in a ``[1, H, N, D]`` batch, sequence s being tokens ``cu[s] .. cu[s+1]-1``.
The forward kernels take them as they are: one CTA per (sequence, head, value tile), grid.x = S * H
where an ordinary call has B * H; the CTA reads ``cu[s]`` and ``cu[s+1]`` on the device
(``rtk_chunk_rows_of`` in ``cuda_src/chunk/cta.cuh``), starts from its sequence's initial state
(slot s * H + h of ``[S, H, Dk, Dv]``) and writes its final state there. Nothing reads an offset on
the host: a call never syncs and can be captured in a CUDA graph.

- The offsets go to the kernel as int64 (``cu.to(torch.int64)``, a device copy for int32) with a
  device bool saying they are valid: ``cu[0] == 0``, ``cu[S] == N``, non-decreasing (a few small
  torch ops, no sync). The kernel clamps each sequence into [0, N] (no out-of-bounds access for any
  value); invalid offsets make every output and state NaN (sequence 0 takes every row, with a NaN
  scale and NaN states), as the torch path's documented behaviour.
- One segment per sequence: the split-sequence strategy needs each sequence's segment count, which
  only the offsets know (:func:`.plan.packed_launch` never splits). A batch of a few long sequences
  and few heads therefore fills fewer SMs than an ordinary call of the same sequences one by one
  with split segments would.
- Backward (:func:`packed_backward`): the three passes of :mod:`.backward` with the same offsets
  (dq in token order, dk and dv reversed: the kernel maps sequence s to reversed rows
  ``[N - cu[s+1], N - cu[s])``), so each pass restarts at every sequence boundary; dk and dv as one
  walk where :func:`.plan.fuses_dk_dv` holds for S * H CTA rows. The terms of the
  final state's gradient G, ``dk_j += gamma^(e_s - j) v_j G[s]^T`` and ``dv_j += gamma^(e_s - j) k_j
  G[s]`` (e_s the last token of j's sequence) and ``gamma^(len_s) G[s]`` in dS_0[s], ride on the
  reversed passes as in an ordinary call (:mod:`.backward`): each sequence's reversed walk starts at
  e_s from the initial state ``G[s] / (scale gamma)``, so no pass of their own. As there, a head
  whose gamma is below eps^2 takes them on each sequence's last token only, and |scale| below
  ``backward.STATE_GRAD_MIN_SCALE`` keeps torch products over blocks of tokens with G gathered per token
  (positions from ``searchsorted`` on the device). dS_0[s] is ``scale gamma R[s]`` with R the dv
  pass's final states (plus the G term where the passes did not carry it).
- A decay that requires grad: dlog(gamma) comes from the backward's dq pass, which sums it per
  (sequence, head, tile of Dk) CTA (:func:`.decay_grad.dq_pass_sums`, the DLOG instance: S and
  W = dS/dlog(gamma) restart at every sequence, W from 0; the CTA ending sequence s adds <G[s], W>
  for a used final state), one row of partial sums per sequence, added per head by the sum kernel.
  Taken where that pass runs (fp16 or bf16, 16-byte rows, wgmma); otherwise, as every other call the
  kernels do not take, the whole call runs the torch path of :mod:`rtkernels.varlen`.

Precision is that of the ordinary kernel call per sequence (16-bit operands and state copy, fp32
state); outputs and gradients agree with one call per sequence to the input dtype's rounding.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from ...decay import LogDecay
from ...jit.dtypes import compute_dtype
from . import launch
from .backward import grad_state_entry, gradient_passes, kernel_runs
from .decay_grad import PartialSums, dq_pass_sums
from .plan import aligned

__all__ = ["takes", "offsets", "packed_attention", "packed_backward", "forward_pass", "GATHER_BYTES"]

#: Bytes of G gathered per block of tokens in the backward's G terms (``[T, H, Dk, Dv]`` fp32).
GATHER_BYTES = 1 << 27


def takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: LogDecay) -> bool:
    """Whether a packed call on these ``[1, H, N, D]`` views runs the kernels: CUDA fp16/bf16/fp32 the
    chunk kernel takes (:func:`.backward.kernel_runs`), N > 0, and a decay without autograd history
    or one whose gradient the dq pass sums (module docstring: :func:`.decay_grad.dq_pass_sums` for
    these views, Dv a multiple of 8 so that a contiguous output gradient has 16-byte rows too)."""
    if q.shape[2] == 0 or not kernel_runs(q, k, v):
        return False
    return log_decay.source is None or (v.shape[-1] % 8 == 0 and dq_pass_sums(q, k, v, v, None))


def offsets(cu: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cu as contiguous int64, valid)`` on cu's device, ``valid`` a 0-dim bool: ``cu[0] == 0``,
    ``cu[S] == n`` and non-decreasing. Device operations only (no sync)."""
    cu64 = cu.to(torch.int64).contiguous()
    valid = (cu64[0] == 0) & (cu64[-1] == n) & (cu64[1:] >= cu64[:-1]).all()
    return cu64, valid


def forward_pass(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: LogDecay, scale: float,
                 out: torch.Tensor, initial_state: Optional[torch.Tensor], need_state: bool, reverse: bool,
                 fp32_precision: str, packed: tuple[torch.Tensor, torch.Tensor],
                 dlog: Optional[tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]] = None,
                 dual: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> Optional[torch.Tensor]:
    """One kernel pass over the packed sequences (:func:`.launch.kernel_forward` with ``packed``):
    ``out`` written, the ``[S, H, Dk, Dv]`` fp32 final states returned when ``need_state``; ``dlog``:
    the dq pass that also sums dlog(gamma), ``dual``: the dv pass that also writes dk, as for that
    function."""
    return launch.kernel_forward(q, k, v, log_decay, scale, out, initial_state, need_state, fp32_precision,
                                 reverse=reverse, packed=packed, dlog=dlog, dual=dual)


class _PackedCall:
    __slots__ = ("log_decay", "scale", "bnhd", "return_state", "fp32_precision", "packed")

    def __init__(self, log_decay: LogDecay, scale: float, bnhd: bool, return_state: bool, fp32_precision: str,
                 packed: tuple[torch.Tensor, torch.Tensor]):
        self.log_decay, self.scale, self.bnhd, self.return_state = log_decay, scale, bnhd, return_state
        self.fp32_precision, self.packed = fp32_precision, packed


def _forward(call: _PackedCall, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             initial_state: Optional[torch.Tensor]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    _, h, n, _ = q.shape
    dv = v.shape[3]
    out = torch.empty((1, n, h, dv) if call.bnhd else (1, h, n, dv), dtype=q.dtype, device=q.device)
    state = forward_pass(q, k, v, call.log_decay, call.scale, out.transpose(1, 2) if call.bnhd else out,
                         initial_state, call.return_state, False, call.fp32_precision, call.packed)
    return out, state


class PackedFunction(torch.autograd.Function):
    """``(call, q, k, v, initial_state, log_decay_source) -> (out, final states or None)`` on
    ``[1, H, N, D]`` views, the output contiguous in the caller's layout; ``log_decay_source``:
    :attr:`LogDecay.source` (a decay that requires grad) or None. Not twice differentiable."""

    @staticmethod
    def forward(ctx, call: _PackedCall, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                initial_state: Optional[torch.Tensor], log_decay_source: Optional[torch.Tensor] = None):
        out, state = _forward(call, q, k, v, initial_state)
        ctx.save_for_backward(q, k, v, initial_state)
        ctx.call = call
        ctx.source_meta = None if log_decay_source is None else (log_decay_source.device, log_decay_source.dtype)
        ctx.set_materialize_grads(False)  # an unused state gets no G terms (a per-token gather)
        if state is None:
            return out, None
        return out, state

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor, grad_state: Optional[torch.Tensor] = None):
        q, k, v, s0 = ctx.saved_tensors
        call = ctx.call
        _, need_q, need_k, need_v, need_s0, need_decay = ctx.needs_input_grad
        if grad_out is None:  # only the states reach the loss
            _, h, n, _ = q.shape
            grad_out = torch.zeros((1, n, h, v.shape[3]) if call.bnhd else (1, h, n, v.shape[3]), dtype=q.dtype,
                                   device=q.device)
        g = grad_out.transpose(1, 2) if call.bnhd else grad_out
        dq, dk, dv, ds0, d_decay = packed_backward(q, k, v, call.log_decay, call.scale, s0, g,
                                                   grad_state if call.return_state else None,
                                                   need_s0 and s0 is not None, call.fp32_precision, call.packed,
                                                   need_decay)
        return (None, dq if need_q else None, dk if need_k else None, dv if need_v else None,
                ds0.to(s0.dtype) if need_s0 and s0 is not None else None,
                d_decay.to(*ctx.source_meta) if need_decay else None)


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, log_decay: LogDecay,
                     scale: float, initial_state: Optional[torch.Tensor], need_state: bool, bnhd: bool,
                     fp32_precision: str, with_grad: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The packed call on the kernels (:func:`takes` holds): ``(output in the caller's layout, [S, H,
    Dk, Dv] fp32 final states or None)``, through :class:`PackedFunction` when ``with_grad``."""
    call = _PackedCall(log_decay, scale, bnhd, need_state, fp32_precision, offsets(cu, q.shape[2]))
    if with_grad:
        out, state = PackedFunction.apply(call, q, k, v, initial_state, log_decay.source)
    else:
        out, state = _forward(call, q, k, v, initial_state)
    return out, state


def _state_terms(dk: torch.Tensor, dv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g_state: torch.Tensor,
                 lg: torch.Tensor, cu64: torch.Tensor) -> None:
    """``dk_j += gamma^(e_s - j) v_j G[s]^T`` and ``dv_j += gamma^(e_s - j) k_j G[s]`` in place, s the
    sequence of token j and e_s its last token (``[1, H, N, D]`` views, G ``[S, H, Dk, Dv]`` and ``lg``
    ``[H]`` in the compute dtype). Positions come from the device offsets (clamped: any values index
    in range); G is gathered per token in blocks of at most :data:`GATHER_BYTES`, each block's sum
    rounded once into the 16-bit gradients."""
    _, h, n, dkk = k.shape
    s, dvv = g_state.shape[0], g_state.shape[3]
    idx = torch.arange(n, device=k.device)
    seg = torch.searchsorted(cu64[1:], idx, right=True).clamp_(max=s - 1)
    last = (cu64[1:] - 1).clamp(0, n - 1).index_select(0, seg)       # e_s of each token
    to_end = torch.exp(lg[:, None] * (last - idx).clamp(min=0).to(lg.dtype))[..., None]  # [H, N, 1]
    g_h = g_state.transpose(0, 1)                                    # [H, S, Dk, Dv]
    step = max(1, GATHER_BYTES // (h * dkk * dvv * g_state.element_size()))
    for a in range(0, n, step):
        rows = slice(a, a + step)
        gs = g_h.index_select(1, seg[rows])                              # [H, T, Dk, Dv]
        w = to_end[:, rows]
        x = v[0, :, rows, None, :].to(gs.dtype) @ gs.transpose(-1, -2)   # [H, T, 1, Dk]
        dk[0, :, rows].add_(w * x[:, :, 0])
        x = k[0, :, rows, None, :].to(gs.dtype) @ gs                     # [H, T, 1, Dv]
        dv[0, :, rows].add_(w * x[:, :, 0])


def _last_token_terms(dk: torch.Tensor, dv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g_state: torch.Tensor,
                      far: torch.Tensor, cu64: torch.Tensor) -> None:
    """The G terms of each sequence's last token e_s (weight gamma^0) for the ``far`` heads of
    :func:`.backward.grad_state_entry`: ``dk[e_s] += v[e_s] G[s]^T`` and ``dv[e_s] += k[e_s] G[s]`` in
    ``g_state``'s dtype, rounded to the gradients' dtype and added in place. Other heads and empty
    sequences add an exact 0 (an empty sequence's clamped e_s may be another's), so the order of the
    accumulating adds cannot change a bit. Work O(S H Dk Dv), no token-sized temporaries."""
    n, h = k.shape[2], k.shape[1]
    lo, hi = cu64[:-1].clamp(0, n), cu64[1:].clamp(0, n)
    last = (hi - 1).clamp(min=0)                                   # [S]
    keep = (far.view(-1, 1) & (hi > lo).view(1, -1))[..., None]    # [H, S, 1]
    heads = torch.arange(h, device=k.device)
    zero = torch.zeros((), dtype=g_state.dtype, device=g_state.device)
    g_h = g_state.transpose(0, 1)                                  # [H, S, Dk, Dv]
    for dst, x, m in ((dk, v, g_h.transpose(-1, -2)), (dv, k, g_h)):
        rows = x[0].index_select(1, last).to(g_state.dtype)        # [H, S, Dx]
        terms = torch.where(keep, (rows.unsqueeze(-2) @ m).squeeze(-2), zero).to(dst.dtype)  # [H, S, D]
        base = dst[0]
        if not base.is_contiguous() and base.transpose(0, 1).is_contiguous():  # [B, N, H, D] memory
            base.transpose(0, 1).index_put_((last.view(-1, 1), heads.view(1, -1)), terms.transpose(0, 1),
                                            accumulate=True)
        else:
            base.index_put_((heads.view(-1, 1), last.view(1, -1)), terms, accumulate=True)


def packed_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: LogDecay, scale: float,
                    initial_state: Optional[torch.Tensor], grad_out: torch.Tensor, grad_state: Optional[torch.Tensor],
                    need_state_grad: bool, fp32_precision: str, packed: tuple[torch.Tensor, torch.Tensor],
                    need_decay_grad: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``(dq, dk, dv, dS_0 or None, d_decay or None)`` of a packed call (module docstring): dq, dk, dv
    in the input dtype with the strides of q, k, v where dense, dS_0 ``[S, H, Dk, Dv]`` in fp32;
    with ``need_decay_grad`` (:func:`takes` held), dL/d(``log_decay.source``), ``[H]`` float32,
    summed by the dq pass (with the final states' term when ``grad_state`` is given)."""
    cdt = compute_dtype(q.dtype)
    sums = partials = g_fp32 = None
    if need_decay_grad:
        if not aligned(grad_out):  # the pass reads dL/do by 16-byte copies; a fresh one is aligned
            grad_out = grad_out.clone(memory_format=torch.contiguous_format)  # (takes(): Dv % 8 == 0)
        sums = PartialSums(q, v, log_decay, packed[0].shape[0] - 1)
        partials = sums.buffer()
        g_fp32 = None if grad_state is None else grad_state.to(torch.float32).contiguous()

    def run(*args, keep=None, **kw):  # one kernel pass over the same sequences (one segment: no slots to keep)
        return forward_pass(*args, fp32_precision, packed, **kw)

    lg = None if grad_state is None else log_decay.tensor(cdt)  # formed once for the G terms and dS_0
    entry, far = grad_state_entry(grad_state, lg, scale)  # the G terms ride on the reversed passes
    dq, dk, dv, d_s0, lg = gradient_passes(run, q, k, v, log_decay, scale, initial_state, grad_out, grad_state,
                                           need_state_grad, q.dtype, partials, g_fp32, fuse_dk_dv=None,
                                           sequences=packed[0].shape[0] - 1, state_grad_entry=entry, lg=lg)
    if grad_state is not None:
        cu64 = packed[0]
        g_state = grad_state.to(cdt)
        if entry is None:  # |scale| too small to divide by: torch products over the tokens
            _state_terms(dk, dv, k, v, g_state, lg, cu64)
        else:
            _last_token_terms(dk, dv, k, v, g_state, far, cu64)
        if need_state_grad:  # gamma^(len_s) G[s] where the reversed passes did not carry it
            lens = (cu64[1:] - cu64[:-1]).clamp(0, q.shape[2]).to(cdt)
            to_end = torch.exp(lg[None, :] * lens[:, None])
            if entry is not None:
                to_end = torch.where(far[None, :], to_end, 0.0)
            d_s0 = d_s0 + to_end[..., None, None] * g_state
    d_decay = None if sums is None else sums.total(partials, log_decay.kernel_arg()[0])
    return dq, dk, dv, d_s0, d_decay
