r"""Gradients for every method: one ``torch.autograd.Function`` and an explicit chunked backward.

The forward runs whichever method was asked for (its CUDA kernel or its torch path) through
:func:`rtkernels.methods.run_method`, with no autograd graph and the call's ``fp32_precision``
(carried in ``Call``), and keeps q, k, v, the initial state and the per-head log-decay. The
backward does not depend on the method; :func:`backward_impl` picks it per call from
:data:`BACKWARD_IMPLS` by the inputs:

- inputs the ``chunk`` CUDA kernel takes (CUDA, fp16/bf16, Dk and Dv <= 256):
  :func:`rtkernels.kernel_backward.kernel_backward`, three passes of the forward kernel (two of
  them on the reversed sequence) plus the final-state terms, and for a trainable decay one CUDA
  kernel for dlog(gamma) (:func:`rtkernels.decay_grad.kernel_log_decay_grad`: the same number by
  forward-mode differentiation, W = dS/dlog(gamma) carried with the state);
- everything else (the CPU, fp32 -- whose forward may run the fp32 chunk kernel --, fp64, larger
  heads): :func:`torch_backward`, the chunked algorithm below in torch operations, recomputing
  the forward states chunk by chunk.

Math (per batch and head; Dk x Dv states; ``do_i = scale * dL/do_i``; ``G = dL/dS_N`` the incoming
gradient of the returned final state, zero when it is not returned or not used)::

    forward     S_i = gamma S_{i-1} + k_i^T v_i   (S_{-1} = S_0),   o_i = scale q_i S_i,   S_N = S_{N-1}
    adjoint     U_i = dL/dS_i = gamma U_{i+1} + q_i^T do_i,          U_{N-1} = G + q_{N-1}^T do_{N-1}
    gradients   dq_i = do_i S_i^T     dk_i = v_i U_i^T     dv_i = k_i U_i     dS_0 = gamma U_0
                dlog(gamma) = sum_i <U_i, gamma S_{i-1}>              (<A, B> = sum_ab A_ab B_ab)

The last line is the chain rule through S_i = exp(log gamma) S_{i-1} + ...: every step's decay is
the same parameter. The reverse recursion of U has the shape of the forward recursion, so it is
computed in the same chunked, numerically safe form (docs/design.md): only non-negative powers of
gamma. Chunk c holds rows t = 0 .. L-1 (L = C, the last chunk: what is left); with S the forward
state entering the chunk (recomputed: a scan over the chunks' own states) and D the adjoint
arriving from the right (D = G for the last chunk, and D_{c-1} = gamma^L D_c + sum_s gamma^(s+1)
q_s^T do_s, a reverse scan that ends in dS_0 = D_{-1}):

    S_t = gamma^(t+1) S + sum_{s <= t} gamma^(t-s) k_s^T v_s
    U_t = gamma^(L-1-t) D + sum_{s >= t} gamma^(s-t) q_s^T do_s

so that, with A = (Q K^T) ⊙ M and dA = (dO V^T) ⊙ M for the chunk's causal mask M[t, s] =
gamma^(t-s) (s <= t, exactly 0 above the diagonal),

    dQ = dA K   + gamma^(t+1) dO S^T                (inter term: ``inter_chunk(dO, S^T)``)
    dK = dA^T Q + gamma^(L-1-t) V D^T
    dV = A^T dO + gamma^(L-1-t) K D

and, expanding <U_t, gamma S_{t-1}> into its four cross terms and counting for each pair of
tokens how many t lie between them (a weight <= C, never a power of gamma^-1),

    dlog(gamma) = sum over chunks of   L gamma^L <D, S>
                                     + sum_s (L-1-s) gamma^(L-1-s) k_s D v_s^T
                                     + sum_t (t+1) gamma^(t+1) q_t S do_t^T
                                     + sum_{s < t} (t-s) gamma^(t-s) (q_t . k_s)(do_t . v_s)

(the second and third are ``(L-1-s) v_s . dV_inter_s`` and ``(t+1) q_t . dQ_inter_t``; the last
is ``sum((t-s) A ⊙ (dO V^T))``). No term cancels against another, so gamma -> 0 gives a
gradient of the size of gamma, accurate to the last bits, and gamma = 1 is an ordinary value.
``decay`` given as factors gets ``dL/dgamma = dlog(gamma) / gamma``, ``decay_rate`` gets
``dL/dr = -dlog(gamma)`` (log(gamma) is clamped at ``LOG_DECAY_MIN`` as in the forward, so a rate
beyond 1e4 gets a zero gradient, the gradient of the clamped operator). A CUDA decay tensor is
the Function's input itself and the backward applies the chain rule (the kernel backward in the
launch that sums the decay gradient; elsewhere :meth:`~rtkernels.decay.LogDecay.source_grad`), so
the forward runs no operation for it; a CPU tensor goes through the differentiable ``log``/``neg``
of :func:`track_decay`.

:func:`torch_backward`: work O(N C (Dk + Dv) + N Dk Dv), like the forward. Memory: the saved q,
k, v (input dtype) and initial state; inside the backward O(N (Dk + Dv + C)) for the chunked
tensors and their gradients plus O((N / C) Dk Dv) for the states entering each chunk (forward and
reverse); no per-token state is ever stored. Everything is accumulated in float32 (float64 for
float64 inputs); the gradients come back in the dtypes of their inputs.

NaN: a NaN in q, k or v gives NaN in exactly the gradient entries whose sum reaches it (under a
finite incoming gradient): q_i[c] -> dk rows <= i column c, dv rows <= i, dS_0 row c;
k_j[c] -> dq rows >= j column c, dv row j; v_j[c] -> dq rows >= j, dk row j; and the decay
gradient. Everything else stays finite (the dense products keep non-finite rows out, as in the
forward: :func:`~rtkernels.methods._torch_common.causal_apply`).

Both implementations follow these NaN rules (the kernel backward through the forward kernel's
own NaN handling in each of its passes; its dlog(gamma) kernel keeps every NaN of a head in that
head's sum).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import torch
from torch.autograd.function import once_differentiable

from .decay import LOG_DECAY_MIN, LogDecay
from .methods import run_method
from .methods._torch_common import (causal_apply, causal_mask, chunk_end_decays, decay_powers, inter_chunk,
                                    scan_chunks, to_chunks)
from .jit.dtypes import compute_dtype

__all__ = ["Grads", "BackwardImpl", "BACKWARD_IMPLS", "backward_impl", "torch_backward", "track_decay",
           "needs_grad", "attention_with_grad", "CausalLinearAttentionFunction", "CHUNK", "log_decay_grad",
           "DECAY_GRAD_BYTES", "call_gradients", "Call"]

#: Tokens per chunk of the torch backward.
CHUNK = 64


class Grads(NamedTuple):
    """What a backward implementation returns: ``[B, H, N, D]`` gradients of q, k, v (in the compute
    dtype, float64 for float64 inputs and float32 otherwise, or already in the input dtype, as the
    16-bit outputs of the kernel backward), the ``[B, H, Dk, Dv]`` gradient of the initial state
    (None when not asked for) and the ``[H]`` gradient of log(gamma) (None when not asked for),
    both in the compute dtype. The Function casts each to its input's dtype."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    initial_state: Optional[torch.Tensor]
    log_decay: Optional[torch.Tensor]
    #: ``log_decay`` is already dL/d(the decay source) (:attr:`LogDecay.source`; the chain rule applied
    #: by the implementation) rather than dL/dlog(gamma)
    decay_is_source: bool = False


#: ``(q, k, v, log_decay, scale, initial_state, grad_out, grad_state, need_state_grad,
#: need_decay_grad, fp32_precision) -> Grads``: q, k, v, grad_out as ``[B, H, N, D]`` views in the
#: input dtype (any strides), ``initial_state`` and ``grad_state`` (``[B, H, Dk, Dv]``) may be
#: None; ``fp32_precision`` ("exact" or "tf32") is the forward's float32 kernel mode, which a
#: backward running float32 kernels uses too.
BackwardImpl = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, LogDecay, float, Optional[torch.Tensor],
                         torch.Tensor, Optional[torch.Tensor], bool, bool, str], Grads]


class _Chunked(NamedTuple):
    """The chunked tensors both backward computations share (compute dtype, chunks of CHUNK rows):
    ``[B, H, nc, C, D]`` q, k, v and do = scale * grad_out; the decays of
    :func:`~rtkernels.methods._torch_common.chunk_end_decays`; ``s_in`` the forward states entering
    each chunk and ``d_in`` the adjoints arriving from its right (``[B, H, nc, Dk, Dv]``); ``d_initial``
    = dL/dS_0 = D_{-1}; the products ``scores`` = A, ``dp`` = dO V^T, the inter terms
    ``dq_inter`` = gamma^(t+1) dO S^T and ``dv_inter`` = gamma^(L-1-t) K D."""

    qc: torch.Tensor
    kc: torch.Tensor
    vc: torch.Tensor
    doc: torch.Tensor
    to_end: torch.Tensor
    carry: torch.Tensor
    exponent: torch.Tensor
    s_in: torch.Tensor
    d_in: torch.Tensor
    d_initial: torch.Tensor
    scores: torch.Tensor
    dp: torch.Tensor
    dq_inter: torch.Tensor
    dv_inter: torch.Tensor


def _chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lg: torch.Tensor, scale: float,
             initial_state: Optional[torch.Tensor], grad_out: torch.Tensor,
             grad_state: Optional[torch.Tensor]) -> _Chunked:
    """Chunk the inputs, recompute the states S entering each chunk, scan the adjoints D back from
    the right, and form the products the gradients and dlog(gamma) share (module docstring).
    ``lg``: ``[H]`` log(gamma) in the compute dtype. Work O(N C (Dk + Dv) + N Dk Dv); memory
    O(N (Dk + Dv + C) + (N / C) Dk Dv) in the compute dtype."""
    cdt = lg.dtype
    b, h, n, dk = q.shape
    dv = v.shape[-1]
    qc, kc, vc = (to_chunks(x.to(cdt), CHUNK) for x in (q, k, v))      # [B, H, nc, C, D]
    doc = to_chunks(grad_out.to(cdt) * scale, CHUNK)
    to_end, carry, exponent = chunk_end_decays(lg, n, CHUNK)

    def state_or_zero(s: Optional[torch.Tensor]) -> torch.Tensor:
        return torch.zeros(b, h, dk, dv, dtype=cdt, device=q.device) if s is None else s.to(cdt)

    # forward states entering each chunk, recomputed; adjoints arriving from the right of each chunk
    own = (kc * to_end).transpose(-1, -2) @ vc                          # sum_s gamma^(L-1-s) k_s^T v_s
    s_in, _ = scan_chunks(state_or_zero(initial_state), own, carry)
    back = (qc * decay_powers(lg, CHUNK, start=1, ndim=5)).transpose(-1, -2) @ doc  # sum_s gamma^(s+1) q_s^T do_s
    d_in, d_initial = scan_chunks(state_or_zero(grad_state), back, carry, reverse=True)
    scores = causal_mask(qc @ kc.transpose(-1, -2), lg)                # A
    dp = doc @ vc.transpose(-1, -2)                                    # dO V^T
    dq_inter = inter_chunk(doc, s_in.transpose(-1, -2), lg)
    dv_inter = to_end * (kc @ d_in)
    return _Chunked(qc, kc, vc, doc, to_end, carry, exponent, s_in, d_in, d_initial, scores, dp, dq_inter,
                    dv_inter)


def _log_decay_grad(c: _Chunked) -> torch.Tensor:
    """The ``[H]`` dlog(gamma) of the module docstring from the shared chunked tensors: four sums of
    products of non-negative powers of gamma with non-negative weights (no cancellation)."""
    cdt = c.qc.dtype
    chunk = c.qc.shape[3]
    t = torch.arange(chunk, device=c.qc.device)
    dist = (t[:, None] - t[None, :]).clamp(min=0).to(cdt)               # t - s below the diagonal
    lengths = (c.exponent[:, 0] + 1).to(cdt)                            # L per chunk
    per_chunk = ((c.d_in * c.s_in).sum((-1, -2)) * (lengths * c.carry[..., 0, 0])             # L gamma^L <D, S>
                 + ((c.vc * c.dv_inter).sum(-1) * c.exponent.to(cdt)).sum(-1)                 # (L-1-s) v_s.dV_inter
                 + ((c.qc * c.dq_inter).sum(-1) * (t + 1).to(cdt)).sum(-1)                    # (t+1) q_t.dQ_inter
                 + (c.scores * c.dp * dist).sum((-1, -2)))                                    # (t-s) A ⊙ dO V^T
    return per_chunk.sum(dim=(0, 2))


#: Temporaries of one pass of :func:`log_decay_grad` (bytes): more (batch, head) pairs are split
#: into passes over batch and head ranges (at least one pair a pass).
DECAY_GRAD_BYTES = 1 << 30


def log_decay_grad(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: LogDecay, scale: float,
                   initial_state: Optional[torch.Tensor], grad_out: torch.Tensor,
                   grad_state: Optional[torch.Tensor]) -> torch.Tensor:
    """dL/dlog(gamma) alone, ``[H]`` in the compute dtype, by the chunked four-term formula of the
    module docstring (the one :func:`torch_backward` uses; arguments as a :data:`BackwardImpl`'s).

    For a backward whose dq, dk, dv come from elsewhere: it never forms dq, dk or dv, and its
    fp32/fp64 temporaries (O(N (Dk + Dv + C) + (N / C) Dk Dv) per (batch, head)) are bounded by
    :data:`DECAY_GRAD_BYTES` by running over ranges of batches and heads. Work as the torch backward's.
    The kernel backward uses it where its passes do not run the chunk kernel (on the kernel path a
    CUDA kernel computes the same number: :func:`rtkernels.decay_grad.kernel_log_decay_grad`).
    """
    cdt = compute_dtype(q.dtype)
    b, h, n, dk = q.shape
    dv = v.shape[-1]
    lg = log_decay.tensor(cdt)
    nc = -(-n // CHUNK)
    # per (batch, head): about four [N, Dk], [N, Dv] and [N, C] tensors and eight [nc, Dk, Dv] ones
    per_pair = 4 * (nc * CHUNK * (dk + dv + CHUNK) + 2 * nc * dk * dv) * cdt.itemsize
    heads = max(1, min(h, DECAY_GRAD_BYTES // per_pair))
    batches = max(1, DECAY_GRAD_BYTES // (per_pair * h)) if heads == h else 1
    out = torch.zeros(h, dtype=cdt, device=q.device)
    for b0 in range(0, b, batches):
        for h0 in range(0, h, heads):
            bs, hs = slice(b0, b0 + batches), slice(h0, h0 + heads)

            def part(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
                return None if x is None else x[bs, hs]

            out[hs] += _log_decay_grad(_chunked(part(q), part(k), part(v), lg[hs], scale, part(initial_state),
                                                part(grad_out), part(grad_state)))
    return out


def torch_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: LogDecay, scale: float,
                   initial_state: Optional[torch.Tensor], grad_out: torch.Tensor,
                   grad_state: Optional[torch.Tensor], need_state_grad: bool, need_decay_grad: bool,
                   fp32_precision: str = "exact") -> Grads:
    """The chunked backward of the module docstring in torch operations (any device and dtype;
    ``fp32_precision`` does not concern it)."""
    cdt = compute_dtype(q.dtype)
    b, h, n, _ = q.shape
    lg = log_decay.tensor(cdt)
    c = _chunked(q, k, v, lg, scale, initial_state, grad_out, grad_state)
    dscores = causal_mask(c.dp, lg)                                    # dA
    dq = causal_apply(dscores, c.kc) + c.dq_inter
    dk = causal_apply(dscores.transpose(-1, -2), c.qc, upper=True) + c.to_end * (c.vc @ c.d_in.transpose(-1, -2))
    dvv = causal_apply(c.scores.transpose(-1, -2), c.doc, upper=True) + c.dv_inter

    def unchunk(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(b, h, -1, x.shape[-1])[:, :, :n]

    return Grads(unchunk(dq), unchunk(dk), unchunk(dvv), c.d_initial if need_state_grad else None,
                 _log_decay_grad(c) if need_decay_grad else None)


#: ``(supports(q, v) -> bool, implementation)`` pairs, asked in order; the first that supports the
#: inputs computes the backward. The torch implementation, last, takes everything;
#: :mod:`rtkernels.kernel_backward` puts the chunk-kernel backward in front of it when the package is
#: imported (``BACKWARD_IMPLS.insert(0, (supports, fn))``).
BACKWARD_IMPLS: list[tuple[Callable[[torch.Tensor, torch.Tensor], bool], BackwardImpl]] = [
    (lambda q, v: True, torch_backward),
]


def backward_impl(q: torch.Tensor, v: torch.Tensor) -> BackwardImpl:
    """The backward implementation for inputs like ``q`` and ``v`` (device, dtype, head sizes)."""
    return next(fn for supports, fn in BACKWARD_IMPLS if supports(q, v))


class Call:
    """The non-tensor arguments of one call: the method, the decay, scale, layout (``bnhd``), the
    state flag, the float32 mode of a ``chunk`` kernel forward ("exact" or "tf32", ignored
    elsewhere) and a planned kernel launch for the forward (the cached call's), else None
    (``method`` runs). A plain slotted class: one is built per call with autograd history, and a
    frozen dataclass's ``__init__`` costs a microsecond more."""

    __slots__ = ("method", "log_decay", "scale", "bnhd", "return_state", "fp32_precision", "launcher")

    def __init__(self, method: str, log_decay: LogDecay, scale: float, bnhd: bool, return_state: bool,
                 fp32_precision: str = "exact", launcher: Any = None):
        self.method, self.log_decay, self.scale, self.bnhd = method, log_decay, scale, bnhd
        self.return_state, self.fp32_precision, self.launcher = return_state, fp32_precision, launcher


class CausalLinearAttentionFunction(torch.autograd.Function):
    """``(call, q, k, v, log_decay_source, initial_state, out) -> out`` or ``(out, final_state)``.

    q, k, v and the output are in the caller's layout (``call.bnhd``); ``out`` None: the forward
    allocates the output (contiguous in that layout, the cheaper call), else ``out`` is the empty
    output, filled in place, returned and marked dirty. The ``[B, H, N, D]`` views are taken inside, where autograd
    does not record them (a recorded view of a tensor that requires grad costs microseconds of
    host time per call). ``log_decay_source`` is :attr:`LogDecay.source` or None. Gradients are not
    materialised: a returned state the loss does not use reaches the backward as None (no G terms),
    an unused output as zeros. Not twice
    differentiable.
    """

    @staticmethod
    def forward(ctx, call: Call, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                log_decay_source: Optional[torch.Tensor], initial_state: Optional[torch.Tensor],
                out: Optional[torch.Tensor]):
        ctx.save_for_backward(q, k, v, initial_state)
        ctx.call = call
        ctx.set_materialize_grads(False)  # a returned state the loss does not use adds no G terms
        ctx.source_meta = None if log_decay_source is None else (log_decay_source.device, log_decay_source.dtype)
        if out is None:
            out = torch.empty_like(v, memory_format=torch.contiguous_format)
        else:  # the caller's tensor, written in place (an input autograd must version)
            ctx.mark_dirty(out)
        ctx.forward_states = None
        if call.launcher is not None:  # planned on these strides, any layout (it reads the pointers); a CUDA
            if getattr(call.launcher, "fold", None) is None:  # decay tensor as it is
                state = call.launcher(q, k, v, out, initial_state, call.log_decay.raw)
            else:  # split with a states pass: its (slots, fold) serve the backward's dq pass too
                keep: list = []
                state = call.launcher(q, k, v, out, initial_state, call.log_decay.raw, keep=keep)
                ctx.forward_states = keep[0] if keep else None
        else:
            out_view = out
            if call.bnhd:
                q, k, v, out_view = (t.transpose(1, 2) for t in (q, k, v, out))
            state = run_method(call.method, q, k, v, call.log_decay, call.scale, out_view, initial_state,
                               call.return_state, fp32_precision=call.fp32_precision)
        return (out, state) if call.return_state else out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor, grad_state: Optional[torch.Tensor] = None):
        q, k, v, s0 = ctx.saved_tensors
        call = ctx.call
        if grad_out is None:  # only the returned state is used
            grad_out = torch.zeros_like(v)
        if call.bnhd:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        _, *needs, _ = ctx.needs_input_grad
        dq, dk, dv, d_decay, d_s0 = call_gradients(call, q, k, v, s0, grad_out, grad_state, needs, ctx.source_meta,
                                                   ctx.forward_states)
        if call.bnhd:
            dq, dk, dv = (None if d is None else d.transpose(1, 2) for d in (dq, dk, dv))
        return None, dq, dk, dv, d_decay, d_s0, None


def call_gradients(call: Call, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   initial_state: Optional[torch.Tensor], grad_out: torch.Tensor, grad_state: Optional[torch.Tensor],
                   needs: Any, source_meta: Optional[tuple[torch.device, torch.dtype]],
                   forward_states: Optional[tuple] = None) -> tuple:
    """The backward of one call (the Function's, and :mod:`rtkernels.ops`'s backward op):
    ``(dq, dk, dv, d_decay, d_initial_state)``, each None unless its flag in ``needs`` (five bools,
    that order) is set. q, k, v are ``[B, H, N, D]`` views, ``grad_out`` is in the call's layout;
    the gradients come back in the inputs' dtypes (``[B, H, N, D]`` views), ``d_decay`` is dL/d(the
    decay source) on ``source_meta`` = (device, dtype). ``forward_states``: what the forward's
    split launch kept for the backward (its states-pass slots), for an implementation that takes
    them (``takes_forward_states``)."""
    need_q, need_k, need_v, need_decay, need_s0 = needs
    g = grad_out.transpose(1, 2) if call.bnhd else grad_out
    impl = backward_impl(q, v)
    extra = {"forward_states": forward_states} if forward_states is not None and getattr(
        impl, "takes_forward_states", False) else {}
    grads = impl(q, k, v, call.log_decay, call.scale, initial_state, g, grad_state, need_s0, need_decay,
                 call.fp32_precision, **extra)
    d_decay = None
    if need_decay:
        d_decay = grads.log_decay if grads.decay_is_source else call.log_decay.source_grad(grads.log_decay)
        d_decay = _as_dtype(d_decay, source_meta[1], source_meta[0])
    return (_as_dtype(grads.q, q.dtype) if need_q else None,
            _as_dtype(grads.k, k.dtype) if need_k else None,
            _as_dtype(grads.v, v.dtype) if need_v else None,
            d_decay,
            _as_dtype(grads.initial_state, initial_state.dtype) if need_s0 else None)


def _as_dtype(x: torch.Tensor, dtype: torch.dtype, device: Optional[torch.device] = None) -> torch.Tensor:
    """``x.to(dtype)`` (on ``device`` where given), skipped where it would return ``x`` (a no-op
    ``to`` costs microseconds of the backward's host time)."""
    if x.dtype == dtype and (device is None or x.device == device):
        return x
    return x.to(dtype) if device is None else x.to(device, dtype)


def track_decay(log_decay: LogDecay, decay: torch.Tensor, is_rate: bool) -> LogDecay:
    """Give ``log_decay`` (already checked, computed from ``decay.detach()``) its differentiable
    source: log(gamma) = log(decay) for factors, -decay for rates, in float64 on the decay's device,
    clamped like the forward's values."""
    x = decay.to(torch.float64)
    log_decay.source = (-x if is_rate else torch.log(x)).clamp(min=LOG_DECAY_MIN)
    return log_decay


def needs_grad(kind: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               initial_state: Optional[torch.Tensor], log_decay: LogDecay) -> bool:
    """Whether the call must go through :class:`CausalLinearAttentionFunction`: grad mode is on and
    q, k, v, ``initial_state`` or the decay tensor requires grad. CuPy inputs give CuPy outputs,
    which carry no gradient: a torch tensor that requires grad next to them is a ``TypeError``
    (never a silent detach)."""
    if not torch.is_grad_enabled():
        return False
    if not (q.requires_grad or k.requires_grad or v.requires_grad or log_decay.source is not None
            or (initial_state is not None and initial_state.requires_grad)):
        return False
    if kind != "torch":  # CuPy arrays or PyCUDA GPUArrays
        which = [n for n, t in (("initial_state", initial_state), ("the decay tensor", log_decay.source))
                 if t is not None and t.requires_grad]
        raise TypeError(f"{' and '.join(which)} requires grad, but q, k and v are CUDA arrays ({kind}) and the "
                        f"output is one too, which carries no gradient; pass torch tensors for q, k and v, "
                        f"or detach it")
    return True


def _direct_apply(fn: type) -> Callable[..., Any]:
    """``fn.apply`` without torch's Python wrapper around it, where this torch has the C entry
    point: the wrapper looks for a ``setup_context`` and unwraps dead functorch wrappers from every
    argument, a few microseconds of each call with autograd history. Under a functorch transform,
    or in a torch without the entry point, ``fn.apply`` itself; the tensors that may be dead
    wrappers (no storage check has seen them: the decay source and the initial state) are
    unwrapped here."""
    base = getattr(torch._C, "_FunctionBase", None)
    raw = None if base is None else base.__dict__.get("apply")
    unwrap = getattr(getattr(torch._C, "_functorch", None), "unwrap_if_dead", None)
    if raw is None or unwrap is None or "setup_context" in fn.__dict__:
        return fn.apply
    bound = raw.__get__(None, fn)
    transforms_active = torch._C._are_functorch_transforms_active

    def apply(call: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, source: Optional[torch.Tensor],
              s0: Optional[torch.Tensor], out: Optional[torch.Tensor]) -> Any:
        if transforms_active():
            return fn.apply(call, q, k, v, source, s0, out)
        return bound(call, q, k, v, source if source is None else unwrap(source), s0 if s0 is None else unwrap(s0),
                     out)

    return apply


_apply_attention = _direct_apply(CausalLinearAttentionFunction)


def attention_with_grad(method: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: LogDecay,
                        scale: float, out: Optional[torch.Tensor], layout: str, initial_state: Optional[torch.Tensor],
                        return_state: bool, fp32_precision: str = "exact", launcher: Any = None
                        ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Run ``method`` (a name of ``METHODS``) on q, k, v in ``layout`` with autograd history:
    ``(out, final_state or None)``. ``out``: the empty output in ``layout``, filled in place, or
    None: a new output, contiguous in ``layout`` (the cheaper call: autograd does not version an
    input written in place). ``fp32_precision`` is the forward's float32 mode, as for
    :func:`rtkernels.methods.run_method`; ``launcher``: a planned kernel launch of ``method`` for
    these inputs and a contiguous output (the forward runs it)."""
    call = Call(method, log_decay, scale, layout == "bnhd", return_state, fp32_precision, launcher)
    res = _apply_attention(call, q, k, v, log_decay.source, initial_state, out)
    return res if return_state else (res, None)
