"""Element type codes shared with ``cuda_src/include/types.cuh`` (``RTK_F32``, ``RTK_F16``, ``RTK_BF16``)."""

from __future__ import annotations

import torch

__all__ = ["KERNEL_DTYPES", "dtype_code", "compute_dtype"]

KERNEL_DTYPES: dict[torch.dtype, int] = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def dtype_code(dtype: torch.dtype) -> int:
    """The kernel template code of ``dtype`` (KeyError for a dtype no kernel takes)."""
    return KERNEL_DTYPES[dtype]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype of the torch paths: float64 stays float64, everything else is float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32
