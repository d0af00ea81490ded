"""PyCUDA arrays in and out of rtkernels' calls, without copies.

A ``pycuda.gpuarray.GPUArray`` input reaches torch through its ``__cuda_array_interface__``
(``torch.as_tensor(x, device="cuda")``: a view of its memory). :func:`as_gpuarray` gives a torch
result back as a ``GPUArray`` over the same memory: its ``gpudata`` is a
``pycuda.driver.PointerHolderBase`` (PyCUDA's hook for memory it did not allocate) that holds the
tensor, so the memory lives as long as the array does.

Both sides must use one CUDA context: torch runs in the device's primary context, so PyCUDA must
too (``import pycuda.autoprimaryctx``; ``pycuda.autoinit`` makes a context of its own, whose
kernels cannot read torch's memory). The result is written on torch's current stream; PyCUDA works
on the default stream, which is torch's default stream too: on another torch stream, synchronize it
before PyCUDA reads the result.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = ["is_gpuarray", "as_gpuarray"]


def is_gpuarray(x: Any) -> bool:
    """Whether ``x`` is a ``pycuda.gpuarray.GPUArray`` (or a subclass), without importing PyCUDA."""
    return any(c.__name__ == "GPUArray" and c.__module__ == "pycuda.gpuarray" for c in type(x).__mro__)


@functools.lru_cache(maxsize=1)
def _torch_memory() -> type:
    """A ``PointerHolderBase`` over a tensor's memory (PyCUDA takes the pointer from
    ``get_pointer()``; the holder keeps the tensor)."""
    import pycuda.driver as drv

    class TorchMemory(drv.PointerHolderBase):
        def __init__(self, tensor: torch.Tensor):
            super().__init__()  # PyCUDA requires it
            self.tensor = tensor

        def get_pointer(self) -> int:
            return self.tensor.data_ptr()

    return TorchMemory


def as_gpuarray(t: torch.Tensor) -> Any:
    """The CUDA tensor ``t`` as a ``GPUArray`` over its memory (no copy; the array keeps ``t``
    alive). ``t`` is detached; its strides carry over. TypeError for a dtype NumPy has no name for
    (bfloat16)."""
    import numpy as np
    from pycuda.gpuarray import GPUArray

    t = t.detach()
    try:
        dtype = np.dtype(str(t.dtype).replace("torch.", ""))
    except TypeError:
        raise TypeError(f"a {t.dtype} result cannot be a PyCUDA GPUArray (NumPy has no such dtype)") from None
    return GPUArray(tuple(t.shape), dtype, gpudata=_torch_memory()(t),
                    strides=tuple(s * t.element_size() for s in t.stride()))
