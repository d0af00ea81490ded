r"""The decode step as a ``torch.library`` custom op, for torch.compile, torch.export and CUDA graphs.

``torch.ops.rtkernels.decode`` is :func:`rtkernels.decode` (for each sequence b with row
``i = state_indices[b]`` of the pool: ``S <- gamma_h S + k_t^T v_t``, ``o_t = scale * q_t S`` for
t = 0 .. T-1, and S written back into row i) as one opaque node of a traced graph, declared as
mutating ``state`` so that the compiler orders it with the pool's other readers and writers. Its
fake implementation gives the output from the inputs' metadata (and runs the eager call's metadata
checks, so a malformed step fails while tracing with the eager message); its kernel is the eager
call itself, so results, value checks and messages are the eager ones. Work and memory are the
eager step's (:mod:`rtkernels.decode`).

:func:`rtkernels.decode` routes here by itself while torch.compile or torch.export trace it;
eager calls keep the checks-and-call-cache path. There is no autograd formula (the eager step
refuses inputs that require grad in grad mode, and so does the op) and no vmap rule: a step under
``torch.func.vmap`` raises ``NotImplementedError`` naming the alternative. Inside the op every
argument is a tensor or a plain scalar: the decay is ``decay`` (an ``[H]`` tensor, or None) with
``decay_kind`` (factors or rates, :mod:`rtkernels.decay`) or a number ``decay_value`` of that kind.
"""

from __future__ import annotations

import importlib
import threading
from typing import Any, Optional

import torch
from torch import Tensor

from .api import _check_factor_or_rate, _check_inputs, _check_scale
from .decay import KIND_RATE
from .ops import decay_operands, require_tensors

__all__ = ["decode_op"]

# the module, not the function of the same name that the package re-exports
_decode = importlib.import_module(".decode", __package__)

_local = threading.local()  # .inside: this thread runs the op's kernel (the eager step)
#: Numbers passed to the op as they are (dynamo traces a symbolic float as a float).
_PLAIN_NUMBERS = (float, int, torch.SymFloat, torch.SymInt)


@torch.library.custom_op("rtkernels::decode", mutates_args=("state",))
def decode_op(q: Tensor, k: Tensor, v: Tensor, state: Tensor, decay: Optional[Tensor], decay_kind: int,
              decay_value: Optional[float], scale: float, state_indices: Optional[Tensor], layout: str) -> Tensor:
    """The step's output; ``state`` is updated in place."""
    given = decay if decay is not None else decay_value
    kw = {"decay_rate": given} if decay_kind == KIND_RATE else {"decay": given}
    _local.inside = True
    try:
        return _decode.decode(q, k, v, state, **kw, scale=scale, state_indices=state_indices, layout=layout)
    finally:
        _local.inside = False


@decode_op.register_fake
def _decode_fake(q, k, v, state, decay, decay_kind, decay_value, scale, state_indices, layout):
    qt, _, vt, _ = _check_inputs(q, k, v, layout)  # the eager step's metadata checks and messages
    if type(scale) is float:
        _check_scale(scale)
    b, h, t, _ = qt.shape
    pool = _decode._check_pool(state, qt, vt)
    _decode._check_indices(state_indices, b, pool.shape[0], qt.device, values=False)
    name = "decay_rate" if decay_kind == KIND_RATE else "decay"
    if decay is not None and tuple(decay.shape) != (h,):
        raise ValueError(f"{name} must be a float or a tensor of shape [H] = [{h}], got shape {tuple(decay.shape)}")
    if type(decay_value) is float:  # a symbolic float is checked when the op runs
        _check_factor_or_rate(decay_value, name, h, q.device)
    dv = vt.shape[3]
    return q.new_empty((b, h, t, dv) if layout == "bhnd" else (b, t, h, dv))


def _route(q: Any, k: Any, v: Any, state: Any, decay: Any, decay_rate: Any, scale: Any, state_indices: Any,
           layout: Any) -> Any:
    """The public step's arguments to the op (:data:`rtkernels.decode.op_call`); NotImplemented from
    inside the op's own kernel, which runs the eager step."""
    if getattr(_local, "inside", False):
        return NotImplemented
    if not torch.compiler.is_compiling() and torch._C._are_functorch_transforms_active():
        raise NotImplementedError("rtkernels.decode under torch.func transforms (vmap, grad) is not supported: "
                                  "fold the extra dimension into the batch (B) and its pool rows instead")
    require_tensors(((q, "q"), (k, "k"), (v, "v"), (state, "state")), "torch.compile and torch.export")
    tensor, kind, value = decay_operands(decay, decay_rate)
    if state_indices is not None and not isinstance(state_indices, Tensor):
        raise TypeError(f"state_indices must be None or an int32 tensor of shape [B], got {type(state_indices).__name__}")
    if not isinstance(layout, str):
        raise TypeError(f"layout must be a string, got {type(layout).__name__}")
    plain = isinstance(scale, _PLAIN_NUMBERS) and not isinstance(scale, bool)
    scale = torch.sym_float(scale) if plain else _check_scale(scale)  # a plain float is checked by the fake
    return decode_op(q, k, v, state, tensor, kind, value, scale, state_indices, layout)


_decode.op_call = _route
