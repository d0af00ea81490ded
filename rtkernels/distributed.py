r"""Context parallel: one sequence split across the ranks of a ``torch.distributed`` group.

Rank r of a group of W ranks holds the contiguous piece of n_r tokens that starts at
``P_r = n_0 + ... + n_{r-1}`` (pieces in rank order; any lengths, 0 included). Per batch and head,
with ``C_s`` the state piece s adds on its own,

    C_s = sum_{t in piece s} gamma^(P_{s+1} - 1 - t) k_t^T v_t      (+ gamma^(n_0) S_init for s = 0)
    E_r = sum_{s < r} gamma^(P_r - P_{s+1}) C_s                      (E_0 = S_init, or zeros)
    S_N = sum_s gamma^(N - P_{s+1}) C_s                              (the whole sequence's final state)

since the state recurrence composes associatively: a piece maps its entering state E to
``gamma^n E + C``. The output of piece r is the single-device call on that piece from E_r,
``causal_linear_attention(q_r, k_r, v_r, initial_state=E_r)``.

Forward, on every rank: (1) C_r by a states-only pass (O(n Dk Dv): the chunk kernel's states-only
mode and segment scan where the kernel runs and splits the piece, reading k and v once; elsewhere
block-wise batched matmuls);
(2) one all-gather of the ``[B, H, Dk, Dv]`` states C (fp32; fp64 for fp64 inputs); E_r and S_N
from the gathered states with decay powers formed on the device; (3) one fused pass of
:func:`rtkernels.causal_linear_attention` from E_r. Backward (``D_r = dL/dE_r`` and ``G_r =
dL/dC_r``): (1) D_r = scale sum_t gamma^(t+1) q_t^T do_t by a states-only pass over the reversed
piece (q and do read once; the chunk kernel where it runs, else batched matmuls); (2) one
all-gather of D (and of the gradient of the returned S_N); ``G_r = sum_{rho > r} gamma^(P_rho -
P_{r+1}) D_rho + gamma^(N - P_{r+1}) sum_rho dL/dS_N``; (3) the library's backward of the fused
pass with G_r as the gradient of its final state ``gamma^(n_r) E_r + C_r``: dq, dk, dv with the
G_r terms dk_t += gamma^(P_{r+1}-1-t) v_t G_r^T, dv_t += gamma^(P_{r+1}-1-t) k_t G_r (which the
library's reversed passes take as their initial state, at no extra pass), and the piece's
dlog(gamma) (less n_r gamma^(n_r) <G_r, E_r> on ranks r > 0, where E_r is not inside C_r). It is
the forward in reverse: one small exchange between two O(n) passes.

Why a states-only pass and a fused pass from E_r, rather than the fused pass from a zero state
(which returns C_r for free) followed by adding ``scale gamma^(t+1) q_t E_r`` to the output: both
add O(n Dk Dv) matmuls, but the correction reads q and re-writes the whole output (its backward
adds a second dq pass and an E_r-gradient pass, and the library's backward must then also take
the gradient of C_r, in fp32 products), and it rounds a 16-bit output twice; the states-only
pass only reads k and v, the fused pass writes the output once. Counting HBM traffic in units of
one 16-bit ``[B, H, n, D]`` tensor: 2 extra units forward (k, v) and 2 backward (q, do for D_r),
against about 5 and at least 25 with the correction. (Until session 20 the backward took D_r from
the fused pass's backward and added the G_r terms by block-wise matmuls afterwards, about 14 extra
units: on two H100s at (1, 32, 262144, 128) bf16 that made forward + backward 0.91x one GPU.)

Gradients: q, k, v of every rank, ``initial_state`` (rank 0) and a decay tensor that requires
grad. q, k, v and ``initial_state`` get the gradient of the sum of every rank's loss (the
collectives carry the cross-rank terms). The decay is one parameter replicated on every rank
(as the model's weights are): each rank's decay tensor gets that rank's share of dL/dgamma, and
the shares summed over the group (what data-parallel gradient reduction does for every weight)
are the whole sequence's gradient.

Costs per call and rank (S = B H Dk Dv elements of the state, 4 bytes; 8 for fp64): forward: one
all-gather of S (W S received), plus with ``lengths=None`` one all-gather of 13 integers;
backward: one all-gather of S, or 2 S with ``return_state``. Extra work over the single-device
call on the piece: 2 n B H Dk Dv flops forward and 2 n B H Dk Dv backward (the states-only
passes: the chunk kernel on CUDA fp16/bf16/fp32 where it splits the piece, else batched matmuls
on tensor cores for 16-bit inputs, with fp32 results), plus O(W S) for the combines. Extra memory:
O(W S), and where the matmuls run, block temporaries of about :data:`BLOCK_BYTES` (256 MiB).
"""

from __future__ import annotations

import numbers
import struct
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from .api import (DTYPES, _check_fp32_precision, _check_inputs, _check_scale, _check_state, _log_decay,
                  causal_linear_attention)
from .decay import KIND_FACTOR, KIND_RATE, LogDecay
from .jit.dtypes import compute_dtype
from .methods._torch_common import decay_powers
from .methods.chunk.backward import kernel_runs
from .methods.chunk.launch import kernel_final_state

__all__ = ["context_parallel_attention", "BLOCK_BYTES"]

#: Bytes of the block temporaries of the states-only passes: tokens are taken in blocks of at
#: most this many bytes of one ``[B, H, T, max(Dk, Dv)]`` tensor in the compute dtype.
BLOCK_BYTES = 1 << 28

#: What every rank sends in the argument exchange (``lengths=None``), in this order.
_FIELDS = ("status", "tokens", "B", "H", "Dk", "Dv", "dtype", "device", "needs_grad", "return_state", "scale",
           "decay form", "decay value")
_DEVICE_CODES = {"cpu": 0, "cuda": 1}
_bmm_out_dtype = True  # torch.bmm(..., out_dtype=) runs here; cleared the first time it does not


# ----------------------------------------------------------------------------------- the pieces

def _product(a: torch.Tensor, b: torch.Tensor, cdt: torch.dtype) -> torch.Tensor:
    """``a @ b`` for ``[X, m, p] @ [X, p, r]`` accumulated and returned in ``cdt``. Where one operand
    is 16-bit on CUDA, both go to the tensor cores as 16-bit numbers with an fp32 result (the
    other one rounded once); elsewhere both are multiplied in ``cdt``."""
    global _bmm_out_dtype
    low = a.dtype if a.dtype != cdt else b.dtype
    if low != cdt and a.is_cuda and _bmm_out_dtype:
        try:
            return torch.bmm(a.to(low), b.to(low), out_dtype=cdt)
        except torch.cuda.OutOfMemoryError:
            raise
        except (TypeError, NotImplementedError, RuntimeError):  # a torch without out_dtype: fp32 operands
            _bmm_out_dtype = False
    return torch.bmm(a.to(cdt), b.to(cdt))


def _blocks(b: int, h: int, n: int, d: int, cdt: torch.dtype) -> range:
    """Starts of the token blocks of the states-only passes (:data:`BLOCK_BYTES` each)."""
    return range(0, n, max(1, BLOCK_BYTES // max(1, b * h * d * cdt.itemsize)))


def _to_end(lg: torch.Tensor, n: int, a: int, e: int) -> torch.Tensor:
    """gamma^(n-1-t) for the tokens t = a .. e-1 of a piece of n, ``[H, e-a, 1]`` (exponents >= 0)."""
    return decay_powers(lg, e - a, start=n - e, ndim=3).flip(-2)


def _piece_state(k: torch.Tensor, v: torch.Tensor, lg: torch.Tensor, cdt: torch.dtype) -> torch.Tensor:
    """C = sum_t gamma^(n-1-t) k_t^T v_t of ``[B, H, n, D]`` views: ``[B, H, Dk, Dv]`` in ``cdt``."""
    b, h, n, dk = k.shape
    dv = v.shape[-1]
    state = torch.zeros(b * h, dk, dv, dtype=cdt, device=k.device)
    step = _blocks(b, h, n, max(dk, dv), cdt).step
    # 16-bit inputs on CUDA: the weighted keys stay 16-bit (half the traffic of an fp32 copy) for
    # the tensor cores; elsewhere they are formed in the compute dtype
    low = k.dtype if k.is_cuda and k.dtype != cdt else cdt
    for a in range(0, n, step):
        e = min(n, a + step)
        kw = (k[:, :, a:e] * _to_end(lg, n, a, e).to(low)).reshape(b * h, e - a, dk)
        state += _product(kw.transpose(-1, -2), v[:, :, a:e].reshape(b * h, e - a, dv), cdt)
    return state.view(b, h, dk, dv)


def _own_state(k: torch.Tensor, v: torch.Tensor, log_decay: LogDecay, lg: torch.Tensor,
               cdt: torch.dtype, reverse: bool = False) -> torch.Tensor:
    """:func:`_piece_state` (with ``reverse``, of the reversed piece: sum_t gamma^t k_t^T v_t), by
    the chunk kernel where it runs on these views and splits the piece
    (:func:`~rtkernels.methods.chunk.launch.kernel_final_state`: k and v read once, no weighted copy;
    float32 in torch's float32 matmul mode, as the fused pass's default), else by batched matmuls
    (on flipped copies for ``reverse``)."""
    if kernel_runs(k, k, v) and k.stride(-1) == v.stride(-1) == 1:
        state = kernel_final_state(k, v, log_decay, _check_fp32_precision(None), reverse=reverse)
        if state is not None:
            return state.to(cdt)
    return _piece_state(k.flip(2), v.flip(2), lg, cdt) if reverse else _piece_state(k, v, lg, cdt)


def _power(lg: torch.Tensor, m: int) -> torch.Tensor:
    """gamma^m per head (m >= 0, a host integer), ``[1, H, 1, 1]``: formed on the device, no copy."""
    return torch.exp(lg * float(m)).view(1, -1, 1, 1)


def _head_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum over batch, Dk and Dv of a * b: ``[H]``."""
    return (a * b).sum((0, 2, 3))


# -------------------------------------------------------------------------------- the exchange

@dataclass(frozen=True)
class _Plan:
    """What one call decided: the group, the pieces, and the arguments of the fused pass."""

    group: Any
    rank: int
    lengths: tuple[int, ...]
    layout: str
    scale: float
    log_decay: LogDecay           # the checked decay (values only)
    decay_value: Any              # what the fused pass gets as decay or decay_rate (no autograd history)
    is_rate: bool
    return_state: bool
    stage: bool                   # gather through host memory (a backend without CUDA support)

    @property
    def starts(self) -> list[int]:
        """P_0 .. P_W: where each piece starts, and N last."""
        return [sum(self.lengths[:r]) for r in range(len(self.lengths) + 1)]

    def fused_call(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: Any,
                   initial_state: Optional[torch.Tensor], return_state: bool = False) -> Any:
        kw = {"decay_rate": decay} if self.is_rate else {"decay": decay}
        return causal_linear_attention(q, k, v, scale=self.scale, layout=self.layout, initial_state=initial_state,
                                       return_state=return_state, **kw)


def _gather_single(out: torch.Tensor, src: torch.Tensor, group: Any) -> None:
    """All-gather of the 1-D ``src`` into ``out`` (W times as long, in rank order)."""
    # all_gather_into_tensor is named all_gather_single from torch 2.13 (the old name warns there)
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, src, group=group)


def _gather(x: torch.Tensor, plan: _Plan) -> torch.Tensor:
    """All-gather of ``x`` (same shape on every rank): ``[W, *x.shape]`` on x's device."""
    src = x.reshape(-1)  # flat: gloo takes only the concatenated form of the output
    if plan.stage:
        src = src.cpu()
    out = torch.empty(len(plan.lengths) * src.numel(), dtype=x.dtype, device=src.device)
    _gather_single(out, src, plan.group)
    out = out.view(len(plan.lengths), *x.shape)
    return out.to(x.device) if plan.stage else out


def _combine(parts: torch.Tensor, lg: torch.Tensor, weights: Sequence[tuple[int, int]]) -> torch.Tensor:
    """sum of gamma^m parts[s] over the ``(s, m)`` pairs; ``parts`` is ``[W, B, H, Dk, Dv]``."""
    total = torch.zeros_like(parts[0])
    for s, m in weights:
        total += _power(lg, m) * parts[s]
    return total


# ----------------------------------------------------------------------------------- the call

@dataclass
class _Saved:
    """What the backward needs: the fused pass's autograd graph and the states."""

    out: torch.Tensor                      # the fused pass's output, with its graph
    final: torch.Tensor                    # its final state gamma^n E_r + C_r, with its graph
    leaves: dict[str, torch.Tensor]        # q, k, v, decay, state (rank 0): the fused pass's inputs that require grad
    q: torch.Tensor                        # [B, H, n, Dk] view (D_r's pass)
    entering: Optional[torch.Tensor]       # E_r in the compute dtype (None: zero)
    parts: Optional[torch.Tensor]          # the gathered C, when the decay needs its gradient


def _bhnd(x: torch.Tensor, layout: str) -> torch.Tensor:
    return x.transpose(1, 2) if layout == "bnhd" else x


def _forward(plan: _Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay_source: Optional[torch.Tensor],
             s_init: Optional[torch.Tensor], track: bool) -> tuple[torch.Tensor, Optional[torch.Tensor],
                                                                    Optional[_Saved]]:
    """Output, final state (with ``return_state``) and, with ``track``, what the backward needs."""
    cdt = compute_dtype(q.dtype)
    lg = plan.log_decay.tensor(cdt)
    kv, vv = _bhnd(k, plan.layout), _bhnd(v, plan.layout)
    starts, r = plan.starts, plan.rank
    own = _own_state(kv, vv, plan.log_decay, lg, cdt)
    s0 = None if s_init is None else s_init.detach().to(cdt)
    if s0 is not None:
        own = own + _power(lg, plan.lengths[0]) * s0
    parts = _gather(own, plan)
    final = _combine(parts, lg, [(s, starts[-1] - starts[s + 1]) for s in range(len(parts))]) \
        if plan.return_state else None
    if r == 0:
        entering = None if s_init is None else s_init.detach()
    else:
        entering = _combine(parts, lg, [(s, starts[r] - starts[s + 1]) for s in range(r)])
    if not track:
        return plan.fused_call(q, k, v, plan.decay_value, entering), final, None
    leaves = {"q": q.detach().requires_grad_(q.requires_grad), "k": k.detach().requires_grad_(k.requires_grad),
              "v": v.detach().requires_grad_(v.requires_grad)}
    decay_arg = plan.decay_value
    if decay_source is not None:
        decay_arg = leaves["decay"] = decay_source.detach().requires_grad_()
    if r == 0 and entering is not None and s_init.requires_grad:  # dS_init: the fused pass's own (ranks r > 0
        leaves["state"] = entering = entering.detach().requires_grad_()  # take D_r from its own pass instead)
    with torch.enable_grad():
        out, fin = plan.fused_call(leaves["q"], leaves["k"], leaves["v"], decay_arg, entering, return_state=True)
    needs = {name: t for name, t in leaves.items() if t.requires_grad}
    saved = _Saved(out, fin, needs, _bhnd(q, plan.layout).detach(),
                   None if entering is None else entering.detach().to(cdt),
                   parts if decay_source is not None else None)
    return out.detach(), final, saved


def _entering_grad(q: torch.Tensor, grad_out: torch.Tensor, plan: _Plan, lg: torch.Tensor,
                   cdt: torch.dtype) -> torch.Tensor:
    """D_r = dL/dE_r through the piece's outputs, scale sum_t gamma^(t+1) q_t^T do_t (``[B, H, n,
    D]`` views), in ``cdt``: the reversed piece's own state of q and do (:func:`_own_state`)."""
    own = _own_state(q, grad_out, plan.log_decay, lg, cdt, reverse=True)
    return own * (plan.scale * torch.exp(lg)).view(1, -1, 1, 1)


class _ContextParallelFunction(torch.autograd.Function):
    """``(plan, q, k, v, decay_source, s_init) -> out`` or ``(out, final_state)``; the backward runs
    the fused pass's backward through its saved graph, one all-gather and the states-only pass's
    backward (module docstring). Not twice differentiable."""

    @staticmethod
    def forward(ctx, plan: _Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                decay_source: Optional[torch.Tensor], s_init: Optional[torch.Tensor]):
        out, final, saved = _forward(plan, q, k, v, decay_source, s_init, track=True)
        ctx.plan, ctx.saved = plan, saved
        ctx.decay_meta = None if decay_source is None else (decay_source.device, decay_source.dtype)
        return (out, final) if plan.return_state else out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor, grad_final: Optional[torch.Tensor] = None):
        plan: _Plan = ctx.plan
        saved: _Saved = ctx.saved
        if saved is None:
            raise RuntimeError("context_parallel_attention: the backward ran already for this call (its graph "
                               "is freed after one backward)")
        ctx.saved = None
        qv = saved.q
        cdt = compute_dtype(qv.dtype)
        lg = plan.log_decay.tensor(cdt)
        starts, r, lengths = plan.starts, plan.rank, plan.lengths
        b, h, _, dk = qv.shape
        dv = saved.final.shape[-1]
        zero = torch.zeros(b, h, dk, dv, dtype=cdt, device=qv.device)

        def value(x: Optional[torch.Tensor]) -> torch.Tensor:
            return zero if x is None else x.to(cdt)

        # D_r, ahead of the fused pass's backward (rank 0 sends zeros: no rank reads its D)
        d_enter = _entering_grad(qv, _bhnd(grad_out, plan.layout), plan, lg, cdt) if r > 0 else zero
        payload = torch.stack([d_enter, value(grad_final)]) if plan.return_state else d_enter[None]
        rows = _gather(payload, plan)                                # [W, 1 or 2, B, H, Dk, Dv]
        later = [(rho, starts[rho] - starts[r + 1]) for rho in range(r + 1, len(lengths))]
        g = _combine(rows[:, 0], lg, later)                           # G_r = dL/dC_r
        if plan.return_state:
            g += _power(lg, starts[-1] - starts[r + 1]) * rows[:, 1].sum(0)
        # the fused pass's backward, G_r as the gradient of its final state gamma^n E_r + C_r
        names = list(saved.leaves)
        got = dict(zip(names, torch.autograd.grad((saved.out, saved.final), [saved.leaves[x] for x in names],
                                                  (grad_out, g.to(saved.final.dtype)), allow_unused=True)))

        def grad_of(name: str) -> Optional[torch.Tensor]:
            if name not in saved.leaves:
                return None
            d = got.get(name)
            return torch.zeros_like(saved.leaves[name]) if d is None else d  # None: unreached

        dq, dk_, dv_ = (grad_of(name) for name in ("q", "k", "v"))
        d_init = None
        if r == 0 and "state" in saved.leaves:  # dS_init = D_0 + gamma^(n_0) G_0, from the fused pass
            d_init = grad_of("state")
        d_decay = None
        if "decay" in saved.leaves:
            # the combine's own powers: E_r with D_r and the returned state with its gradient; on
            # ranks r > 0 the fused pass's n gamma^n <G_r, E_r> comes off (E_r is not inside C_r,
            # while on rank 0 gamma^(n_0) S_init is)
            d_log = torch.zeros(h, dtype=cdt, device=qv.device)
            parts = saved.parts
            for s in range(r):
                m = starts[r] - starts[s + 1]
                d_log += m * _power(lg, m).view(-1) * _head_dot(d_enter, parts[s])
            if plan.return_state and grad_final is not None:
                for s in range(len(lengths)):
                    m = starts[-1] - starts[s + 1]
                    d_log += m * _power(lg, m).view(-1) * _head_dot(grad_final.to(cdt), parts[s])
            if r > 0 and saved.entering is not None:
                d_log -= lengths[r] * _power(lg, lengths[r]).view(-1) * _head_dot(g, saved.entering)
            source = saved.leaves["decay"]
            chain = LogDecay(source.device, raw=source.detach(), kind=KIND_RATE if plan.is_rate else KIND_FACTOR)
            chain.source_kind = chain.kind
            d_decay = chain.source_grad(d_log.to(source.device)).to(*ctx.decay_meta)
            if got.get("decay") is not None:
                d_decay = d_decay + got["decay"]
        return None, dq, dk_, dv_, d_decay, d_init


# -------------------------------------------------------------------------------- the checks

def _fmt(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _group_of(group: Any) -> tuple[Any, int, int]:
    """(group, rank, world size); RuntimeError without an initialized default group."""
    if not dist.is_available():
        raise RuntimeError("context_parallel_attention needs torch.distributed, which this torch build lacks")
    if not dist.is_initialized():
        raise RuntimeError("context_parallel_attention needs an initialized torch.distributed process group: call "
                           "torch.distributed.init_process_group (e.g. under torchrun) first")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be None (the default group) or a torch.distributed.ProcessGroup, "
                        f"got {type(group).__name__}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("group must contain this process (dist.get_rank(group) is -1 here)")
    return group, rank, dist.get_world_size(group)


def _pure_nccl(group: Any) -> bool:
    return dist.get_backend(group) == "nccl"


@dataclass
class _Local:
    """This rank's checked arguments."""

    q: torch.Tensor                        # [B, H, n, Dk] view (for the shapes)
    v: torch.Tensor
    log_decay: LogDecay
    decay_value: Any
    decay_source: Optional[torch.Tensor]
    is_rate: bool
    s_init: Optional[torch.Tensor]
    scale: float
    return_state: bool
    needs_grad: bool
    decay_form: int
    decay_bits: int


def _check_local(q: Any, k: Any, v: Any, decay: Any, decay_rate: Any, scale: Any, layout: Any,
                 initial_state: Any, return_state: Any, rank: int, group: Any) -> _Local:
    qt, kt, vt, kind = _check_inputs(q, k, v, layout)
    if kind != "torch":
        raise TypeError("q, k and v must be torch tensors for context_parallel_attention (CUDA arrays such as "
                        "CuPy arrays are not taken here)")
    if _pure_nccl(group) and not qt.is_cuda:
        raise ValueError(f"q, k and v must be CUDA tensors for a group with the nccl backend, got {qt.device}; "
                         f"use a gloo group for CPU tensors")
    scale = _check_scale(scale)
    if not isinstance(return_state, (bool, np.bool_)):
        raise TypeError(f"return_state must be a bool, got {type(return_state).__name__}")
    is_rate = decay_rate is not None
    given = decay_rate if is_rate else decay
    source = given if isinstance(given, torch.Tensor) and given.requires_grad and torch.is_grad_enabled() else None
    plain = given.detach() if isinstance(given, torch.Tensor) else given
    log_decay = _log_decay(*(x.detach() if isinstance(x, torch.Tensor) else x for x in (decay, decay_rate)),
                           qt.shape[1], qt.device)
    s_init = _check_state(initial_state, qt, vt)  # checked on every rank; only rank 0's is used
    if rank != 0:
        s_init = None
    needs_grad = torch.is_grad_enabled() and (qt.requires_grad or kt.requires_grad or vt.requires_grad
                                              or source is not None or (s_init is not None and s_init.requires_grad))
    is_number = isinstance(given, numbers.Real)  # else a tensor (or a CUDA array): its values are not compared
    form = 0 if given is None else (3 if is_number else 1) + int(is_rate)
    bits = _float_bits(float(given)) if is_number else 0
    return _Local(qt, vt, log_decay, plain, source, is_rate, s_init, scale, bool(return_state), needs_grad, form,
                  bits)


def _check_lengths(lengths: Any, world: int, rank: int, n: int) -> tuple[int, ...]:
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Sequence):
        raise TypeError(f"lengths must be None or a sequence of {world} ints (the tokens of each rank's piece), "
                        f"got {type(lengths).__name__}")
    if len(lengths) != world:
        raise ValueError(f"lengths must have one entry per rank of the group ({world}), got {len(lengths)}")
    out = []
    for i, x in enumerate(lengths):
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
            raise TypeError(f"lengths[{i}] must be an int, got {type(x).__name__}")
        if x < 0:
            raise ValueError(f"lengths[{i}] must be >= 0, got {x}")
        out.append(int(x))
    if out[rank] != n:
        raise ValueError(f"lengths[{rank}] must be this rank's number of tokens, the N of q ({n}), got {out[rank]}")
    return tuple(out)


def _describe(field: str, value: int) -> str:
    if field == "dtype":
        return _fmt(DTYPES[value])
    if field == "device":
        return {v: k for k, v in _DEVICE_CODES.items()}.get(value, "other")
    if field == "scale":
        return repr(struct.unpack("<d", struct.pack("<q", value))[0])
    if field == "decay form":
        return ("no decay", "a decay tensor", "a decay_rate tensor", "a decay float", "a decay_rate float")[value]
    if field == "decay value":
        return repr(struct.unpack("<d", struct.pack("<q", value))[0])
    return str(bool(value)) if field in ("needs_grad", "return_state") else str(value)


def _exchange_arguments(local: Optional[_Local], error: Optional[BaseException], group: Any, world: int,
                        q: Any) -> tuple[int, ...]:
    """One all-gather of every rank's shapes and settings: the pieces' lengths, after checking that
    the ranks agree (ValueError / TypeError on every rank otherwise, so that none waits forever)."""
    if local is None:
        mine = [1] + [0] * (len(_FIELDS) - 1)
    else:
        b, h, n, dk = local.q.shape
        mine = [0, n, b, h, dk, local.v.shape[3], DTYPES.index(local.q.dtype),
                _DEVICE_CODES.get(local.q.device.type, 2), int(local.needs_grad), int(local.return_state),
                _float_bits(local.scale), local.decay_form, local.decay_bits]
    device = torch.device("cpu")
    if _pure_nccl(group):
        device = q.device if isinstance(q, torch.Tensor) and q.is_cuda else torch.device("cuda",
                                                                                         torch.cuda.current_device())
    sent = torch.tensor(mine, dtype=torch.int64).to(device)
    got = torch.empty(world * len(mine), dtype=torch.int64, device=device)
    _gather_single(got, sent, group)
    rows = got.view(world, -1).tolist()  # the lengths are needed on the host: the one sync of the call
    if error is not None:
        raise error
    failed = [i for i, row in enumerate(rows) if row[0] != 0]
    if failed:
        raise ValueError(f"context_parallel_attention: rank(s) {failed} of the group rejected their arguments "
                         f"(the error is raised there); every rank stops")
    for j, field in enumerate(_FIELDS[2:], start=2):
        if len({row[j] for row in rows}) > 1:
            per_rank = ", ".join(f"rank {i}: {_describe(field, row[j])}" for i, row in enumerate(rows))
            what = {"B": "the batch size B of q", "H": "the number of heads H", "Dk": "the key width Dk of q and k",
                    "Dv": "the value width Dv of v", "dtype": "the dtype of q, k and v",
                    "device": "the device type of q, k and v",
                    "needs_grad": "whether the call records gradients (grad mode on and an input requiring grad)",
                    "return_state": "return_state", "scale": "scale", "decay form": "how the decay is given",
                    "decay value": "the decay value"}[field]
            err = TypeError if field == "dtype" else ValueError
            raise err(f"every rank of the group must pass the same {what}; got {per_rank}")
    return tuple(row[1] for row in rows)


def context_parallel_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: Union[None, float, torch.Tensor] = None, *,
    decay_rate: Union[None, float, torch.Tensor] = None, scale: float = 1.0, group: Any = None,
    layout: str = "bhnd", initial_state: Optional[torch.Tensor] = None, return_state: bool = False,
    lengths: Optional[Sequence[int]] = None,
) -> Any:
    r"""Causal linear attention over one sequence split across the ranks of a process group.

    .. math:: o_i = \text{scale} \sum_{j \le i} \gamma_h^{\,i-j} (q_i \cdot k_j)\, v_j

    over the whole sequence, where rank r holds tokens ``P_r .. P_r + n_r - 1`` (contiguous
    pieces in rank order). Every rank calls this function with its piece; each gets its piece of
    the output. The module docstring has the math, the exchange and the costs.

    Args:
        q, k, v, decay, decay_rate, scale, layout: as for
            :func:`rtkernels.causal_linear_attention`, with this rank's piece (``N = n_r``, which
            may differ between ranks and may be 0). B, H, Dk, Dv, the dtype, the device type,
            ``scale``, the decay and ``return_state`` must be the same on every rank.
        group: the ``torch.distributed`` process group (None: the default group). Its backend
            must take the tensors: NCCL for CUDA tensors (one GPU per rank), gloo for CPU tensors
            (gloo with CUDA tensors works, through host copies).
        initial_state: ``[B, H, Dk, Dv]`` state entering the whole sequence, i.e. rank 0's piece.
            Only rank 0's is used; other ranks may pass the same tensor (it is checked, then
            ignored, and gets no gradient) or None.
        return_state: also return the final state of the whole sequence (every rank gets it).
        lengths: None, or every rank's number of tokens (the same sequence on every rank). None
            costs one all-gather of 13 integers read on the host (one device sync on CUDA), which
            also checks that the ranks agree on the shapes and settings above and lets a rank
            whose arguments are rejected stop the others with an error instead of a hang. Given,
            the call exchanges only the states and never syncs with the host (what a CUDA graph
            needs); the ranks' agreement is then the caller's to keep.

    Returns:
        This rank's output ``[B, H, n_r, Dv]`` (or ``[B, n_r, H, Dv]``) in the input dtype; with
        ``return_state=True`` the pair ``(output, final_state)``, the state being fp32 (fp64 for
        fp64 inputs) and the same on every rank.

    Gradients: for q, k, v, ``initial_state`` (rank 0) and a decay tensor that requires grad. The
    backward runs collectives: every rank must backpropagate through every call (as with any
    collective under autograd), once. Each rank's decay tensor gets its share of dL/dgamma; sum
    the shares over the group for the whole gradient (module docstring).

    Work per rank: that of the single-device call on n_r tokens plus O(n_r B H Dk Dv) (states-only
    passes forward and backward) plus O(W B H Dk Dv); communication O(W B H Dk Dv) per call.

    Raises:
        RuntimeError without an initialized ``torch.distributed``; TypeError / ValueError naming
        the argument for a malformed argument, and (with ``lengths=None``) on every rank when the
        ranks disagree or when one rank's arguments are rejected.
    """
    group, rank, world = _group_of(group)
    local: Optional[_Local] = None
    error: Optional[BaseException] = None
    try:
        local = _check_local(q, k, v, decay, decay_rate, scale, layout, initial_state, return_state, rank, group)
        if lengths is not None:
            lengths = _check_lengths(lengths, world, rank, local.q.shape[2])
    except (TypeError, ValueError) as exc:
        error = exc
    if lengths is None:
        lengths = _exchange_arguments(local, error, group, world, q)
    elif error is not None:
        raise error
    stage = local.q.is_cuda and "nccl" not in dist.get_backend(group)
    plan = _Plan(group, rank, tuple(lengths), layout, local.scale, local.log_decay, local.decay_value, local.is_rate,
                 local.return_state, stage)
    if local.needs_grad:
        return _ContextParallelFunction.apply(plan, q, k, v, local.decay_source, local.s_init)
    out, final, _ = _forward(plan, q, k, v, None, local.s_init, track=False)
    return (out, final) if plan.return_state else out
