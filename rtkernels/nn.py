r"""``rtkernels.nn``: a RetNet-style retention layer built on :func:`rtkernels.causal_linear_attention`.

:class:`DecayingLinearAttention` is multi-scale retention as in RetNet (Sun et al., 2023) without
the rotary (xPos) position encoding: per head h, with ``x`` the ``[B, N, dim]`` input,

    q, k, v, g = x W_q, x W_k, x W_v, x W_g                    (one fused projection)
    o_i = scale * sum_{j <= i} gamma_h^(i-j) (q_i . k_j) v_j   (rtkernels.causal_linear_attention)
    y   = (swish(g) * GroupNorm_H(o)) W_o

Training and prefill run :func:`rtkernels.causal_linear_attention` on the whole sequence;
generation runs :func:`rtkernels.decode` against a pool of fp32 states ``[S, H, Dk, Dv]``
updated in place, so a token costs O(H Dk Dv) whatever the length of the sequence before it.

This module imports only the public modules :mod:`rtkernels.api` and :mod:`rtkernels.decode`
(imports go one way: nothing in the package imports ``rtkernels.nn``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from .api import METHOD_NAMES, causal_linear_attention
from .decode import decode

__all__ = ["DecayingLinearAttention", "retnet_decay", "MAX_DECAY_RATE"]

#: The largest decay rate a trainable decay reaches (gamma = exp(-1e4) is 0 in every float type
#: anyway); the cap keeps exp(p) finite whatever step the optimizer takes.
MAX_DECAY_RATE = 1.0e4

#: A decay argument: None (RetNet's), one factor for every head, or one per head.
DecayArg = Union[None, float, Sequence[float], torch.Tensor]


def retnet_decay(num_heads: int) -> torch.Tensor:
    """RetNet's per-head decay factors ``gamma_h = 1 - 2^(-5 - h)``, h = 0 .. H-1, as float64
    ``[H]``: memories of about 32, 64, 128, ... tokens."""
    return 1 - 2.0 ** (-5 - torch.arange(num_heads, dtype=torch.float64))


def _positive_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def _decay_rates(decay: DecayArg, num_heads: int, trainable: bool) -> torch.Tensor:
    """The checked decay factors as float64 rates ``r_h = -log(gamma_h)`` ``[H]``."""
    if decay is None:
        gamma = retnet_decay(num_heads)
    else:
        try:  # a float, a sequence of floats, a tensor or an array; checked by value below
            if isinstance(decay, (bool, str)):
                raise TypeError(type(decay).__name__)
            gamma = torch.as_tensor(decay, dtype=torch.float64).detach().cpu()
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(f"decay must be None, a float, or {num_heads} floats (one per head), "
                            f"got {type(decay).__name__}") from None
        if gamma.dim() == 0:
            gamma = gamma.expand(num_heads).clone()
        if tuple(gamma.shape) != (num_heads,):
            raise ValueError(f"decay must be a float or hold one factor per head, shape [{num_heads}], "
                             f"got shape {tuple(gamma.shape)}")
    bad = ~((gamma > 0) & (gamma <= 1))  # NaN is bad too
    if bool(bad.any()):
        raise ValueError(f"decay must hold factors gamma in (0, 1], got {gamma[bad][0].item()}")
    if trainable and bool((gamma == 1).any()):
        # the trainable parametrization gamma = exp(-exp(p)) reaches 1 only at p = -inf
        raise ValueError("decay must be < 1 on every head when trainable_decay=True (gamma = exp(-exp(p)) "
                         "never reaches 1), got 1.0")
    return -torch.log(gamma)


class DecayingLinearAttention(nn.Module):
    r"""Multi-scale retention (RetNet without xPos): exponentially decaying causal linear
    attention with one decay factor per head, a per-head GroupNorm and a swish output gate.

    For an input ``x`` ``[B, N, dim]`` and each head h (H heads, key size Dk, value size Dv):

    .. math::

        q, k, v, g &= x W_q,\ x W_k,\ x W_v,\ x W_g \\
        o_i &= \text{scale} \sum_{j \le i} \gamma_h^{\,i-j} (q_i \cdot k_j)\, v_j
              \qquad (S_i = \gamma_h S_{i-1} + k_i^\top v_i,\ o_i = \text{scale}\; q_i S_i) \\
        y &= \big(\operatorname{swish}(g) \odot \operatorname{GroupNorm}_H(o)\big) W_o

    Cost per forward: the projections, O(B N dim H (2 Dk + 2 Dv)) multiply-adds in one GEMM in
    and O(B N H Dv dim) out, and the attention core, O(B H N (C (Dk + Dv) + Dk Dv)) with the
    chunked kernel (chunk C = 64), linear in N. A :meth:`step` of T tokens costs the same
    projections for T tokens plus O(B H T Dk Dv) and one read and write of each sequence's fp32
    state ``[H, Dk, Dv]``, independent of how many tokens came before.

    Args:
        dim: model width (input and output features).
        num_heads: heads H.
        head_dim_k: key/query size Dk per head; default ``dim // num_heads`` (then ``dim`` must be
            a multiple of ``num_heads``).
        head_dim_v: value size Dv per head; default Dk.
        decay: per-head decay factors gamma in (0, 1]: a float for every head, or H floats (a
            sequence or tensor). Default RetNet's ``1 - 2^(-5 - h)``.
        trainable_decay: learn the decay. The parameter ``log_decay_rate`` holds p = log r per
            head, with gamma = exp(-r) = exp(-exp(p)), so every optimizer step keeps gamma in (0, 1] (r is
            capped at ``MAX_DECAY_RATE``, and reaches 0 only where exp(p) underflows); the
            initial decay must be < 1. Otherwise the rates r = -log gamma are a buffer.
        group_norm: normalize each head's output over its Dv values (``GroupNorm(H, H Dv)``,
            affine), as RetNet does. Without it the output grows like ``1 / (1 - gamma)``.
        output_gate: multiply by ``swish(x W_g)`` before the output projection.
        bias: add biases to the input and output projections.
        method: the ``method`` of :func:`rtkernels.causal_linear_attention` (``"auto"``: the
            tuned or heuristic choice). :meth:`step` always runs :func:`rtkernels.decode`.
        scale: multiplies the attention output; default ``Dk ** -0.5``.
        device, dtype: of the parameters (the decay rates stay float32, float64 for float64).

    The layer works on the projections' natural ``[B, N, H, D]`` shape (``layout="bnhd"``), so q,
    k and v are views of the fused projection and nothing is transposed or copied.
    """

    def __init__(self, dim: int, num_heads: int, head_dim_k: Optional[int] = None, head_dim_v: Optional[int] = None,
                 decay: DecayArg = None, trainable_decay: bool = False, group_norm: bool = True,
                 output_gate: bool = True, bias: bool = False, method: str = "auto", scale: Optional[float] = None,
                 device: Union[None, str, torch.device] = None, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        dim = _positive_int(dim, "dim")
        num_heads = _positive_int(num_heads, "num_heads")
        if head_dim_k is None:
            if dim % num_heads:
                raise ValueError(f"dim must be a multiple of num_heads when head_dim_k is None, got dim={dim}, "
                                 f"num_heads={num_heads}")
            head_dim_k = dim // num_heads
        head_dim_k = _positive_int(head_dim_k, "head_dim_k")
        head_dim_v = head_dim_k if head_dim_v is None else _positive_int(head_dim_v, "head_dim_v")
        if not isinstance(method, str):
            raise TypeError(f"method must be a string, got {type(method).__name__}")
        if method not in METHOD_NAMES:
            raise ValueError(f"method must be one of {', '.join(repr(m) for m in METHOD_NAMES)}, got {method!r}")
        if scale is None:
            scale = head_dim_k ** -0.5
        elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TypeError(f"scale must be None or a real number, got {type(scale).__name__}")
        if not math.isfinite(scale):
            raise ValueError(f"scale must be finite, got {scale}")
        for flag, name in ((trainable_decay, "trainable_decay"), (group_norm, "group_norm"),
                           (output_gate, "output_gate"), (bias, "bias")):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")

        self.dim, self.num_heads, self.head_dim_k, self.head_dim_v = dim, num_heads, head_dim_k, head_dim_v
        self.method, self.scale = method, float(scale)
        self.trainable_decay, self.output_gate = trainable_decay, output_gate
        factory = {"device": device, "dtype": dtype}
        # q, k, v (and the gate) in one GEMM; forward() splits it into [B, N, H, D] views
        self._split = (num_heads * head_dim_k, num_heads * head_dim_k, num_heads * head_dim_v) \
            + ((num_heads * head_dim_v,) if output_gate else ())
        self.in_proj = nn.Linear(dim, sum(self._split), bias=bias, **factory)
        self.out_proj = nn.Linear(num_heads * head_dim_v, dim, bias=bias, **factory)
        self.norm = nn.GroupNorm(num_heads, num_heads * head_dim_v, **factory) if group_norm else None

        rates = _decay_rates(decay, num_heads, trainable_decay)
        rate_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        if trainable_decay:
            self.log_decay_rate = nn.Parameter(torch.log(rates).to(device=device, dtype=rate_dtype))
        else:
            # on the module's device: the kernels read it there, with no host sync or copy per call
            self.register_buffer("decay_rate", rates.to(device=device, dtype=rate_dtype))

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, num_heads={self.num_heads}, head_dim_k={self.head_dim_k}, "
                f"head_dim_v={self.head_dim_v}, trainable_decay={self.trainable_decay}, "
                f"group_norm={self.norm is not None}, output_gate={self.output_gate}, method={self.method!r}, "
                f"scale={self.scale:g}")

    def rates(self) -> torch.Tensor:
        """The per-head decay rates r = -log(gamma) ``[H]`` (differentiable when trainable)."""
        if self.trainable_decay:
            return torch.exp(self.log_decay_rate.clamp(max=math.log(MAX_DECAY_RATE)))
        return self.decay_rate

    def decay(self) -> torch.Tensor:
        """The per-head decay factors gamma = exp(-r) ``[H]``, each in (0, 1] (a rate past the
        float range's log prints as 0)."""
        return torch.exp(-self.rates())

    def init_state(self, batch: int, device: Union[None, str, torch.device] = None) -> torch.Tensor:
        """Zeros ``[batch, H, Dk, Dv]`` in float32 (the empty prefix), on ``device`` (default: the
        layer's). Also a pool for :meth:`step` with ``batch`` rows."""
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 0:
            raise ValueError(f"batch must be an int >= 0, got {batch!r}")
        if device is None:
            device = self.out_proj.weight.device
        return torch.zeros(batch, self.num_heads, self.head_dim_k, self.head_dim_v, dtype=torch.float32,
                           device=device)

    def _qkvg(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x ``[B, T, dim]`` -> q, k ``[B, T, H, Dk]``, v (and g) ``[B, T, H, Dv]``: views of one GEMM."""
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"x must have shape [B, N, dim] with dim = {self.dim}, got {tuple(x.shape)}")
        b, t, _ = x.shape
        parts = self.in_proj(x).split(self._split, dim=-1)
        return [p.view(b, t, self.num_heads, -1) for p in parts]

    def _output(self, o: torch.Tensor, gate: Optional[torch.Tensor]) -> torch.Tensor:
        """Attention output ``[B, T, H, Dv]`` -> ``[B, T, dim]``: GroupNorm, gate, projection."""
        b, t = o.shape[:2]
        o = o.reshape(b, t, -1)
        if self.norm is not None:  # GroupNorm wants channels second: normalize the [B*T, H*Dv] rows
            o = self.norm(o.reshape(b * t, -1)).view(b, t, -1)
        if gate is not None:
            o = F.silu(gate.reshape(b, t, -1)) * o
        return self.out_proj(o)

    def forward(self, x: torch.Tensor, state: Optional[torch.Tensor] = None,
                return_state: bool = False) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The layer on whole sequences (training, prefill).

        Args:
            x: ``[B, N, dim]``.
            state: optional ``[B, H, Dk, Dv]`` float32 state to continue from (the final state of
                the previous piece of each sequence); default zeros.
            return_state: also return the final state ``S_N`` ``[B, H, Dk, Dv]`` (float32;
                float64 for a float64 layer), e.g. to prefill a pool for :meth:`step`.

        Returns:
            ``y`` ``[B, N, dim]`` in the projections' dtype, or ``(y, final_state)``.

        Differentiable with respect to x, the weights, ``state`` and a trainable decay.
        """
        q, k, v, *gate = self._qkvg(x)
        res = causal_linear_attention(q, k, v, decay_rate=self.rates(), scale=self.scale, method=self.method,
                                      layout="bnhd", initial_state=state, return_state=return_state)
        o, final = res if return_state else (res, None)
        y = self._output(o, gate[0] if gate else None)
        return (y, final) if return_state else y

    @torch.no_grad()
    def step(self, x: torch.Tensor, state: torch.Tensor, state_indices: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Generation: T >= 1 new tokens per sequence against a pool of states, updated in place.

        Sequence b continues from row ``state_indices[b]`` of ``state`` (row b when None) and
        leaves its state after the T tokens there; the output equals what :meth:`forward` gives
        at those positions of the whole sequence. Runs under ``torch.no_grad()`` (the in-place
        step has no backward; train with :meth:`forward`).

        Args:
            x: ``[B, T, dim]``, the new tokens' inputs.
            state: the pool ``[S, H, Dk, Dv]`` float32 on the layer's device, e.g. from
                :meth:`init_state`, or filled with ``forward(prompt, return_state=True)``'s final
                state under ``torch.no_grad()`` or detached (a pool that requires grad is refused).
            state_indices: None or an int32 ``[B]`` tensor on the layer's device: the row of each
                sequence; a negative index is padding (no state read or written; that sequence's
                output is meaningless).

        Returns:
            ``[B, T, dim]``.

        Cost: the projections of T tokens plus O(B H T Dk Dv); on a GPU the attention part is
        one :func:`rtkernels.decode` launch with no host sync.
        """
        q, k, v, *gate = self._qkvg(x)
        o = decode(q, k, v, state, decay_rate=self.rates(), scale=self.scale, state_indices=state_indices,
                   layout="bnhd")
        return self._output(o, gate[0] if gate else None)
