"""The cached call: a call whose signature (types, shapes, strides, dtypes, devices, 16-byte
alignment, decay, scale, method, layout, state arguments) equals that of an earlier call that
passed every check and ran a kernel with a planned launch repeats that launch with the new data
pointers; a call with autograd history (q, k, v, a CUDA decay tensor or the initial state requiring
grad) runs the same launch inside the autograd Function, whose backward is the full path's. Only calls that passed the checks are cached, and the signature holds everything the
checks and the plan depend on, so a cached call accepts exactly what the full path accepts.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from .decay import LogDecay, strict
from .methods import plan_epoch

__all__ = ["call_key", "lookup", "remember", "clear", "on_clear", "size", "CachedCall", "GradCall"]

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter  # a trainable decay: keyed as the tensor it is
_MAX = 512
_calls: dict[tuple, "CachedCall"] = {}
_NO_KEY = object()
_on_clear: list[Callable[[], None]] = []


class CachedCall:
    """A planned launch and how to allocate its output; for a call with autograd history
    (``grad``), what the autograd Function needs besides the tensors (:class:`GradCall`)."""

    __slots__ = ("launcher", "out_shape", "dtype", "device", "like_v", "device_decay", "grad", "offered")

    def __init__(self, launcher: Any, out: torch.Tensor, like_v: bool, device_decay: bool,
                 grad: Optional["GradCall"] = None):
        self.launcher, self.out_shape, self.dtype, self.device = launcher, tuple(out.shape), out.dtype, out.device
        self.like_v = like_v  # v is contiguous, so torch.empty_like(v) is the output (the cheaper call)
        self.device_decay = device_decay  # the decay is a CUDA tensor: each call passes its own
        self.grad = grad
        self.offered = -1  # the compiled entry's generation it was last offered to (rtkernels.compiled_call)


class GradCall:
    """The non-tensor part of a cached call that runs through the autograd Function: the method,
    scale, layout, state flag and float32 mode it resolved to, and its decay: the checked host
    :class:`~rtkernels.decay.LogDecay` (reused), or the kind of a CUDA decay tensor (each call wraps
    its own)."""

    __slots__ = ("method", "scale", "bnhd", "return_state", "fp32_precision", "host_decay", "decay_kind")

    def __init__(self, method: str, scale: float, bnhd: bool, return_state: bool, fp32_precision: str,
                 host_decay: Any, decay_kind: int):
        self.method, self.scale, self.bnhd, self.return_state = method, scale, bnhd, return_state
        self.fp32_precision, self.host_decay, self.decay_kind = fp32_precision, host_decay, decay_kind

    def log_decay(self, decay: Any) -> LogDecay:
        """The call's :class:`~rtkernels.decay.LogDecay`: the checked host one, or one around this
        call's CUDA decay tensor ``decay`` (its source too where it requires grad)."""
        if self.host_decay is not None:
            return self.host_decay
        log_decay = LogDecay(decay.device, raw=decay.detach(), kind=self.decay_kind)
        if decay.requires_grad:
            log_decay.source, log_decay.source_kind = decay, self.decay_kind
        return log_decay


def _decay_key(x: Any, grad: bool) -> Any:
    """The signature of a decay argument, or _NO_KEY (a CPU tensor that requires grad in grad mode,
    a CUDA tensor while strict checks are on, a CuPy array). A CUDA tensor that requires grad is
    keyed with that flag: it is the autograd Function's input itself, whatever its values."""
    if x is None:
        return None
    tp = type(x)
    if tp is float or tp is int:
        return (tp, x)
    if tp is not _Tensor and tp is not _Parameter:
        return _NO_KEY
    if x.is_cuda:  # read by the kernel where it is: its layout, not its values, shapes the launch
        return _NO_KEY if strict() else ("cuda", x.dtype, x.shape, x.stride(), x.get_device(), grad and x.requires_grad)
    if (grad and x.requires_grad) or x.device.type != "cpu" or x.layout is not torch.strided:
        return _NO_KEY  # a tracked CPU decay, or one the full path must name as wrong
    # a CPU tensor: by value (the checks and the cached log tensor depend on the values; a write
    # through .data or .numpy() leaves _version unchanged)
    return ("cpu", x.dtype, x.shape, tuple(x.tolist() if x.dim() == 1 else x.reshape(-1).tolist()))


def call_key(q: Any, k: Any, v: Any, decay: Any, decay_rate: Any, scale: Any, method: Any, layout: Any,
              initial_state: Any, return_state: Any, fp32_precision: Any = None) -> Optional[tuple]:
    """The signature of a call that may be cached, or None. For float32 inputs it holds the
    precision the call resolves to (``fp32_precision``, or torch's float32 matmul setting when it
    is None)."""
    if type(q) is not _Tensor or type(k) is not _Tensor or type(v) is not _Tensor:
        return None
    if fp32_precision is not None and type(fp32_precision) is not str:
        return None
    if fp32_precision is None and q.dtype is torch.float32:
        fp32_precision = ("torch", torch.get_float32_matmul_precision())
    if type(method) is not str or type(layout) is not str or type(return_state) is not bool:
        return None
    if type(scale) is not float and type(scale) is not int:
        return None
    grad = torch.is_grad_enabled()
    # which of q, k, v need a gradient: part of the signature (a call with autograd history is
    # cached apart from one without)
    flags = (q.requires_grad, k.requires_grad, v.requires_grad) if grad else None
    dk, dr = _decay_key(decay, grad), _decay_key(decay_rate, grad)
    if dk is _NO_KEY or dr is _NO_KEY:
        return None
    if initial_state is None:
        sk = None
    elif type(initial_state) is _Tensor:
        sk = (initial_state.shape, initial_state.stride(), initial_state.dtype, initial_state.get_device(),
              grad and initial_state.requires_grad)
    else:
        return None
    try:
        align = (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15
    except RuntimeError:  # no storage (sparse): the full path names what is wrong
        return None
    return (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype,
            q.get_device(), k.get_device(), v.get_device(), align,
            dk, dr, type(scale), scale, method, layout, sk, return_state, fp32_precision, flags, plan_epoch())


def remember(key: tuple, launcher: Any, out: torch.Tensor, v: torch.Tensor, device_decay: bool,
             grad: Optional[GradCall] = None) -> CachedCall:
    """Cache ``launcher`` under ``key`` and return the entry; ``device_decay``: it was planned for
    a CUDA decay tensor; ``grad``: the call runs through the autograd Function (what it needs
    besides the tensors)."""
    if len(_calls) >= _MAX:
        clear()  # (the compiled entry with it: it holds no call that is not cached here)
    hit = _calls[key] = CachedCall(launcher, out, v.is_contiguous() and v.shape == out.shape, device_decay, grad)
    return hit


def lookup(key: tuple) -> Optional[CachedCall]:
    """The cached call of signature ``key``, or None."""
    return _calls.get(key)


def clear() -> None:
    """Forget every cached call (and, through :func:`on_clear`'s hooks, what the compiled entry
    keeps of them)."""
    _calls.clear()
    for hook in _on_clear:
        hook()


def on_clear(hook: Callable[[], None]) -> None:
    """Run ``hook`` on each :func:`clear` (:mod:`rtkernels.compiled_call` forgets its calls)."""
    _on_clear.append(hook)


def size() -> int:
    """How many calls are cached."""
    return len(_calls)
