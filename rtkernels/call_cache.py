"""The cached call: a call whose signature (types, shapes, strides, dtypes, devices, 16-byte
alignment, decay, scale, method, layout, state arguments) equals that of an earlier call that
passed every check and ran a kernel with a planned launch repeats that launch with the new data
pointers. Only calls that passed the checks are cached, and the signature holds everything the
checks and the plan depend on, so a cached call accepts exactly what the full path accepts.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .decay import strict
from .methods import plan_epoch

__all__ = ["call_key", "lookup", "remember", "clear", "size", "CachedCall"]

_Tensor = torch.Tensor
_MAX = 512
_calls: dict[tuple, "CachedCall"] = {}
_NO_KEY = object()


class CachedCall:
    """A planned launch and how to allocate its output."""

    __slots__ = ("launcher", "out_shape", "dtype", "device", "like_v", "device_decay")

    def __init__(self, launcher: Any, out: torch.Tensor, like_v: bool, device_decay: bool):
        self.launcher, self.out_shape, self.dtype, self.device = launcher, tuple(out.shape), out.dtype, out.device
        self.like_v = like_v  # v is contiguous, so torch.empty_like(v) is the output (the cheaper call)
        self.device_decay = device_decay  # the decay is a CUDA tensor: each call passes its own


def _decay_key(x: Any, grad: bool) -> Any:
    """The signature of a decay argument, or _NO_KEY (one that requires grad in grad mode, a CUDA
    tensor while strict checks are on, a CuPy array)."""
    if x is None:
        return None
    tp = type(x)
    if tp is float or tp is int:
        return (tp, x)
    if tp is not _Tensor or (grad and x.requires_grad):
        return _NO_KEY
    if x.is_cuda:  # read by the kernel where it is: its layout, not its values, shapes the launch
        return _NO_KEY if strict() else ("cuda", x.dtype, x.shape, x.stride(), x.get_device())
    if x.device.type != "cpu" or x.layout is not torch.strided:  # the full path says what is wrong
        return _NO_KEY
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
    if grad and (q.requires_grad or k.requires_grad or v.requires_grad):
        return None
    dk, dr = _decay_key(decay, grad), _decay_key(decay_rate, grad)
    if dk is _NO_KEY or dr is _NO_KEY:
        return None
    if initial_state is None:
        sk = None
    elif type(initial_state) is _Tensor and not (grad and initial_state.requires_grad):
        sk = (initial_state.shape, initial_state.stride(), initial_state.dtype, initial_state.get_device())
    else:
        return None
    try:
        align = (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15
    except RuntimeError:  # no storage (sparse): the full path names what is wrong
        return None
    return (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype,
            q.get_device(), k.get_device(), v.get_device(), align,
            dk, dr, type(scale), scale, method, layout, sk, return_state, fp32_precision, plan_epoch())


def remember(key: tuple, launcher: Any, out: torch.Tensor, v: torch.Tensor, device_decay: bool) -> None:
    """Cache ``launcher`` under ``key``; ``device_decay``: it was planned for a CUDA decay tensor."""
    if len(_calls) >= _MAX:
        _calls.clear()
    _calls[key] = CachedCall(launcher, out, v.is_contiguous() and v.shape == out.shape, device_decay)


def lookup(key: tuple) -> Optional[CachedCall]:
    """The cached call of signature ``key``, or None."""
    return _calls.get(key)


def clear() -> None:
    """Forget every cached call."""
    _calls.clear()


def size() -> int:
    """How many calls are cached."""
    return len(_calls)
