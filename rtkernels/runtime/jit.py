"""Just-in-time compilation and launching of rtkernels' kernels on torch tensors.

Kernels are compiled at first use with ``cupy.RawModule`` (NVRTC) for the device of the tensors
they run on, memoised per (device, source, template instance), and launched on torch's current
stream of that device. Pointers are passed as Python ints (``tensor.data_ptr()``), so a launch
wraps no tensor and copies nothing.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Sequence

import torch

from .compiler import BASE_OPTIONS, KernelCompileError
from .sources import load_source

__all__ = ["cupy_available", "kernels_available", "get_function", "launch", "cupy_stream"]

_lock = threading.Lock()
_functions: dict[tuple[int, str, str, tuple[str, ...]], Any] = {}
_streams: dict[tuple[int, int], Any] = {}


@functools.lru_cache(maxsize=1)
def cupy_available() -> bool:
    """True when CuPy imports and sees a CUDA driver."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # ImportError, or CUDARuntimeError without a driver
        return False


def kernels_available(device: torch.device) -> bool:
    """True when rtkernels' CUDA kernels can run on ``device``."""
    return device.type == "cuda" and cupy_available()


def get_function(source: str, name_expression: str, device_index: int,
                 extra_options: tuple[str, ...] = (), dynamic_smem: int = 0) -> Any:
    """The compiled kernel ``name_expression`` of ``cuda_src/<source>`` on device ``device_index``.

    Compiles on first use (CuPy keeps the binary in its disk cache) and memoises the function.
    ``dynamic_smem``: bytes of dynamic shared memory the kernel will be launched with; above the
    default 48 KiB the function's limit is raised once here. Raises :class:`KernelCompileError`
    with NVRTC's log when the source does not compile.
    """
    key = (device_index, source, name_expression, extra_options)
    fn = _functions.get(key)
    if fn is not None:
        return fn
    import cupy

    with _lock:
        fn = _functions.get(key)
        if fn is None:
            with cupy.cuda.Device(device_index):
                module = cupy.RawModule(
                    code=load_source(source),
                    options=(*BASE_OPTIONS, *extra_options),
                    name_expressions=[name_expression],
                )
                try:
                    fn = module.get_function(name_expression)
                except cupy.cuda.compiler.CompileException as exc:
                    raise KernelCompileError(source, [name_expression], str(exc)) from None
                if dynamic_smem > 48 * 1024:
                    fn.max_dynamic_shared_size_bytes = dynamic_smem
            _functions[key] = fn
    return fn


def _raw_stream(device_index: int) -> int:
    return torch.cuda.current_stream(device_index).cuda_stream


if hasattr(torch._C, "_cuda_getCurrentRawStream"):  # the handle without building a Stream object
    def _raw_stream(device_index: int) -> int:  # noqa: F811
        return torch._C._cuda_getCurrentRawStream(device_index)


def cupy_stream(device_index: int) -> Any:
    """A CuPy view of torch's current stream on ``device_index`` (cached per stream handle)."""
    key = (device_index, _raw_stream(device_index))
    stream = _streams.get(key)
    if stream is None:
        import cupy

        stream = cupy.cuda.ExternalStream(key[1], device_index)
        _streams[key] = stream
    return stream


def launch(fn: Any, grid: tuple[int, int, int], block: tuple[int, int, int],
           args: Sequence[Any], device_index: int, shared_mem: int = 0) -> None:
    """Launch ``fn`` on torch's current stream of ``device_index`` (asynchronous)."""
    stream = cupy_stream(device_index)
    if torch.cuda.current_device() == device_index:
        fn(grid, block, args, shared_mem=shared_mem, stream=stream)
        return
    import cupy

    with cupy.cuda.Device(device_index):
        fn(grid, block, args, shared_mem=shared_mem, stream=stream)
