r"""``linear_attention``: decaying causal linear attention with a normalizing denominator.

Per (batch, head), with one decay factor gamma in (0, 1] per head,

    w_ij = gamma^(i-j) s(q_i, k_j)                    (j <= i)
    o_i  = sum_{j<=i} w_ij v_j / (sum_{j<=i} w_ij + eps)

where ``s(q, k) = scale * q.k`` (``feature="identity"``) or ``s(q, k) = 1 + scale * q.k``
(``feature="1+qk"``, the first-order Taylor form of exp(scale * q.k)): linear attention with a
normalizing denominator (as in Katharopoulos et al., 2020), with the per-head decay of RetNet; the
project's second seed paper is Gerami & Duraiswami (2025), arXiv 2510.21956. ``normalize=False``
returns the numerator ``sum_{j<=i} w_ij v_j`` alone.

How it is computed: q, k and v go to :func:`rtkernels.causal_linear_attention` ("core") as they
are (no copy, no padding), and everything else is the same decaying operator on narrow operands.
With ``ones`` a stride-0 view of rows e_1 = (1, 0, ..., 0) (8 wide), ``core(ones, ones, x)_i = sum_{j<=i} gamma^(i-j) x_j``
(a query and key of unit rows, x as the values), so

    z = core(ones, ones, k)            u = core(ones, ones, v)          G = core(1, 1, 1) (fp32, [1, H, N, 1])
    identity:  num = core(q, k, v, scale=scale)        den_i = scale * q_i . z_i
    1+qk:      num = core(q, k, v, scale=scale) + u    den_i = G_i + scale * q_i . z_i

(``G_i = sum_{j<=i} gamma^(i-j) = (1 - gamma^(i+1)) / (1 - gamma)``, ``i + 1`` at gamma = 1, is the
operator on a ones column too, run in fp32 -- fp64 for fp64 inputs -- on one batch row: every gamma
in (0, 1] alike, and differentiable with respect to a trainable decay like the other calls). Every
call gets the caller's ``decay`` / ``decay_rate``, ``method`` and ``layout`` (and ``fp32_precision``;
the G call always "exact"), so the CUDA chunk kernels run every forward and backward, and the decay
is checked and read as by the core.

The rest is one fused step, :mod:`rtkernels.normalize_op` (a ``torch.library`` op): per row i it
reads q_i, z_i, num_i (u_i, G_i), forms ``den_i`` and writes ``o_i = (num_i (+ u_i)) / (den_i + eps)``
and ``den_i`` (fp32, ``[B, H, N]``, kept for the backward). On CUDA (fp32/fp16/bf16) that is one
kernel launch (``cuda_src/normalize/fwd.cu``), its backward another (``bwd.cu``: ``d_num = d_u =
g / (den + eps)``, ``dden = -(g . (num (+ u)) / (den + eps)) / (den + eps)``, ``dq`` and ``dz``
through den, ``dG`` = dden summed over the batch); elsewhere the same formulas in torch operations.
The gradients of q, k, v and the decay through num, z, u and G are the core calls' own backward,
through autograd. The op has a fake implementation, so ``torch.compile(fullgraph=True)`` traces
``linear_attention`` as the core ops and this one.

Precision: each core call runs in the caller's dtype (for fp16/bf16 the 16-bit tensor-core kernels,
fp32 accumulation) and returns its result rounded to that dtype. The row dot ``q_i . z_i`` takes the
exact products of the 16-bit q and z in fp32 and sums them in fp32; G is fp32; ``den`` stays fp32 and
``num`` (``"1+qk"``: ``num + u``, summed in fp32) is divided in fp32 (IEEE division), the result
rounded once to the input dtype (fp32 inputs: all fp32; fp64: all fp64); the kernel and the torch
path compute the same formulas. So the denominator carries only the roundings of the elements of z,
which partly average out over the Dk products (measured on the CPU torch path, N =
512, D = 64, gamma 0.9 .. 1, q and k elu + 1, relative Frobenius error of den against fp64 on the
same rounded inputs: bf16 2.5e-4, fp16 3.1e-5, where den rounded once to the dtype, as the previous
single widened call returned it, gave 1.7e-3 and 2.1e-4), and a 16-bit output carries two roundings
that matter, of num and of the result, where an fp32 core would leave one: relative Frobenius error
of o, same inputs (scale D^-0.5 for "identity", 0.1 for "1+qk"): bf16 2.3e-3 ("identity") and 2.2e-3
("1+qk") against 1.6e-3 with everything in fp32; fp16 2.9e-4 and 2.7e-4 against 2.0e-4 (the widened
single call: 2.8e-3 / 2.9e-3 and 3.5e-4 / 3.6e-4). Running the core in fp32 is not worth that factor
(about sqrt(2)): twice the memory traffic and the fp32 (3xTF32) kernel, several times slower than the
16-bit one (the README's mid shape, kernels alone: 1.13 against 0.19 ms). What the fp32 division
buys: ``eps`` is added at fp32 resolution (in fp16, 1e-6 is subnormal; added in 16 bits it would
vanish next to any denominator above about 2e-3 in fp16, 2.6e-4 in bf16), and ``den`` is never
rounded to 16 bits. (The output figures above were measured again after the fused step replaced the
torch epilogue: unchanged at that resolution.) The backward's ``dden`` takes the fp32 ratio
``(num + u) / (den + eps)``, not the 16-bit output, one rounding fewer in that term; the price is
keeping num (and u) until the backward.

Work and memory (per (batch, head), chunk C): the core call, the narrow calls (z; for "1+qk" u
and G), then one pass over the rows: O(N (Dk + Dv)), memory traffic reading q, z, num (u) and
writing o, with fp32 ``[B, H, N]`` den as the only temporary. Memory beyond the core call: z (and
u) in the input dtype and den; under autograd z, num (u) and den are kept for the backward. The
backward pass reads the incoming gradient, num (u), q and z and writes d_num, dq, dz (the parts
through den), which autograd adds to the core calls' gradients.

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

from .api import Array, _check_inputs, _check_scale, _is_number, _results, causal_linear_attention
from . import normalize_op

__all__ = ["linear_attention", "FEATURES"]

#: Accepted ``feature`` values: the similarity s(q, k) of the weights.
FEATURES = ("identity", "1+qk")


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


def _unit_keys(x: torch.Tensor) -> torch.Tensor:
    """Query and key rows e_1 = (1, 0, ..., 0) for ``x``'s leading three dims, a stride-0 view of one
    8-wide row: ``core(e, e, y)_i = sum_{j<=i} gamma^(i-j) y_j``. 8 wide, not 1: 16-byte rows let the
    kernel load the values with cp.async (1-wide rows send every operand through its element loader)."""
    return torch.nn.functional.pad(x.new_ones((1, 1, 1, 1)), (0, 7)).expand(*x.shape[:3], 8)


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
    ``eps = 0`` a zero denominator gives NaN or inf. In fp16 the core calls' outputs (num, z, u: sums
    of up to N weighted terms) overflow past 65504: with gamma = 1 and long sequences use bf16, fp32
    or a decay.

    Precision: the core calls run in the input dtype (fp16/bf16: the 16-bit kernels, fp32
    accumulation; num, z and u come back rounded to 16 bits); the row dots ``q_i . z_i``, G, the
    denominator, ``num + u`` and the division are fp32 for 16-bit inputs (one fused step), and the
    result is rounded once. Why, and measured errors, in the module docstring.

    Cost: the core call on q, k, v as given (no copy), plus narrow calls of the same operator with a
    query and key of unit rows e_1 (stride-0 views: no memory): z with Dk value columns, for
    ``"1+qk"`` also u with Dv value columns and G (``[1, H, N, 1]``, fp32); then one fused pass over
    the rows (:mod:`rtkernels.normalize_op`: one CUDA kernel, O(N (Dk + Dv)) per (batch, head),
    reading q, z, num (u) and writing o). Work O(N C (Dk + Dv) + N Dk Dv) with chunk C, as the core.
    A narrow call's memory traffic is reading k (or v) and writing z (or u); its arithmetic is that
    of a key as wide as the kernel's smallest key tile (64). Memory: the core's, plus z
    (``[..., Dk]``, input dtype) and for ``"1+qk"`` u (``[..., Dv]``), and den (fp32 ``[B, H, N]``);
    under autograd z, num (u) and den are kept for the backward. Backward: one fused pass (d_num,
    and dq, dz through den), then each call's backward is the core's (three kernel passes, which
    for the narrow calls also compute the unused gradients of the ones, and the decay-gradient
    kernel for a trainable decay); autograd adds the parts of dq and dk. Kernel limits: the
    core's, on the caller's heads (z has Dk value columns, u Dv, within them whenever the core call
    is). No ``initial_state``, ``return_state`` or ``cu_seqlens`` (yet).

    Gradients: with respect to q, k, v and a decay tensor that requires grad, through autograd (the
    fused step's backward, then each core call's own). Not twice differentiable.

    Raises:
        TypeError / ValueError naming the argument, as the core, and for ``normalize`` (not a bool),
        ``feature`` (not one of :data:`FEATURES`) and ``eps`` (not a real number, negative, or not
        finite). NaN is data: a NaN in q_i reaches row i; one in k_j or v_j the rows i >= j of that
        head (a NaN in v_j[c] only column c of them).
    """
    normalize, feature, eps = _check_options(normalize, feature, eps)
    scale = _check_scale(scale)
    qt, kt, vt, kind = _check_inputs(q, k, v, layout)  # [B, H, N, D] views; back to the caller's layout
    if kind != "torch":  # CuPy arrays or PyCUDA GPUArrays
        for name, d in (("decay", decay), ("decay_rate", decay_rate)):
            if isinstance(d, torch.Tensor) and d.requires_grad and torch.is_grad_enabled():
                raise TypeError(f"{name} requires grad, but q, k and v are CUDA arrays ({kind}) and the output "
                                f"is one too, which carries no gradient; pass torch tensors for q, k and v, "
                                f"or detach it")
    if layout == "bnhd":
        qt, kt, vt = (t.transpose(1, 2) for t in (qt, kt, vt))

    def core(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, s: float = 1.0,
             precision: Optional[str] = fp32_precision) -> torch.Tensor:
        """The decaying operator in the caller's layout, with the caller's decay arguments."""
        return causal_linear_attention(a, b, c, decay, decay_rate=decay_rate, scale=s, method=method, layout=layout,
                                       fp32_precision=precision)

    out = core(qt, kt, vt, scale)  # the caller's tensors as they are; the core checks everything else
    if feature == "identity" and not normalize:
        return _results(out, None, False, kind)
    ones = _unit_keys(qt)
    u = core(ones, ones, vt) if feature == "1+qk" else None
    if not normalize:  # "1+qk": core(q, k, v) + u (torch adds 16-bit tensors in fp32 and rounds once)
        return _results(out + u, None, False, kind)
    z = core(ones, ones, kt)
    g = None
    if feature == "1+qk":  # G_i = sum_{j<=i} gamma^(i-j): the operator on ones in fp32 (fp64), [1, H, N, 1] or
        # [1, N, H, 1]
        cdt = torch.float64 if qt.dtype == torch.float64 else torch.float32
        ones_c = torch.ones((1, 1, 1, 1), dtype=cdt, device=qt.device).expand(1, *qt.shape[1:3], 1)
        g = core(ones_c, ones_c, ones_c, precision="exact")
    # den = scale q.z (+ G) and o = (num (+ u)) / (den + eps): one fused pass (normalize_op)
    return _results(normalize_op.normalize(qt, z, out, u, g, scale, eps, layout), None, False, kind)
