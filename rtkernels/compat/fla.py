r"""flash-linear-attention's (fla) simple GLA calls with a per-head decay, computed by rtkernels.

For code moving from ``fla.ops.simple_gla``: :func:`chunk_simple_gla` and
:func:`fused_recurrent_simple_gla` take fla's arguments and ``[B, T, H, D]`` layout and return
fla's ``(o, final_state)``, so switching is a change of import::

    from rtkernels.compat.fla import chunk_simple_gla   # was: from fla.ops.simple_gla import ...

With ``g_gamma`` the per-head log decay (``gamma_h = exp(g_gamma_h)``), both compute

.. math:: S_t = e^{g_\gamma} S_{t-1} + k_t^T v_t, \qquad o_t = \text{scale}\; q_t S_t

(``S_{-1}`` = ``initial_state`` or 0), i.e. :func:`rtkernels.causal_linear_attention` with
``decay_rate = -g_gamma`` and ``layout="bnhd"``; both use its automatic method choice (fla's two
names differ in their kernels only). Work O(T C (K + V) + T K V) per (batch, head) on the
``chunk`` kernel, like the call (README's methods table); the only extra operation is the
negation of the ``[H]`` ``g_gamma`` (one tiny op, differentiable).

Packed sequences: ``cu_seqlens`` (fla's ``[S + 1]`` offsets into ``[1, T, H, D]`` inputs, with
``initial_state`` and the final state ``[S, H, K, V]``) is the call's own ``cu_seqlens``
(:mod:`rtkernels.varlen`: a torch path on every device, no host sync).

Not supported, each a ``NotImplementedError`` naming it: per-token gates ``g`` (``[B, T, H]``:
rtkernels' decay is one constant per head), and fla's ``reverse=True`` and ``state_v_first=True``. ``g_gamma > 0`` (a growing state) is outside the
decay's domain: a ``ValueError`` for a float or a CPU tensor, NaN outputs for that head from a
CUDA tensor (read on the device with no sync, as the call's device decays).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..api import causal_linear_attention
from ..varlen import check_cu_seqlens_values

__all__ = ["chunk_simple_gla", "fused_recurrent_simple_gla"]


#: fla's options beyond the shared ones, at the defaults this module computes (another value: NotImplementedError)
_FLA_DEFAULTS = {"reverse": False, "state_v_first": False, "transpose_state_layout": False, "head_first": False}


def _unsupported(name: str, what: str, hint: str) -> NotImplementedError:
    return NotImplementedError(f"rtkernels.compat.fla.{name}: {what} is not supported; {hint}")


def _rate(name: str, g_gamma: Any, q: Any) -> Any:
    """``decay_rate`` = -g_gamma, after checking what fla's docstring promises: ``[H]`` (or a number), <= 0."""
    if g_gamma is None:
        return None
    if isinstance(g_gamma, torch.Tensor):
        if isinstance(q, torch.Tensor) and q.dim() == 4 and tuple(g_gamma.shape) != (q.shape[2],):
            raise ValueError(f"{name}: g_gamma must be the per-head log decay, shape [H] = [{q.shape[2]}], "
                             f"got shape {tuple(g_gamma.shape)}")
        # a CPU tensor is checked here (no device sync; a CUDA one is read on the device)
        if g_gamma.device.type == "cpu" and not torch.compiler.is_compiling() and bool((g_gamma > 0).any()):
            raise ValueError(f"{name}: g_gamma must be a log decay <= 0 per head (gamma = exp(g_gamma) in (0, 1]), "
                             f"got {g_gamma.tolist()}")
        return -g_gamma
    if isinstance(g_gamma, (int, float)) and not isinstance(g_gamma, bool):
        if not g_gamma <= 0:  # NaN fails too
            raise ValueError(f"{name}: g_gamma must be a log decay <= 0 (gamma = exp(g_gamma) in (0, 1]), "
                             f"got {g_gamma}")
        return -float(g_gamma)
    raise TypeError(f"{name}: g_gamma must be None, a float or a tensor of shape [H], got {type(g_gamma).__name__}")


def _host_offsets(cu_seqlens: Any, cu_seqlens_cpu: Any, q: Any) -> Any:
    """The offsets to use given fla's host copy: ``cu_seqlens`` if given, else the copy on q's
    device; the copy's values are checked here, where reading them costs no sync."""
    if not isinstance(cu_seqlens_cpu, torch.Tensor) or cu_seqlens_cpu.device.type != "cpu":
        raise TypeError("chunk_simple_gla: cu_seqlens_cpu must be a CPU tensor (fla's host copy of cu_seqlens), got "
                        + (f"a tensor on {cu_seqlens_cpu.device}" if isinstance(cu_seqlens_cpu, torch.Tensor)
                           else type(cu_seqlens_cpu).__name__))
    if isinstance(q, torch.Tensor) and q.dim() == 4 and cu_seqlens_cpu.dim() == 1 and cu_seqlens_cpu.shape[0] >= 1 \
            and not cu_seqlens_cpu.is_floating_point() and not torch.compiler.is_compiling():
        check_cu_seqlens_values(cu_seqlens_cpu, q.shape[1])  # else the call names what is wrong
    if cu_seqlens is not None:
        return cu_seqlens
    return cu_seqlens_cpu.to(q.device) if isinstance(q, torch.Tensor) else cu_seqlens_cpu


def _simple_gla(name: str, q: Any, k: Any, v: Any, g: Any, g_gamma: Any, scale: Optional[float],
                initial_state: Any, output_final_state: Any, cu_seqlens: Any, extra: dict) -> tuple[Any, Any]:
    if g is not None:
        raise _unsupported(name, "per-token gates g ([B, T, H])",
                           "rtkernels' decay is one constant per head: pass it as g_gamma ([H], the log decay)")
    for key, value in extra.items():
        if key not in _FLA_DEFAULTS:
            raise TypeError(f"{name}() got an unexpected keyword argument {key!r}")
        if value != _FLA_DEFAULTS[key]:
            raise _unsupported(name, f"{key}={value!r}", f"leave it at fla's default, {_FLA_DEFAULTS[key]!r}")
    if not isinstance(output_final_state, bool):
        raise TypeError(f"{name}: output_final_state must be a bool, got {type(output_final_state).__name__}")
    rate = _rate(name, g_gamma, q)
    if scale is None and isinstance(k, torch.Tensor) and k.dim() == 4:
        scale = k.shape[-1] ** -0.5
    elif scale is None:
        scale = 1.0  # the call names what is wrong with k
    if isinstance(initial_state, torch.Tensor) and initial_state.dtype in (torch.float16, torch.bfloat16):
        initial_state = initial_state.float()  # fla takes a 16-bit state and computes in float32, as here
    res = causal_linear_attention(q, k, v, decay_rate=rate, scale=scale, layout="bnhd", initial_state=initial_state,
                                  return_state=output_final_state, cu_seqlens=cu_seqlens)
    return res if output_final_state else (res, None)


def chunk_simple_gla(q: Any, k: Any, v: Any, g: Any = None, g_gamma: Any = None, scale: Optional[float] = None,
                     initial_state: Any = None, output_final_state: bool = False, cu_seqlens: Any = None,
                     cu_seqlens_cpu: Any = None, **kwargs: Any) -> tuple[Any, Any]:
    r"""fla's ``chunk_simple_gla`` with a per-head decay: ``o_t = scale q_t S_t``,
    ``S_t = exp(g_gamma) S_{t-1} + k_t^T v_t``.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]`` (float64, float32, float16 or bfloat16; one device).
        g: per-token gates: not supported (``NotImplementedError``); use ``g_gamma``.
        g_gamma: ``[H]`` log decay per head (<= 0), a float for every head, or None (no decay).
            Differentiable when it requires grad.
        scale: multiplies the output; None gives ``K ** -0.5``.
        initial_state: ``[B, H, K, V]`` state to continue from (float32, or float64 for float64
            inputs; a 16-bit state is taken as float32).
        output_final_state: also return the final state.
        cu_seqlens: ``[S + 1]`` int32/int64 offsets of S sequences packed into ``B = 1`` (on q's
            device), as the call's ``cu_seqlens``: ``initial_state`` and the final state become
            ``[S, H, K, V]``; a torch path on every device (:mod:`rtkernels.varlen`).
        cu_seqlens_cpu: fla's host copy of ``cu_seqlens``: its values are checked on the host
            (``ValueError``, no device sync); without ``cu_seqlens`` it is copied to q's device
            and used.
        **kwargs: fla's other options at their defaults (``head_first=False``); another value
            raises ``NotImplementedError`` naming it, an unknown name ``TypeError``.

    Returns:
        ``(o, final_state)``: o ``[B, T, H, V]`` in the input dtype; final_state ``[B, H, K, V]``
        in float32 (float64 for float64 inputs) if ``output_final_state``, else None.
        Complexity: the ``chunk`` method's, O(T C (K + V) + T K V) per (batch, head).
    """
    if cu_seqlens_cpu is not None:
        cu_seqlens = _host_offsets(cu_seqlens, cu_seqlens_cpu, q)
    return _simple_gla("chunk_simple_gla", q, k, v, g, g_gamma, scale, initial_state, output_final_state,
                       cu_seqlens, kwargs)


def fused_recurrent_simple_gla(q: Any, k: Any, v: Any, g: Any = None, g_gamma: Any = None,
                               scale: Optional[float] = None, initial_state: Any = None,
                               output_final_state: bool = False, reverse: bool = False, state_v_first: bool = False,
                               cu_seqlens: Any = None, **kwargs: Any) -> tuple[Any, Any]:
    r"""fla's ``fused_recurrent_simple_gla``: the same computation as :func:`chunk_simple_gla`
    (arguments, results and complexity as there; the method is chosen automatically, e.g. the
    ``scan`` kernel for a few tokens at a time). ``reverse=True`` and ``state_v_first=True`` raise
    ``NotImplementedError``."""
    extra = {**kwargs, "reverse": reverse, "state_v_first": state_v_first}
    return _simple_gla("fused_recurrent_simple_gla", q, k, v, g, g_gamma, scale, initial_state, output_final_state,
                       cu_seqlens, extra)
