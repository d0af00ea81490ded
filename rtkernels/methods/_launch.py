"""What every forward kernel launch shares: operand preparation and the common arguments.

The kernels take ``RTK_FWD_PARAMS`` (``cuda_src/rtk_common.cuh``) first: seven pointers, then
H, N, Dk, Dv as 64-bit integers and the scale as a double, then the (batch, head, token) element
strides of q, k, v and o. Plain Python ints and floats are passed, so building the arguments
allocates nothing but the tuple.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..decay import LogDecay

__all__ = ["operands", "unit_stride", "fwd_args", "fwd_tail"]


def operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, initial_state: Optional[torch.Tensor],
             need_state: bool):
    """(q, k, v, s0, final): inputs with unit last stride (copied only if they lack it), the
    initial state as contiguous fp32 (or None), and an fp32 ``[B, H, Dk, Dv]`` final-state buffer
    when ``need_state`` (else None)."""
    q, k, v = unit_stride(q, k, v)
    s0 = None if initial_state is None else initial_state.to(torch.float32).contiguous()
    final = None
    if need_state:
        final = torch.empty(q.shape[0], q.shape[1], q.shape[3], v.shape[3], dtype=torch.float32,
                            device=q.device)
    return q, k, v, s0, final


def unit_stride(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors, each copied to contiguous memory only if its last stride is not 1."""
    return tuple(x if x.stride(-1) == 1 else x.contiguous() for x in xs)


def fwd_tail(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, scale: float) -> tuple:
    """The ``RTK_FWD_PARAMS`` arguments after the seven pointers: sizes, scale and strides."""
    _, h, n, dk = q.shape
    qs, ks, vs, os_ = q.stride(), k.stride(), v.stride(), out.stride()
    return (h, n, dk, v.shape[3], scale,
            qs[0], qs[1], qs[2], ks[0], ks[1], ks[2], vs[0], vs[1], vs[2], os_[0], os_[1], os_[2])


def fwd_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, log_decay: LogDecay,
             s0: Optional[torch.Tensor], final: Optional[torch.Tensor], scale: float) -> tuple:
    """The ``RTK_FWD_PARAMS`` argument tuple."""
    return (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
            log_decay.tensor(torch.float32).data_ptr(),
            0 if s0 is None else s0.data_ptr(), 0 if final is None else final.data_ptr(),
            *fwd_tail(q, k, v, out, scale))
