r"""The normalization step of :func:`rtkernels.linear_attention` as ``torch.library`` ops.

Given the core calls' results (:mod:`rtkernels.normalized`) -- ``num = core(q, k, v)``,
``z = core(1, 1, k)``, for ``"1+qk"`` also ``u = core(1, 1, v)`` and ``G`` (fp32) -- per (batch,
head, token) row i

    den_i = scale * q_i . z_i  (+ G_i)            o_i = (num_i (+ u_i)) / (den_i + eps)

``torch.ops.rtkernels.linear_attention_normalize(q, z, num, u, g, scale, eps, layout)`` returns
``(o, den)``: o like num (its dtype, the caller's layout, contiguous), den fp32 ``[B, H, N]``
(fp64 for fp64 inputs) without eps. Its backward, ``..._normalize_backward``, returns
``(d_num, dq, dz, dden)``, with ``d_u = d_num`` and ``dG`` the batch sum of dden; the gradients
of q, k, v and the decay through num, z, u and G are the core calls' own, through autograd.

On CUDA for fp32/fp16/bf16 each op is one kernel launch (``cuda_src/normalize/fwd.cu`` and
``bwd.cu``): no copy of operands whose last stride is 1 (both layouts are strided views), no host
sync, capturable in a CUDA graph. Elsewhere (the CPU, fp64, no compiler) :func:`torch_forward` and
:func:`torch_backward` compute the same formulas in torch operations: the reference the CPU tests
check. Both round each result once to its dtype from fp32 (fp64) values:

- forward: the dot's products and sum in fp32 (16-bit products are exact there), den and den + eps
  in fp32, num + u in fp32, an IEEE fp32 division, o rounded once.
- backward: ``d = den + eps``; ``d_num = g / d``; ``dden = -((g . s) / d) / d`` with ``s = num (+ u)``
  in fp32 -- the fp32 ratio ``s / d`` the forward rounded, not the rounded o (one rounding
  fewer, for the price of keeping num, and u, until the backward); ``dq = (dden scale) z``,
  ``dz = (dden scale) q``.

Both ops have fake implementations (torch.compile, torch.export) and ``vmap`` rules (the vmapped
dimension folded into the batch); the forward has ``register_autograd``. Not twice
differentiable.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .jit import KERNEL_DTYPES, dtype_code, get_function, kernels_available, launch
from .jit.dtypes import compute_dtype
from .methods._launch import unit_stride

__all__ = ["forward_op", "backward_op", "normalize", "torch_forward", "torch_backward", "kernel_takes",
           "instances", "SOURCES"]

SOURCES = ("normalize/fwd.cu", "normalize/bwd.cu")
_THREADS = 256  # RTK_NORM_THREADS
_FWD_POINTERS, _BWD_POINTERS = 7, 11


def _name(source: str, code: int, vec: bool, onepqk: bool) -> str:
    kernel = "rtk_normalize_fwd" if source == SOURCES[0] else "rtk_normalize_bwd"
    return f"{kernel}<{code}, {str(vec).lower()}, {str(onepqk).lower()}>"


def instances() -> dict[str, list[str]]:
    """Every template instance the two ops can ask for, by source (the CI compile test)."""
    return {src: [_name(src, code, vec, one) for code in sorted(KERNEL_DTYPES.values())
                  for vec in (False, True) for one in (False, True)] for src in SOURCES}


def kernel_takes(*xs: Optional[Tensor]) -> bool:
    """Whether the kernels take these operands: one CUDA device, one dtype the kernels have, a compiler."""
    xs = tuple(x for x in xs if x is not None)
    dt, dev = xs[0].dtype, xs[0].device
    return (dt in KERNEL_DTYPES and all(x.dtype == dt and x.device == dev for x in xs)
            and kernels_available(dev))


def _bhn(q: Tensor, layout: str) -> tuple[int, int, int]:
    return (q.shape[0], q.shape[1], q.shape[2]) if layout == "bhnd" else (q.shape[0], q.shape[2], q.shape[1])


def _caller(den: Tensor, layout: str) -> Tensor:
    """A ``[B, H, N]`` tensor as a view in the caller's token order (``[B, N, H]`` for bnhd)."""
    return den if layout == "bhnd" else den.transpose(1, 2)


# ------------------------------------------------------------------------------ the torch path

def torch_forward(q: Tensor, z: Tensor, num: Tensor, u: Optional[Tensor], g: Optional[Tensor], scale: float,
                  eps: float, layout: str) -> tuple[Tensor, Tensor]:
    """``(o, den)`` in torch operations, in fp32 for 16-bit and fp32 inputs (fp64 for fp64): the
    reference of the forward kernel. Works on the caller's layout (the formulas are per row)."""
    cdt = compute_dtype(q.dtype)
    den = torch.linalg.vecdot(q.to(cdt), z.to(cdt)) * scale  # [B, X, Y] in the caller's order
    if g is not None:
        den = den + g.to(cdt).squeeze(-1)
    s = num.to(cdt) if u is None else num.to(cdt) + u.to(cdt)
    o = (s / (den + eps).unsqueeze(-1)).to(num.dtype).contiguous()
    return o, _caller(den, layout).contiguous()


def torch_backward(grad: Tensor, q: Tensor, z: Tensor, num: Tensor, u: Optional[Tensor], den: Tensor,
                   grad_den: Optional[Tensor], scale: float, eps: float, layout: str, need_dq: bool,
                   need_dz: bool) -> tuple[Tensor, Optional[Tensor], Optional[Tensor], Tensor]:
    """``(d_num, dq, dz, dden)`` in torch operations (None for dq / dz not needed): the reference
    of the backward kernel."""
    cdt = den.dtype
    d = _caller(den, layout) + eps
    gc = grad.to(cdt)
    s = num.to(cdt) if u is None else num.to(cdt) + u.to(cdt)
    d_num = (gc / d.unsqueeze(-1)).to(num.dtype).contiguous()
    dd = -((torch.linalg.vecdot(gc, s) / d) / d)
    if grad_den is not None:
        dd = dd + _caller(grad_den.to(cdt), layout)
    sd = (dd * scale).unsqueeze(-1)
    dq = (sd * z.to(cdt)).to(q.dtype).contiguous() if need_dq else None
    dz = (sd * q.to(cdt)).to(z.dtype).contiguous() if need_dz else None
    return d_num, dq, dz, _caller(dd, layout).contiguous()


# -------------------------------------------------------------------------------- the kernels

def _view(x: Optional[Tensor], layout: str) -> Optional[Tensor]:
    """The ``[B, H, N, D]`` view of a caller-layout tensor."""
    return None if x is None or layout == "bhnd" else x.transpose(1, 2)


def _strides(x: Optional[Tensor]) -> tuple[int, int, int]:
    return (0, 0, 0) if x is None else tuple(x.stride()[:3])


def _vector(xs: tuple[Optional[Tensor], ...], dk: int, dv: int) -> bool:
    """16-byte chunks: every row start 16-byte aligned and both widths whole chunks."""
    per = 16 // next(x for x in xs if x is not None).element_size()
    if dk % per or dv % per:
        return False
    return all(x.data_ptr() % 16 == 0 and all(s % per == 0 for s, n in zip(x.stride()[:3], x.shape[:3]) if n > 1)
               for x in xs if x is not None)


def _team(chunks: int) -> int:
    """Lanes per row: the power of two >= the chunks of the wider row, at most a warp."""
    team = 1
    while team < min(chunks, 32):
        team *= 2
    return team


def _plan(xs: tuple[Optional[Tensor], ...], b: int, h: int, n: int, dk: int, dv: int) -> tuple[bool, int, int]:
    vec = _vector(xs, dk, dv)
    per = 16 // next(x for x in xs if x is not None).element_size() if vec else 1
    team = _team(max(dk, dv, 1) // per)
    grid = -(-(b * h * n) // (_THREADS // team))
    return vec, team, grid


def _g_view(g: Optional[Tensor], b: int, layout: str) -> Optional[Tensor]:
    """G ``[1 or B, X, Y, 1]`` (caller layout) as a float32 ``[B, H, N]`` view (batch stride 0 if shared)."""
    if g is None:
        return None
    g3 = g.squeeze(-1).to(torch.float32)
    return _caller(g3, layout).expand(b, -1, -1)


def _launch_forward(q: Tensor, z: Tensor, num: Tensor, u: Optional[Tensor], g: Optional[Tensor], o: Tensor,
                    den: Tensor, scale: float, eps: float, layout: str) -> None:
    """One launch of ``rtk_normalize_fwd`` writing o (caller layout) and den ``[B, H, N]``."""
    b, h, n = den.shape
    qv, zv, nv = unit_stride(*(x if layout == "bhnd" else _view(x, layout) for x in (q, z, num)))
    uv = None if u is None else unit_stride(u if layout == "bhnd" else _view(u, layout))[0]
    ov = o if layout == "bhnd" else _view(o, layout)
    gv = _g_view(g, b, layout)
    dk, dv = qv.shape[3], nv.shape[3]
    vec, team, grid = _plan((qv, zv, nv, uv, ov), b, h, n, dk, dv)
    dev = q.device.index
    fn = get_function(SOURCES[0], _name(SOURCES[0], dtype_code(q.dtype), vec, u is not None), dev)
    args = (qv.data_ptr(), zv.data_ptr(), nv.data_ptr(), 0 if uv is None else uv.data_ptr(),
            0 if gv is None else gv.data_ptr(), ov.data_ptr(), den.data_ptr(),
            b, h, n, dk, dv, float(scale), float(eps), *_strides(qv), *_strides(zv), *_strides(nv), *_strides(uv),
            *_strides(gv), *_strides(ov), 0, 0, 0, 0, 0, 0, team)
    launch(fn, (grid, 1, 1), (_THREADS, 1, 1), args, dev, pointers=_FWD_POINTERS)


def _launch_backward(grad: Tensor, q: Tensor, z: Tensor, num: Tensor, u: Optional[Tensor], den: Tensor,
                     grad_den: Optional[Tensor], d_num: Tensor, dq: Optional[Tensor], dz: Optional[Tensor],
                     dden: Optional[Tensor], scale: float, eps: float, layout: str) -> None:
    """One launch of ``rtk_normalize_bwd``: d_num, and dq, dz, dden where given (dq and dz
    contiguous in the caller's layout)."""
    b, h, n = den.shape
    view = (lambda x: x) if layout == "bhnd" else (lambda x: _view(x, layout))
    gv, qv, zv, nv = unit_stride(*(view(x) for x in (grad, q, z, num)))
    uv = None if u is None else unit_stride(view(u))[0]
    dnv = view(d_num)
    xv = None if dq is None and dz is None else view(dq if dq is not None else dz)
    dk, dv = qv.shape[3], nv.shape[3]
    vec, team, grid = _plan((gv, qv, zv, nv, uv, dnv, xv), b, h, n, dk, dv)
    dev = q.device.index
    fn = get_function(SOURCES[1], _name(SOURCES[1], dtype_code(q.dtype), vec, u is not None), dev)
    ptr = (lambda x: 0 if x is None else x.data_ptr())
    args = (gv.data_ptr(), nv.data_ptr(), ptr(uv), den.data_ptr(), ptr(grad_den), qv.data_ptr(), zv.data_ptr(),
            dnv.data_ptr(), ptr(dq), ptr(dz), ptr(dden),
            b, h, n, dk, dv, float(scale), float(eps), *_strides(qv), *_strides(zv), *_strides(nv), *_strides(uv),
            0, 0, 0, *_strides(dnv), *_strides(gv), *_strides(xv), team)
    launch(fn, (grid, 1, 1), (_THREADS, 1, 1), args, dev, pointers=_BWD_POINTERS)


# ------------------------------------------------------------------------------------ the ops

@torch.library.custom_op("rtkernels::linear_attention_normalize", mutates_args=())
def forward_op(q: Tensor, z: Tensor, num: Tensor, u: Optional[Tensor], g: Optional[Tensor], scale: float,
               eps: float, layout: str) -> tuple[Tensor, Tensor]:
    """``(o, den)``: o like num (contiguous, caller layout), den ``[B, H, N]`` fp32 (fp64)."""
    b, h, n = _bhn(q, layout)
    if kernel_takes(q, z, num, u) and (g is None or g.device == q.device):
        o = torch.empty(num.shape, dtype=num.dtype, device=num.device)
        den = torch.empty((b, h, n), dtype=torch.float32, device=q.device)
        if den.numel():
            _launch_forward(q, z, num, u, g, o, den, scale, eps, layout)
        return o, den
    return torch_forward(q, z, num, u, g, scale, eps, layout)


@forward_op.register_fake
def _forward_fake(q, z, num, u, g, scale, eps, layout):
    return num.new_empty(num.shape), q.new_empty(_bhn(q, layout), dtype=compute_dtype(q.dtype))


@torch.library.custom_op("rtkernels::linear_attention_normalize_backward", mutates_args=())
def backward_op(grad: Tensor, q: Tensor, z: Tensor, num: Tensor, u: Optional[Tensor], den: Tensor,
                grad_den: Optional[Tensor], scale: float, eps: float, layout: str, need_dq: bool, need_dz: bool,
                need_dden: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(d_num, dq, dz, dden)``: d_num like num, dq like q and dz like z (contiguous, caller
    layout), dden like den; dq, dz and dden empty ``[0]`` tensors unless needed."""
    if grad_den is not None:
        grad_den = grad_den.to(den.dtype).contiguous()
    if kernel_takes(grad, q, z, num, u) and den.dtype == torch.float32 and den.is_contiguous():
        d_num = torch.empty(num.shape, dtype=num.dtype, device=num.device)
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device) if need_dq else None
        dz = torch.empty(z.shape, dtype=z.dtype, device=z.device) if need_dz else None
        dden = torch.empty_like(den) if need_dden else None
        if den.numel():
            _launch_backward(grad, q, z, num, u, den, grad_den, d_num, dq, dz, dden, scale, eps, layout)
    else:
        d_num, dq, dz, dden = torch_backward(grad, q, z, num, u, den, grad_den, scale, eps, layout, need_dq, need_dz)
    return (d_num, dq if need_dq else q.new_empty(0), dz if need_dz else z.new_empty(0),
            dden if need_dden else den.new_empty(0))  # separate empties: returns may not alias


@backward_op.register_fake
def _backward_fake(grad, q, z, num, u, den, grad_den, scale, eps, layout, need_dq, need_dz, need_dden):
    return (num.new_empty(num.shape), q.new_empty(q.shape) if need_dq else q.new_empty(0),
            z.new_empty(z.shape) if need_dz else z.new_empty(0), den.new_empty(den.shape) if need_dden
            else den.new_empty(0))


def _setup_context(ctx, inputs, output) -> None:
    q, z, num, u, g, scale, eps, layout = inputs
    ctx.save_for_backward(q, z, num, u, output[1])
    ctx.args = (scale, eps, layout, None if g is None else tuple(g.shape))
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_o: Optional[Tensor], grad_den: Optional[Tensor]):
    q, z, num, u, den = ctx.saved_tensors
    scale, eps, layout, g_shape = ctx.args
    need = ctx.needs_input_grad
    need_dden = g_shape is not None and bool(need[4])
    if grad_o is None:  # only den was used
        grad_o = torch.zeros_like(num)
    d_num, dq, dz, dden = backward_op(grad_o, q, z, num, u, den, grad_den, scale, eps, layout, bool(need[0]),
                                      bool(need[1]), need_dden)
    dg = _caller(dden, layout).unsqueeze(-1).sum_to_size(g_shape) if need_dden else None
    return (dq if need[0] else None, dz if need[1] else None, d_num if need[2] else None,
            d_num if u is not None and need[3] else None, dg, None, None, None)


forward_op.register_autograd(_backward, setup_context=_setup_context)


def _no_double_backward(ctx, *grads):
    raise RuntimeError("rtkernels.linear_attention is not twice differentiable: the backward of its "
                       "normalization has no backward")


backward_op.register_autograd(_no_double_backward, setup_context=lambda ctx, inputs, output: None)


def _fold(x: Optional[Tensor], dim: Optional[int], size: int) -> Optional[Tensor]:
    """``x`` with the vmapped dimension (None: not batched, expanded) folded into the batch dimension."""
    if x is None:
        return None
    x = x.movedim(dim, 0) if dim is not None else x.unsqueeze(0).expand(size, *x.shape)
    return x.reshape(size * x.shape[1], *x.shape[2:])


def _fold_g(g: Optional[Tensor], dim: Optional[int], size: int, b: int) -> Optional[Tensor]:
    """G folded like the rows: shared by the batch (size 1) stays shared when vmap did not batch it."""
    if g is None or (dim is None and g.shape[0] == 1):
        return g
    g = g.movedim(dim, 0) if dim is not None else g.unsqueeze(0).expand(size, *g.shape)
    return g.expand(size, b, *g.shape[2:]).reshape(size * b, *g.shape[2:])


def _unfold(x: Tensor, size: int) -> Tensor:
    return x.reshape(size, x.shape[0] // size, *x.shape[1:])


@forward_op.register_vmap
def _forward_vmap(info, in_dims, q, z, num, u, g, scale, eps, layout):
    size = info.batch_size
    q, z, num, u = (_fold(x, d, size) for x, d in zip((q, z, num, u), in_dims[:4]))
    g = _fold_g(g, in_dims[4], size, q.shape[0] // size)
    o, den = forward_op(q, z, num, u, g, scale, eps, layout)
    return (_unfold(o, size), _unfold(den, size)), (0, 0)


@backward_op.register_vmap
def _backward_vmap(info, in_dims, grad, q, z, num, u, den, grad_den, scale, eps, layout, need_dq, need_dz,
                   need_dden):
    size = info.batch_size
    grad, q, z, num, u, den, grad_den = (_fold(x, d, size) for x, d in zip((grad, q, z, num, u, den, grad_den),
                                                                          in_dims[:7]))
    res = backward_op(grad, q, z, num, u, den, grad_den, scale, eps, layout, need_dq, need_dz, need_dden)
    return tuple(_unfold(x, size) if x.numel() or x.dim() > 1 else x for x in res), \
        tuple(0 if x.numel() or x.dim() > 1 else None for x in res)


def normalize(q: Tensor, z: Tensor, num: Tensor, u: Optional[Tensor], g: Optional[Tensor], scale: float,
              eps: float, layout: str) -> Tensor:
    """``o = (num (+ u)) / (scale q.z (+ G) + eps)`` per row, through :data:`forward_op`; q, z, num, u in the
    caller's layout, G ``[1 or B, ..., 1]`` in it too (fp32; fp64 for fp64 inputs)."""
    return forward_op(q, z, num, u, g, scale, eps, layout)[0]
