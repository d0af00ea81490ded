"""What every forward kernel launch shares: operand preparation and the kernels' parameters.

A forward kernel takes its seven pointers as ``__restrict__`` parameters, then one struct,
``rtk_fwd_shape`` (``cuda_src/include/params.cuh``; the chunk and scan kernels' structs embed it
first): H, N, Dk, Dv as 64-bit integers, the scale as a double, then the (batch, head, token)
element strides of q, k, v and o, and the ``decay_mode`` that says how to read the decay pointer
(:meth:`rtkernels.decay.LogDecay.kernel_arg`). :data:`FWD_FIELDS` names both in order and
:func:`fwd_args` builds them, here only: plain Python ints and floats that the launcher packs.

Reversed token order (``reverse=True``): the kernels address row n of every operand as
``pointer + n * token_stride`` with signed 64-bit strides, so the tensors read (and the output
written) from position N-1 down to 0 are the same memory with the pointer of row N-1 and the
token strides negated. No copy is made; the kernel's row n is the tensor's row N-1-n.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..decay import LogDecay

__all__ = ["FWD_FIELDS", "FWD_POINTERS", "operands", "unit_stride", "fwd_args", "fwd_tail", "row_address"]

#: The pointer parameters of a forward kernel, then the fields of ``rtk_fwd_shape`` (a test holds
#: them against the C sources).
FWD_FIELDS = ("q", "k", "v", "o", "decay", "init_state", "final_state", "H", "N", "Dk", "Dv", "scale",
              "q_sb", "q_sh", "q_sn", "k_sb", "k_sh", "k_sn", "v_sb", "v_sh", "v_sn", "o_sb", "o_sh", "o_sn",
              "decay_mode")
#: How many of :data:`FWD_FIELDS` are pointer parameters (the rest is the struct).
FWD_POINTERS = 7


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


def row_address(x: torch.Tensor, reverse: bool = False) -> int:
    """Address of the row the kernel reads first in a ``[B, H, N, D]`` view: token 0, or token N-1
    with ``reverse``."""
    return x.data_ptr() + (x.shape[2] - 1) * x.stride(2) * x.element_size() if reverse else x.data_ptr()


def fwd_tail(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, scale: float,
             decay_mode: int, reverse: bool = False) -> tuple:
    """The fields of ``rtk_fwd_shape``: sizes, scale, strides (token strides negated with
    ``reverse``) and how to read the decay argument (:meth:`LogDecay.kernel_arg`)."""
    _, h, n, dk = q.shape
    sgn = -1 if reverse else 1
    qs, ks, vs, os_ = q.stride(), k.stride(), v.stride(), out.stride()
    return (h, n, dk, v.shape[3], scale, qs[0], qs[1], sgn * qs[2], ks[0], ks[1], sgn * ks[2],
            vs[0], vs[1], sgn * vs[2], os_[0], os_[1], sgn * os_[2], decay_mode)


def fwd_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, log_decay: LogDecay,
             s0: Optional[torch.Tensor], final: Optional[torch.Tensor], scale: float) -> tuple:
    """The pointers and ``rtk_fwd_shape`` fields (:data:`FWD_FIELDS`), in token order (a reversed launch plans its
    pointers with :func:`row_address` and its strides with :func:`fwd_tail`)."""
    decay, mode = log_decay.kernel_arg()
    return (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), decay,
            0 if s0 is None else s0.data_ptr(), 0 if final is None else final.data_ptr(),
            *fwd_tail(q, k, v, out, scale, mode))
