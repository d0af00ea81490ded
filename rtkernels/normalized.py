r"""``linear_attention``: decaying causal linear attention with a normalizing denominator.

Per (batch, head), with one decay factor gamma in (0, 1] per head,

    w_ij = gamma^(i-j) s(q_i, k_j)                    (j <= i)
    o_i  = sum_{j<=i} w_ij v_j / (sum_{j<=i} w_ij + eps)

where ``s(q, k) = scale * q.k`` (``feature="identity"``) or ``s(q, k) = 1 + scale * q.k``
(``feature="1+qk"``, the first-order Taylor form of exp(scale * q.k)): linear attention with a
normalizing denominator (as in Katharopoulos et al., 2020), with the per-head decay of RetNet; the
project's second seed paper is Gerami & Duraiswami (2025), arXiv 2510.21956. ``normalize=False``
returns the numerator ``sum_{j<=i} w_ij v_j`` alone.

How it is computed: as ONE call of :func:`rtkernels.causal_linear_attention` (so the CUDA chunk
kernels run the forward and the backward, and the decay is checked and read exactly as there).
The denominator is the same decaying operator applied to a column of ones, so ``v`` gets one
ones column and the core's output column ``Dv`` is the denominator:

    identity:  core(q, k, [v | 1], scale=scale)                    = [num | den]
    1+qk:      core([scale*q | 1], [k | 1], [v | 1], scale=1)      = [num | den]

since ``[scale*q | 1] . [k | 1] = 1 + scale * q.k`` exactly, for every scale, 0 included (nothing
is divided by scale). Then ``o = num / (den + eps)``. Gradients flow through autograd: the
padding, the slices and the division are torch operations, and the core's backward runs its kernels.

Precision: the core runs in the caller's dtype (for fp16/bf16 the 16-bit tensor-core kernels, fp32
accumulation) and returns ``num`` and ``den`` rounded to that dtype; the division is done in fp32
for 16-bit inputs (fp32 for fp32, fp64 for fp64) and rounded once to the input dtype. Why not more:
the error of a 16-bit output is that of three roundings, of ``num``, of ``den`` and of the result,
and only the last is unavoidable. Removing the other two means running the core in fp32: twice the
memory traffic and the fp32 (3xTF32) kernel, several times slower than the 16-bit one (the README's
mid shape, kernels alone: 1.13 against 0.19 ms), to gain a factor of about sqrt(3) (measured on the
CPU torch path, N = 512, D = 64, gamma 0.9 .. 1, relative Frobenius error against fp64: bf16 2.9e-3
against 1.6e-3 with an fp32 core, fp16 3.5e-4 against 2.0e-4). Not cheap, so not done. Making only
the denominator exact would need a second pass (a decayed prefix sum of k in fp32) for a factor of
about sqrt(3/2). What the fp32 division does buy: ``eps`` is added at fp32 resolution (in fp16, 1e-6
is subnormal; added in 16 bits it would vanish next to any denominator above about 2e-3 in fp16,
2.6e-4 in bf16), and ``den + eps`` is not rounded to 16 bits before the division (a 16-bit division
gave the same error on the inputs above: torch divides 16-bit tensors in fp32 and rounds once). For
``"1+qk"``, ``scale * q`` is rounded to the input dtype once more (exact when scale is a power of
2), an error of the size of the rounding of q itself.

Where the denominator vanishes or changes sign: ``s = scale * q.k`` can be negative, and so can
``den_i``; as it crosses 0 the output is unbounded. ``eps`` is *added* to the denominator: it
keeps ``0 / (0 + eps) = 0`` finite for a non-negative denominator, and does nothing to protect a
negative one (``den + eps`` can still be 0, or tiny). For a positive denominator, use non-negative
features on q and k with scale > 0, e.g. ``q = elu(x) + 1`` (then ``den_i >= scale * q_i.k_i > 0``);
with ``"1+qk"`` the denominator is positive wherever ``scale * q.k > -1`` for all pairs (then
``den_i >= s(q_i, k_i) > 0``). With ``eps = 0`` a zero denominator gives NaN (0/0) or inf.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Union

import numpy as np
import torch
import torch.nn.functional as F

from .api import Array, _check_inputs, _check_scale, _is_number, _results, causal_linear_attention

__all__ = ["linear_attention", "FEATURES"]

#: Accepted ``feature`` values: the similarity s(q, k) of the weights.
FEATURES = ("identity", "1+qk")

_HALF = (torch.float16, torch.bfloat16)


def _check_options(normalize: Any, feature: Any, eps: Any) -> tuple[bool, str, float]:
    """The checked ``(normalize, feature, eps)``; TypeError / ValueError naming the argument."""
    if not isinstance(normalize, (bool, np.bool_)):
        raise TypeError(f"normalize must be a bool, got {type(normalize).__name__}")
    if not isinstance(feature, str):
        raise TypeError(f"feature must be a string, one of {', '.join(repr(f) for f in FEATURES)}; "
                        f"got {type(feature).__name__}")
    if feature not in FEATURES:
        raise ValueError(f"feature must be one of {', '.join(repr(f) for f in FEATURES)}, got {feature!r}")
    if not _is_number(eps):
        raise TypeError(f"eps must be a real number, got {type(eps).__name__}")
    eps = float(eps)
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be finite and >= 0, got {eps}")
    return bool(normalize), feature, eps


def _padded(x: torch.Tensor, width: int, value: float) -> torch.Tensor:
    """``x`` ``[..., D]`` widened to ``width`` >= D columns (the new ones ``value``), as a view of one
    copy whose rows are padded to a multiple of 16 bytes: the chunk kernel's vectorized (cp.async)
    loads need every row to start on 16 bytes, which a row of D + 1 16-bit elements does not for
    most D. Differentiable (``F.pad`` and a slice)."""
    d = x.shape[-1]
    per16 = max(1, 16 // x.element_size())
    return F.pad(x, (0, -(-width // per16) * per16 - d), value=value)[..., :width]


def _with_column(x: torch.Tensor, value: float) -> torch.Tensor:
    """``[..., D]`` -> ``[..., D + 1]`` with last column ``value``, rows padded to 16 bytes."""
    return _padded(x, x.shape[-1] + 1, value)


class _AlignedGrad(torch.autograd.Function):
    """The identity, whose backward hands the incoming gradient on in rows padded to 16 bytes. Put
    on the core's ``[..., Dv + 1]`` output, it gives the core's backward (whose three kernel passes
    read it like q, k or v) a gradient that takes the vectorized loads; autograd would otherwise
    hand on a dense ``[..., Dv + 1]`` tensor. Costs one copy of that gradient; CUDA only."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if grad.is_contiguous() and (grad.shape[-1] * grad.element_size()) % 16 == 0:
            return grad
        return _padded(grad, grad.shape[-1], 0.0)


def linear_attention(
    q: Array, k: Array, v: Array, decay: Union[None, float, Array] = None, *,
    decay_rate: Union[None, float, Array] = None, scale: float = 1.0, normalize: bool = True,
    feature: str = "identity", eps: float = 1e-6, layout: str = "bhnd", method: str = "auto",
    fp32_precision: Optional[str] = None,
) -> Any:
    r"""Normalized decaying causal linear attention.

    .. math::

        w_{ij} = \gamma_h^{\,i-j}\, s(q_i, k_j), \qquad
        o_i = \frac{\sum_{j \le i} w_{ij} v_j}{\sum_{j \le i} w_{ij} + \text{eps}}

    with ``s(q, k) = scale * q.k`` (``feature="identity"``) or ``1 + scale * q.k``
    (``feature="1+qk"``). ``normalize=False`` returns the numerator alone; for ``"identity"`` that
    is exactly :func:`rtkernels.causal_linear_attention` (the same call).

    Args:
        q, k: ``[B, H, N, Dk]`` (``layout="bhnd"``) or ``[B, N, H, Dk]`` (``layout="bnhd"``).
        v: ``[B, H, N, Dv]`` or ``[B, N, H, Dv]``. dtype float64, float32, float16 or bfloat16, the
            same for all three, one device (as :func:`rtkernels.causal_linear_attention`; CuPy
            arrays in give a CuPy array out).
        decay, decay_rate: per-head factors gamma in (0, 1] or rates r >= 0 (floats or ``[H]``
            tensors, trainable ones included), checked and read exactly as by
            :func:`rtkernels.causal_linear_attention`.
        scale: a finite real number inside s (any value, 0 included: with ``"identity"`` and
            scale 0 every weight is 0 and the output is ``0 / eps = 0``; with ``"1+qk"`` it is the
            decayed mean of v).
        normalize: True: divide by the denominator; False: the numerator only (``eps`` unused).
        feature: ``"identity"`` or ``"1+qk"``.
        eps: a finite number >= 0 *added* to the denominator (in fp32 for 16-bit inputs). It keeps a
            zero denominator finite (0 / eps = 0) and has no effect worth the name on a denominator
            much larger than it; it does not protect a negative denominator.
        layout: ``"bhnd"`` or ``"bnhd"``.
        method, fp32_precision: passed to :func:`rtkernels.causal_linear_attention`.

    Returns:
        ``[B, H, N, Dv]`` (or ``[B, N, H, Dv]``) in the input dtype and layout, contiguous.

    When the denominator vanishes or changes sign: with ``"identity"``, ``s = scale * q.k`` takes
    both signs for arbitrary q and k, so ``den_i`` can be 0 or negative and the output is then
    unbounded (eps does not help a negative denominator). Non-negative feature maps on q and k
    (``elu(x) + 1``) with scale > 0 make every weight >= 0 and ``den_i >= scale q_i.k_i > 0``. With
    ``"1+qk"`` the denominator is positive when ``scale * q_i.k_j > -1`` for every pair j <= i. With
    ``eps = 0`` a zero denominator gives NaN or inf. In fp16, num and den (sums of up to N weighted
    terms) overflow past 65504: with gamma = 1 and long sequences use bf16, fp32 or a decay.

    Precision: the core call runs in the input dtype (fp16/bf16: the 16-bit kernels, fp32
    accumulation; num and den come back rounded to 16 bits); the division runs in fp32 for 16-bit
    inputs and is rounded once. Why, in the module docstring.

    Cost: one call of the core with Dv + 1 value columns (and Dk + 1 key columns for ``"1+qk"``):
    work O(N C (Dk + Dv) + N Dk Dv) per (batch, head) with chunk C, as the core; memory: the core's,
    plus one copy of v with the ones column (Dv + 1 wide, rows padded to 16 bytes), for ``"1+qk"``
    one such copy of q (scaled; while it is made, one more temporary copy of q unless scale = 1)
    and of k, for 16-bit inputs one fp32 ``[..., Dv]`` temporary of the
    division; with gradients on CUDA, one copy of the core's output gradient in rows padded to 16
    bytes (so that the backward's kernel passes, which read it like q, k or v, keep their
    vectorized loads). The core's kernel limits apply to the widened heads: the chunk kernel takes
    Dv + 1 <= 512 and, for ``"1+qk"``, Dk + 1 <= 256; beyond that a CUDA call runs the core's torch
    path (with its RuntimeWarning). Where Dv is a multiple of the kernel's value tile (64 or 128)
    the ones column costs one more value tile, and with ``"1+qk"`` a Dk of 64 or 128 moves to the
    next key width (128, 256): more work per token (not measured). No ``initial_state``,
    ``return_state`` or ``cu_seqlens`` (the widened call's state would be ``[Dk (+1), Dv + 1]``).

    Gradients: with respect to q, k, v and a decay tensor that requires grad, through autograd (the
    padding, the slices and the division are torch operations; the core's backward is its own).

    Raises:
        TypeError / ValueError naming the argument, as the core, and for ``normalize`` (not a bool),
        ``feature`` (not one of :data:`FEATURES`) and ``eps`` (not a real number, negative, or not
        finite). NaN is data: a NaN in q_i reaches row i; one in k_j or v_j the rows i >= j of that
        head (a NaN in v_j[c] only column c of them).
    """
    normalize, feature, eps = _check_options(normalize, feature, eps)
    scale = _check_scale(scale)
    qt, kt, vt, kind = _check_inputs(q, k, v, layout)  # [B, H, N, D] views; back to the caller's layout
    if kind == "cupy":
        for name, d in (("decay", decay), ("decay_rate", decay_rate)):
            if isinstance(d, torch.Tensor) and d.requires_grad and torch.is_grad_enabled():
                raise TypeError(f"{name} requires grad, but q, k and v are CUDA arrays (CuPy) and the output "
                                f"is a CuPy array, which carries no gradient; pass torch tensors for q, k and v, "
                                f"or detach it")
    if layout == "bnhd":
        qt, kt, vt = (t.transpose(1, 2) for t in (qt, kt, vt))
    if feature == "1+qk":  # [scale*q | 1] . [k | 1] = 1 + scale * q.k, exactly, for every scale
        qt = _with_column(qt if scale == 1.0 else qt * scale, 1.0)
        kt = _with_column(kt, 1.0)
        core_scale = 1.0
    else:
        core_scale = scale
    if normalize:
        vt = _with_column(vt, 1.0)
    out = causal_linear_attention(qt, kt, vt, decay, decay_rate=decay_rate, scale=core_scale, method=method,
                                  layout=layout, fp32_precision=fp32_precision)
    if normalize:
        if out.requires_grad and out.is_cuda:
            out = _AlignedGrad.apply(out)
        dv = vt.shape[-1] - 1
        num, den = out[..., :dv], out[..., dv:]
        if den.dtype in _HALF:
            den = den.float()  # num (16-bit) / den (fp32) promotes: the division runs in fp32
        out = (num / (den + eps)).to(qt.dtype).contiguous()
    return _results(out, None, False, kind)
