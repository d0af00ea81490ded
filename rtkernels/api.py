"""The public entry point: argument checking, layouts, decay normalisation and method dispatch."""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Optional, Union

import numpy as np
import torch

from .autograd import attention_with_grad, needs_grad, track_decay
from . import decay as _decay
from .decay import KIND_FACTOR, KIND_RATE, LogDecay
from . import call_cache, compiled_call
from . import varlen as _varlen
from .methods import METHODS, auto_method, run_method
from .methods.chunk import packed as _packed
from .jit.arrays import as_gpuarray, is_gpuarray
from .jit.dtypes import compute_dtype

__all__ = ["causal_linear_attention", "LAYOUTS", "METHOD_NAMES", "DTYPES"]

#: Accepted ``layout`` values and the axis order each names.
LAYOUTS = {"bhnd": "[B, H, N, D]", "bnhd": "[B, N, H, D]"}
#: Accepted ``method`` values.
METHOD_NAMES = (*METHODS, "auto")
#: Accepted input dtypes.
DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
#: Accepted ``fp32_precision`` values (None follows torch.get_float32_matmul_precision()).
FP32_PRECISIONS = ("exact", "tf32")

Array = Any  # a torch.Tensor or an object with __cuda_array_interface__ (e.g. a CuPy array)

#: The call as one ``torch.library`` op, set by :mod:`rtkernels.ops` (which imports this module):
#: taken while torch.compile / torch.export trace the call and for torch.func transforms (vmap,
#: grad); it returns NotImplemented for a call it leaves to the eager path. Eager calls never reach
#: it: their host cost stays that of the checks or the call cache.
op_call: Optional[Callable[..., Any]] = None
_MISS = compiled_call.MISS
_is_compiling = torch.compiler.is_compiling
_func_active = torch._C._are_functorch_transforms_active  # vmap's tensors have no storage to key by


def _is_number(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, (bool,)) and not hasattr(x, "__cuda_array_interface__") \
        and not isinstance(x, torch.Tensor)


def _to_torch(x: Any, name: str) -> tuple[torch.Tensor, str]:
    """(tensor, kind) with kind "torch", "pycuda" (a PyCUDA GPUArray) or "cupy" (any other CUDA
    array); TypeError for anything else."""
    if isinstance(x, torch.Tensor):
        return x, "torch"
    if hasattr(x, "__cuda_array_interface__"):
        kind = "pycuda" if is_gpuarray(x) else "cupy"
        try:
            return torch.from_dlpack(x), kind
        except Exception:  # an array type without DLPack support (GPUArray): its interface, no copy
            return torch.as_tensor(x, device="cuda"), kind
    raise TypeError(f"{name} must be a torch.Tensor or a CUDA array (an object with "
                    f"__cuda_array_interface__, e.g. a CuPy array), got {type(x).__name__}")


def _fmt_dtype(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _check_storage(t: torch.Tensor, name: str) -> None:
    """TypeError for a tensor the computation cannot read: sparse (or any non-strided layout) or
    without data (the meta device)."""
    if t.layout is not torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {str(t.layout).replace('torch.', '')}; "
                        f"convert it with .to_dense()")
    if t.device.type == "meta":
        raise TypeError(f"{name} must hold data (a CPU or CUDA tensor), got a tensor on the meta device")


def _check_inputs(q: Any, k: Any, v: Any, layout: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]:
    if not isinstance(layout, str):
        raise TypeError(f"layout must be a string, one of {', '.join(repr(x) for x in LAYOUTS)}; "
                        f"got {type(layout).__name__}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(repr(x) for x in LAYOUTS)}, got {layout!r}")
    converted = [_to_torch(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v"))]
    kinds = {kind for _, kind in converted}
    if len(kinds) > 1:
        raise TypeError("q, k and v must all be torch tensors or all be CUDA arrays (CuPy), got "
                        + ", ".join(f"{n} {kind}" for n, (_, kind) in zip("qkv", converted)))
    (qt, _), (kt, _), (vt, _) = converted
    axes = LAYOUTS[layout]
    for t, n, d in ((qt, "q", "Dk"), (kt, "k", "Dk"), (vt, "v", "Dv")):
        _check_storage(t, n)
        if t.dim() != 4:
            raise ValueError(f"{n} must be a 4-D tensor {axes.replace('D]', d + ']')} for layout={layout!r}, "
                             f"got {t.dim()}-D shape {tuple(t.shape)}")
        if t.dtype not in DTYPES:
            raise TypeError(f"{n} must have dtype float64, float32, float16 or bfloat16, got "
                            f"{_fmt_dtype(t.dtype)}")
    if not (qt.dtype == kt.dtype == vt.dtype):
        raise TypeError(f"q, k and v must share one dtype, got q {_fmt_dtype(qt.dtype)}, "
                        f"k {_fmt_dtype(kt.dtype)}, v {_fmt_dtype(vt.dtype)}")
    if not (qt.device == kt.device == vt.device):
        raise ValueError(f"q, k and v must be on one device, got q on {qt.device}, k on {kt.device}, "
                         f"v on {vt.device}")
    if layout == "bnhd":
        qt, kt, vt = (t.transpose(1, 2) for t in (qt, kt, vt))
    lead = tuple(qt.shape[:3])
    for t, n in ((kt, "k"), (vt, "v")):
        if tuple(t.shape[:3]) != lead:
            raise ValueError(f"{n} must have the batch, head and sequence sizes of q: expected "
                             f"(B, H, N) = {lead}, got {tuple(t.shape[:3])} (layout={layout!r})")
    if kt.shape[3] != qt.shape[3]:
        raise ValueError(f"k must have the key dimension Dk of q: expected {qt.shape[3]}, got {kt.shape[3]}")
    for t, n, d in ((qt, "q", "Dk"), (vt, "v", "Dv")):
        if t.shape[3] == 0:
            raise ValueError(f"{n} must have {d} >= 1, got shape {tuple(t.shape)}")
    return qt, kt, vt, next(iter(kinds))


_host_logs: dict[tuple[bool, tuple[float, ...]], tuple[float, ...]] = {}  # checked host decays


def _check_factor_or_rate(value: Any, name: str, h: int, device: torch.device) -> LogDecay:
    """Per-head log-decay from a decay factor or a decay rate, checked."""
    is_rate = name == "decay_rate"
    expect = "a rate r >= 0" if is_rate else "a factor gamma in (0, 1]"

    def ok(x: float) -> bool:  # NaN fails both
        return (0 <= x < math.inf) if is_rate else (0 < x <= 1)

    if isinstance(value, bool):
        raise TypeError(f"{name} must be a float or a tensor of shape [H] = [{h}], got bool")
    if _is_number(value):
        x = float(value)
        if not ok(x):
            raise ValueError(f"{name} must be {expect}, got {x}")
        return LogDecay.from_rate_or_factor(x, is_rate, h, device)
    if isinstance(value, torch.Tensor) or hasattr(value, "__cuda_array_interface__"):
        t, _ = _to_torch(value, name)
    else:
        how = "; wrap the values: torch.tensor(values)" if isinstance(value, (list, tuple, np.ndarray)) else ""
        raise TypeError(f"{name} must be a float or a tensor of shape [H] = [{h}], got {type(value).__name__}{how}")
    _check_storage(t, name)
    if not t.is_floating_point():
        raise TypeError(f"{name} must have a floating dtype, got {_fmt_dtype(t.dtype)}")
    if tuple(t.shape) != (h,):
        raise ValueError(f"{name} must be a float or a tensor of shape [H] = [{h}], got shape {tuple(t.shape)}")
    if t.device != device and t.device.type != "cpu":
        raise ValueError(f"{name} must be on the device of q ({device}) or on the CPU, got {t.device}")
    if t.requires_grad and torch.is_grad_enabled():  # a trainable decay: checked as a plain tensor, then tracked
        checked = _check_factor_or_rate(t.detach(), name, h, device)
        if checked.raw is None:  # a CPU tensor: its log in torch operations carries the gradient
            return track_decay(checked, t, is_rate)
        # a CUDA tensor is its own source: the backward applies the chain rule (no forward ops)
        checked.source, checked.source_kind = t, checked.kind
        return checked
    t = t.detach()
    if t.device.type == "cpu":  # checked on the host; nothing reaches the device but a cached tensor
        values = tuple(t.tolist())
        logs = _host_logs.get((is_rate, values))
        if logs is None:
            for x in values:
                if not ok(x):
                    raise ValueError(f"{name} must hold {expect} per head, got {x}")
            logs = tuple(-x if is_rate else math.log(x) for x in values)
            if len(_host_logs) > 256:
                _host_logs.clear()
            _host_logs[(is_rate, values)] = logs
        return LogDecay(device, host=logs)
    if _decay.strict():  # opt-in: the range check on the host, one sync
        x = t.to(torch.float64)
        good = (x >= 0) & (x < math.inf) if is_rate else (x > 0) & (x <= 1)
        if not bool(good.all()):
            raise ValueError(f"{name} must hold {expect} per head, got {x[~good][0].item()}")
    # read where it is: an invalid value makes that head's outputs NaN (rtkernels.decay)
    return LogDecay(device, raw=t, kind=KIND_RATE if is_rate else KIND_FACTOR)


def _log_decay(decay: Any, decay_rate: Any, h: int, device: torch.device) -> LogDecay:
    if decay is not None and decay_rate is not None:
        raise ValueError("pass decay (factors gamma) or decay_rate (rates r, gamma = exp(-r)), not both")
    if decay is not None:
        return _check_factor_or_rate(decay, "decay", h, device)
    if decay_rate is not None:
        return _check_factor_or_rate(decay_rate, "decay_rate", h, device)
    return LogDecay(device, host=(0.0,) * h)


def _check_state(initial_state: Any, q: torch.Tensor, v: torch.Tensor,
                 sequences: Optional[int] = None) -> Optional[torch.Tensor]:
    """The checked initial state: ``[B, H, Dk, Dv]``, or ``[S, H, Dk, Dv]`` for ``sequences`` = S
    packed sequences (``cu_seqlens``)."""
    if initial_state is None:
        return None
    s, _ = _to_torch(initial_state, "initial_state")
    _check_storage(s, "initial_state")
    first, letter = (q.shape[0], "B") if sequences is None else (sequences, "S")
    expected = (first, q.shape[1], q.shape[3], v.shape[3])
    if tuple(s.shape) != expected:
        why = "" if sequences is None else " (one state per sequence of cu_seqlens)"
        raise ValueError(f"initial_state must have shape [{letter}, H, Dk, Dv] = {list(expected)}{why}, "
                         f"got {tuple(s.shape)}")
    if s.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"initial_state must be float32 (or float64), got {_fmt_dtype(s.dtype)}")
    if s.device != q.device:
        raise ValueError(f"initial_state must be on the device of q ({q.device}), got {s.device}")
    return s


def _check_scale(scale: Any) -> float:
    """``scale`` as a float; TypeError for anything but a real number, ValueError unless finite."""
    if not _is_number(scale):
        raise TypeError(f"scale must be a real number, got {type(scale).__name__}")
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return scale


def _check_fp32_precision(value: Any) -> str:
    """"exact" or "tf32"; None follows torch's float32 matmul precision ("highest" -> "exact",
    "high" and "medium" -> "tf32")."""
    if value is None:
        return "exact" if torch.get_float32_matmul_precision() == "highest" else "tf32"
    if not isinstance(value, str):
        raise TypeError(f"fp32_precision must be None or a string, 'exact' or 'tf32'; "
                        f"got {type(value).__name__}")
    if value not in FP32_PRECISIONS:
        raise ValueError(f"fp32_precision must be None, 'exact' or 'tf32', got {value!r}")
    return value


def _cached_with_grad(hit: call_cache.CachedCall, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      decay: Any, initial_state: Optional[torch.Tensor]) -> Any:
    """A cached call with autograd history: the full path's autograd Function around the cached
    launch (the signature fixed everything the checks looked at; a CUDA decay tensor is wrapped
    afresh, being the Function's input)."""
    g = hit.grad
    log_decay = g.log_decay(decay)
    out, state = attention_with_grad(g.method, q, k, v, log_decay, g.scale, None, "bnhd" if g.bnhd else "bhnd",
                                     initial_state, g.return_state, g.fp32_precision, hit.launcher)
    return (out, state) if g.return_state else out


def _check_call_options(scale: Any, method: Any, return_state: Any) -> tuple[float, bool]:
    """The checked ``(scale, return_state)``; ``method`` is checked by name."""
    scale = _check_scale(scale)
    if not isinstance(method, str):
        raise TypeError(f"method must be a string, one of {', '.join(METHOD_NAMES)}; got {type(method).__name__}")
    if method not in METHOD_NAMES:
        raise ValueError(f"method must be one of {', '.join(repr(m) for m in METHOD_NAMES)}, got {method!r}")
    if not isinstance(return_state, (bool, np.bool_)):
        tp = type(return_state)
        tname = tp.__name__ if tp.__module__ == "builtins" else f"{tp.__module__}.{tp.__qualname__}"
        raise TypeError(f"return_state must be a bool, got {tname}")
    return scale, bool(return_state)


def _results(out: torch.Tensor, state: Optional[torch.Tensor], return_state: bool, kind: str) -> Any:
    """The call's return value: ``out`` or ``(out, state)``, as CuPy arrays (DLPack, no copy) when
    the inputs were CuPy arrays, as PyCUDA GPUArrays over the tensors' memory (no copy) when they
    were GPUArrays. Neither carries a gradient: a result with autograd history is a TypeError there,
    never a silent detach."""
    if kind != "torch" and torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (out, state)):
        raise TypeError(f"a tensor argument requires grad, but q, k and v are CUDA arrays ({kind}) and the output "
                        f"is one too, which carries no gradient; pass torch tensors for q, k and v, or detach it")
    if kind == "cupy":
        import cupy

        out = cupy.from_dlpack(out.detach())
        state = None if state is None else cupy.from_dlpack(state.detach())
    elif kind == "pycuda":
        out = as_gpuarray(out)
        state = None if state is None else as_gpuarray(state)
    return (out, state) if return_state else out


def _varlen_call(q: Any, k: Any, v: Any, decay: Any, decay_rate: Any, scale: Any, method: Any, layout: Any,
                 initial_state: Any, return_state: Any, fp32_precision: Any, cu_seqlens: Any) -> Any:
    """A call with ``cu_seqlens``: the same checks, then the chunk kernels for CUDA fp16/bf16/fp32
    inputs they take (:mod:`rtkernels.methods.chunk.packed`; a decay that requires grad excepted),
    else :func:`rtkernels.varlen.varlen_attention`, whatever ``method`` names. Never cached and
    never routed to the torch.library op: it reads nothing on the host; traced (torch.compile) or
    under a torch.func transform it runs the torch path, which traces as it is."""
    qt, kt, vt, kind = _check_inputs(q, k, v, layout)
    scale, return_state = _check_call_options(scale, method, return_state)
    if fp32_precision is not None:  # checked here; None is resolved only for the kernels (not while compiling)
        _check_fp32_precision(fp32_precision)
    b, h, n, _ = qt.shape
    if b != 1:
        raise ValueError(f"with cu_seqlens, q, k and v must hold the packed sequences in one batch: batch size 1, "
                         f"got B = {b} (shape {tuple(q.shape)}, layout={layout!r})")
    cu, _ = _to_torch(cu_seqlens, "cu_seqlens")
    _check_storage(cu, "cu_seqlens")
    sequences = _varlen.check_cu_seqlens(cu, n, qt.device)
    # a CPU tensor is validated here; while tracing, or on a device, invalid values give NaN instead
    checked = cu.device.type == "cpu" and not _is_compiling()
    if checked:
        _varlen.check_cu_seqlens_values(cu, n)
    log_decay = _log_decay(decay, decay_rate, h, qt.device)
    s0 = _check_state(initial_state, qt, vt, sequences)
    with_grad = needs_grad(kind, qt, kt, vt, s0, log_decay)  # (raises for CuPy inputs that need a gradient)
    if not (_is_compiling() or _func_active()) and _packed.takes(qt, kt, vt, log_decay):
        out, state = _packed.packed_attention(qt, kt, vt, cu, log_decay, scale, s0, return_state, layout == "bnhd",
                                              _check_fp32_precision(fp32_precision), with_grad)
        return _results(out, state, return_state, kind)
    out, state = _varlen.varlen_attention(qt, kt, vt, cu, log_decay, scale, s0, return_state, checked)
    out = out.transpose(1, 2).contiguous() if layout == "bnhd" else out
    return _results(out, state, return_state, kind)


def causal_linear_attention(
    q: Array, k: Array, v: Array, decay: Union[None, float, Array] = None, *,
    decay_rate: Union[None, float, Array] = None, scale: float = 1.0, method: str = "auto",
    layout: str = "bhnd", initial_state: Optional[Array] = None, return_state: bool = False,
    fp32_precision: Optional[str] = None, cu_seqlens: Optional[Array] = None,
) -> Any:
    r"""Exponentially decaying causal linear attention.

    .. math:: o_i = \text{scale} \sum_{j \le i} \gamma_h^{\,i-j} (q_i \cdot k_j)\, v_j

    equivalently ``S_i = gamma S_{i-1} + k_i^T v_i``, ``o_i = scale * q_i S_i``.

    Args:
        q, k: ``[B, H, N, Dk]`` (``layout="bhnd"``) or ``[B, N, H, Dk]`` (``layout="bnhd"``).
        v: ``[B, H, N, Dv]`` or ``[B, N, H, Dv]``; Dv independent of Dk.
            torch tensors in give a torch tensor out; CUDA arrays (CuPy) in give a CuPy array out.
            dtype float64, float32, float16 or bfloat16, the same for all three; one device.
        decay: None (gamma = 1, no decay), a float gamma in (0, 1], or a ``[H]`` tensor of
            factors (any float dtype and stride): ``M[i, j] = gamma ** (i - j)``. A float or a
            CPU tensor is checked on the host (``ValueError``). A CUDA tensor is read where it
            is, with no host sync and no copy (a CUDA graph can capture the call): a value
            outside (0, 1] or NaN makes that head's outputs and state NaN instead of raising;
            :func:`set_strict_decay` restores the check (one sync per call).
        decay_rate: the same as rates r >= 0: ``M[i, j] = exp(-r (i - j))``. Not with ``decay``.
        scale: multiplies the output.
        method: ``"vanilla"``, ``"recursion"``, ``"block"``, ``"fleet"``, ``"scan"``, ``"chunk"``
            or ``"auto"`` (see the README's methods table; every method gives the same answer).
        layout: ``"bhnd"`` or ``"bnhd"``.
        initial_state: optional ``[B, H, Dk, Dv]`` state to continue from (float32; float64 for
            float64 inputs), e.g. the final state of the previous piece of a sequence.
        return_state: also return the final state ``S_N`` (float32; float64 for float64 inputs).
        fp32_precision: how float32 inputs are multiplied where a CUDA kernel runs them on
            tensor cores (the ``chunk`` kernel): ``"exact"`` splits every operand x into two TF32
            numbers, hi = x truncated to TF32 and lo = tf32(x - hi), and forms each product from
            three TF32 products (3xTF32): fp32 accuracy (the tests require a relative error <= 1e-5).
            ``"tf32"`` rounds the operands to TF32 (10 mantissa bits) and uses one product:
            faster, relative error about 1e-3. ``None`` (default) follows
            ``torch.get_float32_matmul_precision()``: ``"highest"`` (torch's default) gives
            ``"exact"``, ``"high"`` and ``"medium"`` give ``"tf32"``. Other dtypes, the torch
            paths and the other kernels (fp32 FMAs) ignore it.
        cu_seqlens: packed variable-length sequences (:mod:`rtkernels.varlen`): q, k, v have batch
            size 1 and hold S sequences end to end; an int32 or int64 ``[S + 1]`` tensor on q's
            device, ``0 = cu[0] <= ... <= cu[S] = N``, sequence s being tokens ``cu[s] .. cu[s+1]-1``
            (empty ones allowed), each attending only within itself. ``initial_state`` and the
            returned state are then ``[S, H, Dk, Dv]`` (an empty sequence returns its initial state,
            or zeros). A CPU tensor's values are checked (``ValueError``); a CUDA tensor's are never
            read on the host (no sync, capturable): invalid values make every output and state NaN.
            Whatever ``method`` names, CUDA fp16/bf16/fp32 inputs the chunk kernel takes run it (one
            CTA per sequence, head and value tile; forward and backward; a decay that requires
            grad only in bf16 on Hopper, its gradient summed by the backward's first pass),
            everything else a torch path of work O(N C (Dk + Dv) + N Dk Dv) per
            head (:mod:`rtkernels.varlen`); such calls are not cached and, under torch.compile, are
            traced as torch operations (not the op).

    Returns:
        The output ``[B, H, N, Dv]`` (or ``[B, N, H, Dv]``) in the input dtype, contiguous in the
        input layout; with ``return_state=True`` the pair ``(output, final_state)``.

    Gradients: differentiable with respect to q, k, v, ``initial_state`` and a decay tensor that
    requires grad (``decay``: dL/dgamma, ``decay_rate``: dL/dr), whatever the method: the method's
    forward, then the chunked backward of :mod:`rtkernels.autograd`.

    Raises:
        TypeError / ValueError naming the argument for every malformed input. NaN inside q, k or v
        is data: it comes out as NaN in exactly the rows it reaches (q_i: row i; k_j, v_j: rows
        i >= j).
    """
    if cu_seqlens is not None:  # packed sequences: their own torch path, before the op route and the cache
        return _varlen_call(q, k, v, decay, decay_rate, scale, method, layout, initial_state, return_state,
                            fp32_precision, cu_seqlens)
    if (_is_compiling() or _func_active()) and op_call is not None:  # traced or transformed: one op
        res = op_call(q, k, v, decay, decay_rate, scale, method, layout, initial_state, return_state, fp32_precision)
        if res is not NotImplemented:
            return res
    compiled = compiled_call.module
    if compiled is not None:  # the compiled entry (rtkernels.compiled_call): the cached call in one C++ call
        res = compiled.call(q, k, v, decay, decay_rate, scale, method, layout, initial_state, return_state,
                            fp32_precision)
        if res is not _MISS:
            return res
    key = call_cache.call_key(q, k, v, decay, decay_rate, scale, method, layout, initial_state, return_state, fp32_precision)
    if key is not None:
        hit = call_cache.lookup(key)
        if hit is not None and hit.offered != compiled_call.generation:
            compiled_call.offer((q, k, v, decay, decay_rate, scale, method, layout, initial_state, return_state,
                                 fp32_precision), hit)
        if hit is not None and hit.grad is not None:
            return _cached_with_grad(hit, q, k, v, decay if decay_rate is None else decay_rate, initial_state)
        if hit is not None:
            out = torch.empty_like(v) if hit.like_v else torch.empty(hit.out_shape, dtype=hit.dtype, device=hit.device)
            # a CUDA decay tensor is read where it is: the launch takes its pointer
            state = hit.launcher(q, k, v, out, initial_state,
                                 (decay if decay_rate is None else decay_rate) if hit.device_decay else None)
            return (out, state) if return_state else out
    args = (q, k, v, decay, decay_rate, scale, method, layout, initial_state, return_state, fp32_precision)
    qt, kt, vt, kind = _check_inputs(q, k, v, layout)
    scale, return_state = _check_call_options(scale, method, return_state)
    fp32_precision = _check_fp32_precision(fp32_precision)
    b, h, n, _ = qt.shape
    dv = vt.shape[3]
    log_decay = _log_decay(decay, decay_rate, h, qt.device)
    s0 = _check_state(initial_state, qt, vt)

    if layout == "bhnd":
        out = torch.empty(b, h, n, dv, dtype=qt.dtype, device=qt.device)
        out_view = out
    else:
        out = torch.empty(b, n, h, dv, dtype=qt.dtype, device=qt.device)
        out_view = out.transpose(1, 2)
    if out.numel() == 0:
        state = None
        if return_state:
            sdt = compute_dtype(qt.dtype)
            state = (s0.to(sdt, copy=True) if s0 is not None else
                     torch.zeros(b, h, qt.shape[3], dv, dtype=sdt, device=qt.device))
        if needs_grad(kind, qt, kt, vt, s0, log_decay):  # empty, but still a function of the inputs
            tied = sum(t.sum() for t in (qt, kt, vt, s0, log_decay.source) if t is not None and t.requires_grad) * 0
            out = out + tied.to(out.dtype)
            state = None if state is None else state + tied.to(state.dtype)
    else:
        name = auto_method(qt, vt) if method == "auto" else method
        m = METHODS[name]
        if needs_grad(kind, qt, kt, vt, s0, log_decay):  # every method: its forward, then the chunked backward
            launcher = None
            if (key is not None and m.kernel_prepare is not None and m.uses_kernel(qt, vt)
                    and qt.stride(-1) == kt.stride(-1) == vt.stride(-1) == 1):  # plan, and cache the plan
                launcher = m.kernel_prepare(qt, kt, vt, log_decay, scale, out_view, return_state,
                                            fp32_precision=fp32_precision)
            given = (qt, kt, vt) if layout == "bhnd" else (t.transpose(1, 2) for t in (qt, kt, vt))
            out, state = attention_with_grad(name, *given, log_decay, scale, out, layout, s0, return_state,
                                             fp32_precision, launcher)
            if launcher is not None:
                device_decay = log_decay.raw is not None
                compiled_call.offer(args, call_cache.remember(key, launcher, out, v, device_decay, call_cache.GradCall(
                    name, scale, layout == "bnhd", return_state, fp32_precision,
                    None if device_decay else log_decay, log_decay.kind)))
        elif (key is not None and m.kernel_prepare is not None and m.uses_kernel(qt, vt)
              and qt.stride(-1) == kt.stride(-1) == vt.stride(-1) == 1):  # plan, run, and cache the plan
            launcher = m.kernel_prepare(qt, kt, vt, log_decay, scale, out_view, return_state,
                                        fp32_precision=fp32_precision)
            state = launcher(qt, kt, vt, out_view, s0)
            compiled_call.offer(args, call_cache.remember(key, launcher, out, v, log_decay.raw is not None))
        else:
            state = run_method(name, qt, kt, vt, log_decay, scale, out_view, s0, return_state,
                               fp32_precision=fp32_precision)
    return _results(out, state, return_state, kind)
