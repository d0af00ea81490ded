"""Per-head decay: what the methods read as ``log(gamma)``, and what the kernels read directly.

A decay given as a Python number or a CPU tensor is known on the host: its values are checked
there and a float32 device tensor of ``log(gamma)`` is built once and cached by value, so a call
copies nothing to the device.

A decay given as a CUDA tensor stays where it is: no host sync, no copy, no extra launch. The
kernels read the caller's tensor (factors or rates, any float dtype and stride) and take the log
themselves (``cuda_src/include/head_decay.cuh``); the torch paths do the same with torch
operations. A value outside the domain (gamma not in (0, 1], a rate not in [0, inf), NaN) cannot
raise without a sync, so it becomes a NaN log(gamma): that head's outputs and state are NaN.
:func:`rtkernels.set_strict_decay` turns the check back on (one sync per call, ``ValueError``).

A decay tensor that requires grad also keeps ``source``, what autograd differentiates: a CUDA
tensor is its own source (``source_kind`` factors or rates; the backward applies the chain rule
itself, :meth:`LogDecay.source_grad`, so the forward runs no extra operation); a CPU tensor's
source is its clamped log(gamma) computed in torch operations (see :mod:`rtkernels.autograd`).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Optional

import torch

__all__ = ["LogDecay", "LOG_DECAY_MIN", "KIND_LOG", "KIND_FACTOR", "KIND_RATE", "decay_mode", "device_log",
           "set_strict_decay", "strict"]

_CACHE_SIZE = 256
#: log(gamma) is clamped to at least this: gamma^d with d >= 1 underflows to 0 in every float type
#: long before, so a larger rate changes nothing, while log(gamma) * 0 stays 0 (not -inf * 0 = NaN).
LOG_DECAY_MIN = -1.0e4
_cache: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()

#: What the values of a decay argument are (the ``RTK_DECAY_*`` kinds of ``head_decay.cuh``).
KIND_LOG, KIND_FACTOR, KIND_RATE = 0, 1, 2
_DTYPE_CODES = {torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3}
_strict = False


def set_strict_decay(enabled: bool) -> bool:
    """Check CUDA decay tensors on the host too (``True``): every call with one syncs the device
    once and raises ``ValueError`` for a value outside the domain, as for a float or CPU tensor;
    such calls are neither cached nor capturable in a CUDA graph. Off by default: an invalid value
    on the device makes that head's outputs NaN. Returns the previous setting (process-wide)."""
    global _strict
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    previous, _strict = _strict, enabled
    return previous


def strict() -> bool:
    """Whether :func:`set_strict_decay` is on."""
    return _strict


def decay_mode(dtype: torch.dtype, kind: int, stride: int) -> int:
    """The kernels' ``decay_mode``: element type | kind << 2 | element stride << 8."""
    return _DTYPE_CODES[dtype] | kind << 2 | stride << 8


def device_log(raw: torch.Tensor, kind: int, dtype: torch.dtype) -> torch.Tensor:
    """``log(gamma)`` of a decay tensor in torch operations (no sync), NaN where a value is outside
    the domain, clamped to :data:`LOG_DECAY_MIN`: what the kernels compute, for the torch paths."""
    x = raw.to(torch.float64)
    if kind == KIND_FACTOR:
        lg = torch.where((x > 0) & (x <= 1), torch.log(x), math.nan)
    else:
        lg = torch.where((x >= 0) & (x < math.inf), -x, math.nan)
    return lg.clamp(min=LOG_DECAY_MIN).to(dtype)  # clamp keeps NaN


def _cached(values: tuple[float, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    key = (device, dtype, values)
    t = _cache.get(key)
    if t is None:
        t = torch.tensor(values, dtype=dtype).to(device)
        _cache[key] = t
        if len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return t


class LogDecay:
    """``log(gamma_h)`` for every head (values <= 0, or NaN for a device value outside the
    domain), in whatever dtype a method asks for, and the argument the kernels read."""

    __slots__ = ("host", "raw", "kind", "device", "source", "source_kind", "_held")

    def __init__(self, device: torch.device, host: Optional[tuple[float, ...]] = None,
                 raw: Optional[torch.Tensor] = None, kind: int = KIND_FACTOR):
        self.device = device
        #: ``[H]`` log(gamma) with autograd history back to a decay tensor that requires grad, or None
        self.source: Optional[torch.Tensor] = None
        #: what ``source`` holds: KIND_LOG (log(gamma)), or KIND_FACTOR / KIND_RATE (the caller's tensor)
        self.source_kind = KIND_LOG
        # per-head log values known on the host, or None
        if host is not None and min(host, default=0.0) < LOG_DECAY_MIN:
            host = tuple(max(x, LOG_DECAY_MIN) for x in host)
        self.host = host
        # otherwise the caller's [H] tensor on the device (detached), factors or rates (kind)
        self.raw = raw
        self.kind = kind
        self._held: Optional[torch.Tensor] = None

    def tensor(self, dtype: torch.dtype) -> torch.Tensor:
        """``[H]`` tensor of log(gamma) on the device, in ``dtype`` (cached for host values)."""
        if self.host is not None:
            return _cached(self.host, self.device, dtype)
        return device_log(self.raw, self.kind, dtype)

    def kernel_arg(self) -> tuple[int, int]:
        """``(pointer, decay_mode)``: the decay argument of a kernel launch. The pointed-to tensor
        lives as long as this object (the host values' tensor is cached, the device one is the caller's)."""
        if self.host is not None:
            if self._held is None:  # held here: the value cache may drop it
                self._held = _cached(self.host, self.device, torch.float32)
            return self._held.data_ptr(), decay_mode(torch.float32, KIND_LOG, 1)
        return self.raw.data_ptr(), decay_mode(self.raw.dtype, self.kind, self.raw.stride(0))

    def source_grad(self, d_log: torch.Tensor) -> torch.Tensor:
        """dL/d``source`` from dL/dlog(gamma) (``[H]``): itself for a log source; for the caller's
        factors dL/dgamma = d_log / gamma, for rates dL/dr = -d_log, 0 where the forward clamped
        log(gamma) (a rate beyond 1e4), NaN where a value is outside the domain. In d_log's dtype
        (float64 arithmetic); the chain rule of ``rtk_chunk_decay_grad_sum`` in torch operations."""
        if self.source_kind == KIND_LOG:
            return d_log
        x, d = self.raw.to(torch.float64), d_log.to(torch.float64)
        if self.source_kind == KIND_FACTOR:
            g = torch.where((x > 0) & (x <= 1), d / x, math.nan)
        else:
            g = torch.where((x >= 0) & (x < math.inf), torch.where(-x >= LOG_DECAY_MIN, -d, 0.0), math.nan)
        return g.to(d_log.dtype)

    @staticmethod
    def from_rate_or_factor(x: float, is_rate: bool, h: int, device: torch.device) -> "LogDecay":
        return LogDecay(device, host=((-x if is_rate else math.log(x)),) * h)
