r"""The call as ``torch.library`` custom ops, for torch.compile, torch.export, CUDA graphs and torch.func.

``torch.ops.rtkernels.causal_linear_attention`` is :func:`rtkernels.causal_linear_attention`
(``o_i = scale * sum_{j<=i} gamma_h^(i-j) (q_i . k_j) v_j``) as one opaque node of a traced graph;
``torch.ops.rtkernels.causal_linear_attention_backward`` is its backward. Each has a fake
implementation (output shapes, dtypes and strides from the inputs' metadata alone, so tracing
reads no data), the forward has ``register_autograd`` (``setup_context`` saves q, k, v, the decay
tensor and the initial state; the backward is the backward op), and both have a ``vmap`` rule.

The public function routes here by itself while torch.compile or torch.export trace it
(``torch.compiler.is_compiling()``) and when a torch.func transform (vmap, grad) wraps its
tensors; eager calls keep the checks-and-call-cache path. :func:`causal_linear_attention` below
takes the op always (same signature), e.g. to capture the op itself in a CUDA graph.

Inside the op everything is a tensor or a plain scalar (the schema cannot carry a
:class:`~rtkernels.decay.LogDecay`): the decay is ``decay`` (an ``[H]`` tensor, or None) with
``decay_kind`` (:data:`~rtkernels.decay.KIND_FACTOR`: factors gamma, :data:`~rtkernels.decay.KIND_RATE`:
rates r) or a number ``decay_value`` of that kind. The forward's kernel is the eager call itself
(under ``no_grad``), so its results, checks and messages are the eager ones; the backward's is
:func:`rtkernels.autograd.call_gradients`, the Function's backward. Costs are those of the call
(README's methods table) plus, for ``layout="bnhd"``, one copy of each of dq, dk, dv into the
contiguous layout the fake implementation promises.

Differences from the eager call, all from tracing:

- ``fp32_precision=None`` is resolved when the op runs (``torch.get_float32_matmul_precision()``
  cannot be read while tracing), by the forward and by the backward each.
- q, k, v must be torch tensors (no CuPy arrays); a decay tensor is passed to the op as it is
  (a CPU tensor's values are still checked on the host when the op runs).
- Not twice differentiable: differentiating the backward op raises ``RuntimeError``.
- vmap: the vmapped dimension is folded into the batch dimension B (one call), and
  ``torch.autograd`` differentiates through it; a decay tensor batched by vmap raises
  ``NotImplementedError``. torch.func's grad transforms (grad, vjp, jacrev, jvp) raise
  ``NotImplementedError``: torch's custom-op autograd formulas do not reach them.
"""

from __future__ import annotations

import threading
from typing import Any, Optional, Union

import torch
from torch import Tensor
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

from . import api
from .api import (FP32_PRECISIONS, METHOD_NAMES, _check_factor_or_rate, _check_inputs, _check_scale, _check_state,
                  _is_number)
from .autograd import Call, call_gradients
from .decay import KIND_FACTOR, KIND_RATE, LogDecay
from .jit.dtypes import compute_dtype

__all__ = ["causal_linear_attention", "forward_op", "backward_op", "decay_operands", "require_tensors"]

#: Numbers passed to the op as they are, symbolic ones included (dynamo traces a SymFloat as a
#: float); a plain float is checked by the fake implementation, a symbolic one when the op runs.
_PLAIN_NUMBERS = (float, int, torch.SymFloat, torch.SymInt)
_local = threading.local()  # .inside: this thread runs the forward op's kernel (the eager call)


def _check_decay_tensor(decay: Tensor, name: str, h: int) -> None:
    """Metadata checks of a decay tensor (its values are read when the op runs)."""
    if not decay.is_floating_point():
        raise TypeError(f"{name} must have a floating dtype, got {str(decay.dtype).replace('torch.', '')}")
    if tuple(decay.shape) != (h,):
        raise ValueError(f"{name} must be a float or a tensor of shape [H] = [{h}], got shape {tuple(decay.shape)}")


@torch.library.custom_op("rtkernels::causal_linear_attention", mutates_args=())
def forward_op(q: Tensor, k: Tensor, v: Tensor, decay: Optional[Tensor], decay_kind: int,
               decay_value: Optional[float], scale: float, method: str, layout: str,
               initial_state: Optional[Tensor], return_state: bool,
               fp32_precision: Optional[str]) -> tuple[Tensor, Tensor]:
    """``(output, final_state)``; the state is an empty ``[0]`` tensor unless ``return_state``."""
    given = decay if decay is not None else decay_value
    kw = {"decay_rate": given} if decay_kind == KIND_RATE else {"decay": given}
    _local.inside = True
    try:
        with torch.no_grad():  # the op's autograd is register_autograd's, not the eager Function's
            res = api.causal_linear_attention(q, k, v, **kw, scale=scale, method=method, layout=layout,
                                              initial_state=initial_state, return_state=return_state,
                                              fp32_precision=fp32_precision)
    finally:
        _local.inside = False
    if return_state:  # strides as the fake implementation's (a no-op for the contiguous state)
        return res[0], res[1].contiguous()
    return res, torch.empty(0, dtype=compute_dtype(q.dtype), device=q.device)


@forward_op.register_fake
def _forward_fake(q, k, v, decay, decay_kind, decay_value, scale, method, layout, initial_state, return_state,
                  fp32_precision):
    qt, _, vt, _ = _check_inputs(q, k, v, layout)  # the eager call's metadata checks and messages
    if type(scale) is float:
        _check_scale(scale)
    b, h, n, dk = qt.shape
    dv = vt.shape[3]
    name = "decay_rate" if decay_kind == KIND_RATE else "decay"
    if decay is not None:
        _check_decay_tensor(decay, name, h)
    elif type(decay_value) is float:  # a symbolic float is checked when the op runs
        _check_factor_or_rate(decay_value, name, h, q.device)
    _check_state(initial_state, qt, vt)
    if method not in METHOD_NAMES:
        raise ValueError(f"method must be one of {', '.join(repr(m) for m in METHOD_NAMES)}, got {method!r}")
    if fp32_precision is not None and fp32_precision not in FP32_PRECISIONS:
        raise ValueError(f"fp32_precision must be None, 'exact' or 'tf32', got {fp32_precision!r}")
    shape = (b, h, n, dv) if layout == "bhnd" else (b, n, h, dv)
    cdt = compute_dtype(q.dtype)
    state = q.new_empty((b, h, dk, dv) if return_state else (0,), dtype=cdt)
    return q.new_empty(shape), state


def _log_decay(decay: Optional[Tensor], decay_kind: int, decay_value: Optional[float], h: int,
               device: torch.device) -> LogDecay:
    """The backward's LogDecay: a decay tensor is read on q's device and is its own source (the
    backward applies the chain rule to factors or rates, as for an eager CUDA decay tensor)."""
    if decay is not None:
        log_decay = LogDecay(device, raw=decay.detach().to(device), kind=decay_kind)
        log_decay.source_kind = decay_kind
        return log_decay
    if decay_value is not None:
        return LogDecay.from_rate_or_factor(decay_value, decay_kind == KIND_RATE, h, device)
    return LogDecay(device, host=(0.0,) * h)


@torch.library.custom_op("rtkernels::causal_linear_attention_backward", mutates_args=())
def backward_op(grad_out: Tensor, grad_state: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor,
                decay: Optional[Tensor], decay_kind: int, decay_value: Optional[float], scale: float,
                layout: str, initial_state: Optional[Tensor], fp32_precision: Optional[str],
                need_decay: bool, need_state: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, d_decay, d_initial_state)``: dq, dk, dv contiguous in ``layout`` in the
    dtypes of q, k, v; ``d_decay`` (dL/d``decay``) and ``d_initial_state`` like their inputs, or
    empty ``[0]`` tensors unless ``need_decay`` / ``need_state``."""
    bnhd = layout == "bnhd"
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v)) if bnhd else (q, k, v)
    precision = api._check_fp32_precision(fp32_precision)
    call = Call("chunk", _log_decay(decay, decay_kind, decay_value, qt.shape[1], q.device), scale, bnhd,
                 grad_state is not None, precision)
    meta = None if decay is None else (decay.device, decay.dtype)
    dq, dk, dv, d_decay, d_s0 = call_gradients(call, qt, kt, vt, initial_state, grad_out, grad_state,
                                                (True, True, True, need_decay, need_state), meta)
    grads = tuple((x.transpose(1, 2) if bnhd else x).contiguous() for x in (dq, dk, dv))
    return (*grads, d_decay.contiguous() if need_decay else q.new_empty(0),
            d_s0.contiguous() if need_state else q.new_empty(0))  # two empties: returns may not alias


@backward_op.register_fake
def _backward_fake(grad_out, grad_state, q, k, v, decay, decay_kind, decay_value, scale, layout, initial_state,
                   fp32_precision, need_decay, need_state):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            decay.new_empty(decay.shape) if need_decay else q.new_empty(0),
            initial_state.new_empty(initial_state.shape) if need_state else q.new_empty(0))


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, decay, decay_kind, decay_value, scale, method, layout, initial_state, return_state, precision = inputs
    ctx.save_for_backward(q, k, v, decay, initial_state)
    ctx.args = (decay_kind, decay_value, scale, layout, precision, return_state)


def _backward(ctx, grad_out: Tensor, grad_state: Optional[Tensor]):
    q, k, v, decay, initial_state = ctx.saved_tensors
    decay_kind, decay_value, scale, layout, precision, return_state = ctx.args
    needs = ctx.needs_input_grad
    need_decay, need_state = bool(needs[3]), bool(needs[9])
    dq, dk, dv, d_decay, d_s0 = backward_op(grad_out, grad_state if return_state else None, q, k, v, decay,
                                            decay_kind, decay_value, scale, layout, initial_state, precision,
                                            need_decay, need_state)
    return (dq, dk, dv, d_decay if need_decay else None, None, None, None, None, None,
            d_s0 if need_state else None, None, None)


forward_op.register_autograd(_backward, setup_context=_setup_context)


def _no_double_backward(ctx, *grads):
    raise RuntimeError("rtkernels.causal_linear_attention is not twice differentiable: its backward has no "
                       "backward (create_graph=True works for everything else; differentiating the gradient "
                       "of this call does not)")


backward_op.register_autograd(_no_double_backward, setup_context=lambda ctx, inputs, output: None)


def _folded(x: Optional[Tensor], dim: Optional[int], size: int) -> Optional[Tensor]:
    """``x`` with the vmapped dimension ``dim`` (None: not batched; expanded) folded into dim 0."""
    if x is None:
        return None
    x = x.movedim(dim, 0) if dim is not None else x.unsqueeze(0).expand(size, *x.shape)
    return x.reshape(size * x.shape[1], *x.shape[2:])


def _unfolded(x: Tensor, size: int) -> Tensor:
    return x.reshape(size, x.shape[0] // size, *x.shape[1:])


def _unbatched_decay(dim: Optional[int]) -> None:
    if dim is not None:
        raise NotImplementedError("rtkernels.causal_linear_attention under vmap: a decay tensor batched by vmap "
                                  "(one decay per vmapped sample) is not supported; vmap over q, k, v and "
                                  "initial_state with one [H] decay, or fold the samples into the heads")


@forward_op.register_vmap
def _forward_vmap(info, in_dims, q, k, v, decay, decay_kind, decay_value, scale, method, layout, initial_state,
                  return_state, fp32_precision):
    _unbatched_decay(in_dims[3])
    n = info.batch_size
    q, k, v = (_folded(x, d, n) for x, d in zip((q, k, v), in_dims[:3]))
    s0 = _folded(initial_state, in_dims[9], n)
    out, state = forward_op(q, k, v, decay, decay_kind, decay_value, scale, method, layout, s0, return_state,
                            fp32_precision)
    return (_unfolded(out, n), _unfolded(state, n) if return_state else state), (0, 0 if return_state else None)


@backward_op.register_vmap
def _backward_vmap(info, in_dims, grad_out, grad_state, q, k, v, decay, decay_kind, decay_value, scale, layout,
                   initial_state, fp32_precision, need_decay, need_state):
    _unbatched_decay(in_dims[5])
    if need_decay:
        raise NotImplementedError("rtkernels.causal_linear_attention under vmap: the decay gradient (one dgamma "
                                  "per vmapped sample) is not supported; detach the decay or leave vmap")
    n = info.batch_size
    g, gs, q, k, v, s0 = (_folded(x, d, n) for x, d in zip((grad_out, grad_state, q, k, v, initial_state),
                                                             (*in_dims[:5], in_dims[10])))
    dq, dk, dv, d_decay, d_s0 = backward_op(g, gs, q, k, v, decay, decay_kind, decay_value, scale, layout, s0,
                                            fp32_precision, False, need_state)
    res = (*(_unfolded(x, n) for x in (dq, dk, dv)), d_decay, _unfolded(d_s0, n) if need_state else d_s0)
    return res, (0, 0, 0, None, 0 if need_state else None)


def require_tensors(named: tuple[tuple[Any, str], ...], under: str) -> None:
    """A TypeError naming the first argument of ``named`` ((value, name) pairs) that is not a
    torch tensor: an op takes tensors only (``under``: what is tracing, for the message)."""
    for x, name in named:
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor under {under} (CUDA arrays such as CuPy's are "
                            f"taken by the eager call only), got {type(x).__name__}")


def decay_operands(decay: Any, decay_rate: Any) -> tuple[Optional[Tensor], int, Any]:
    """A public call's ``decay`` / ``decay_rate`` as an op's operands ``(tensor or None, kind, number
    or None)``: a tensor as it is, a number as a float (a symbolic one stays symbolic), the kind
    :data:`~rtkernels.decay.KIND_FACTOR` or :data:`~rtkernels.decay.KIND_RATE`. TypeError / ValueError
    for both given or a value of another type."""
    if decay is not None and decay_rate is not None:
        raise ValueError("pass decay (factors gamma) or decay_rate (rates r, gamma = exp(-r)), not both")
    name, given, kind = ("decay_rate", decay_rate, KIND_RATE) if decay_rate is not None else ("decay", decay, KIND_FACTOR)
    if isinstance(given, Tensor):
        return given, kind, None
    if isinstance(given, _PLAIN_NUMBERS) and not isinstance(given, bool):
        return None, kind, torch.sym_float(given)  # a symbolic float (dynamic=True) stays one
    if given is not None:
        if not _is_number(given):
            raise TypeError(f"{name} must be a float or a tensor of shape [H], got {type(given).__name__}")
        return None, kind, float(given)
    return None, kind, None


def _route(q: Any, k: Any, v: Any, decay: Any, decay_rate: Any, scale: Any, method: Any, layout: Any,
           initial_state: Any, return_state: Any, fp32_precision: Any) -> Any:
    """The public call's arguments to the forward op (:data:`rtkernels.api.op_call`); NotImplemented
    from inside the op's own kernel, which runs the eager call."""
    if getattr(_local, "inside", False):
        return NotImplemented
    if not torch.compiler.is_compiling() and torch._C._are_functorch_transforms_active():
        others = {i.key().name for i in retrieve_all_functorch_interpreters()} - {"Vmap"}
        if others:  # custom ops' autograd formulas do not reach torch.func's grad transforms
            raise NotImplementedError(
                f"rtkernels.causal_linear_attention under torch.func transforms other than vmap "
                f"({', '.join(sorted(others))}) is not supported: differentiate with torch.autograd "
                f"(loss.backward(), torch.autograd.grad), which also works through torch.func.vmap")
    require_tensors(((q, "q"), (k, "k"), (v, "v")), "torch.compile, torch.export and torch.func")
    tensor, kind, value = decay_operands(decay, decay_rate)
    if initial_state is not None and not isinstance(initial_state, Tensor):
        raise TypeError(f"initial_state must be a torch.Tensor, got {type(initial_state).__name__}")
    for arg, argname in ((method, "method"), (layout, "layout")):
        if not isinstance(arg, str):
            raise TypeError(f"{argname} must be a string, got {type(arg).__name__}")
    if not isinstance(return_state, bool):
        raise TypeError(f"return_state must be a bool, got {type(return_state).__name__}")
    if fp32_precision is not None and not isinstance(fp32_precision, str):
        raise TypeError(f"fp32_precision must be None or a string, 'exact' or 'tf32'; "
                        f"got {type(fp32_precision).__name__}")
    plain = isinstance(scale, _PLAIN_NUMBERS) and not isinstance(scale, bool)
    scale = torch.sym_float(scale) if plain else _check_scale(scale)  # a plain float is checked by the fake
    out, state = forward_op(q, k, v, tensor, kind, value, scale, method, layout, initial_state, return_state,
                            fp32_precision)
    return (out, state) if return_state else out


def causal_linear_attention(
    q: Tensor, k: Tensor, v: Tensor, decay: Union[None, float, Tensor] = None, *,
    decay_rate: Union[None, float, Tensor] = None, scale: float = 1.0, method: str = "auto",
    layout: str = "bhnd", initial_state: Optional[Tensor] = None, return_state: bool = False,
    fp32_precision: Optional[str] = None,
) -> Any:
    r""":func:`rtkernels.causal_linear_attention` (same arguments, results and complexity) through
    the ``torch.ops.rtkernels.causal_linear_attention`` op, in eager mode too: for capturing the
    op itself (e.g. a manual ``torch.cuda.graph``) or exporting it. q, k, v, a decay tensor and
    ``initial_state`` must be torch tensors. The eager public call is cheaper on the host (its
    call cache); under torch.compile both give the same graph."""
    res = _route(q, k, v, decay, decay_rate, scale, method, layout, initial_state, return_state, fp32_precision)
    if res is NotImplemented:  # called from inside the op's own kernel: the eager call
        return api.causal_linear_attention(q, k, v, decay, decay_rate=decay_rate, scale=scale, method=method,
                                           layout=layout, initial_state=initial_state, return_state=return_state,
                                           fp32_precision=fp32_precision)
    return res


api.op_call = _route
