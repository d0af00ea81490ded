"""Per-head decay, normalised once per call into ``log(gamma)`` and cached on the device.

A decay given as a Python number or a CPU tensor is known on the host: its log values are
checked there and the device tensor holding them is built once and cached by value, so a call
copies nothing to the device. A decay given as a CUDA tensor is checked with one device sync and
its log is taken on the device.

A decay tensor that requires grad also keeps ``source``: the same clamped log(gamma) as a
differentiable function of the caller's tensor (see :mod:`rtkernels.autograd`); the values the
methods compute with are the same, detached.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Optional

import torch

__all__ = ["LogDecay"]

_CACHE_SIZE = 256
#: log(gamma) is clamped to at least this: gamma^d with d >= 1 underflows to 0 in every float type
#: long before, so a larger rate changes nothing, while log(gamma) * 0 stays 0 (not -inf * 0 = NaN).
LOG_DECAY_MIN = -1.0e4
_cache: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()


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
    """``log(gamma_h)`` for every head (values <= 0), in whatever dtype a method asks for."""

    __slots__ = ("host", "device_values", "device", "source")

    def __init__(self, device: torch.device, host: Optional[tuple[float, ...]] = None,
                 device_values: Optional[torch.Tensor] = None):
        self.device = device
        #: ``[H]`` log(gamma) with autograd history back to a decay tensor that requires grad, or None
        self.source: Optional[torch.Tensor] = None
        # per-head log values known on the host, or None
        if host is not None and min(host, default=0.0) < LOG_DECAY_MIN:
            host = tuple(max(x, LOG_DECAY_MIN) for x in host)
        self.host = host
        # float64 [H] on the device otherwise
        self.device_values = None if device_values is None else device_values.clamp(min=LOG_DECAY_MIN)

    def tensor(self, dtype: torch.dtype) -> torch.Tensor:
        """``[H]`` tensor of log(gamma) on the device, in ``dtype`` (cached for host values)."""
        if self.host is not None:
            return _cached(self.host, self.device, dtype)
        return self.device_values.to(dtype)

    @staticmethod
    def from_rate_or_factor(x: float, is_rate: bool, h: int, device: torch.device) -> "LogDecay":
        return LogDecay(device, host=((-x if is_rate else math.log(x)),) * h)
