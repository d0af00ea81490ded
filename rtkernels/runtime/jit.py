"""Just-in-time compilation and launching of rtkernels' kernels on torch tensors.

Kernels are compiled at first use with ``cupy.RawModule`` (NVRTC) for the device of the tensors
they run on, memoised per (device, source, template instance), and launched on torch's current
stream of that device. Pointers are passed as Python ints (``tensor.data_ptr()``), so a launch
wraps no tensor and copies nothing.
"""

from __future__ import annotations

import functools
import os
import struct
import threading
import time
from typing import Any, Sequence

import torch

from .compiler import BASE_OPTIONS, KernelCompileError
from .sources import load_source

__all__ = ["cupy_available", "kernels_available", "get_function", "launch", "cupy_stream", "Kernel",
           "BoundLaunch", "compile_log"]

_lock = threading.Lock()
_compile_log: list[dict[str, Any]] = []
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
            t0 = time.perf_counter()
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
            _compile_log.append({"source": source, "name": name_expression, "device": device_index,
                                 "options": list(extra_options), "seconds": time.perf_counter() - t0})
            fn = Kernel(fn)
            _functions[key] = fn
    return fn


def compile_log() -> list[dict[str, Any]]:
    """One record per kernel this process has obtained through :func:`get_function`: ``source``,
    ``name``, ``device``, ``options`` and ``seconds`` (wall time of NVRTC's compile and the module
    load; with a warm CuPy disk cache only the load)."""
    return [dict(r) for r in _compile_log]


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


class Kernel:
    """A compiled kernel on one device.

    :meth:`launch` packs the arguments into one reusable buffer and calls ``cuLaunchKernel``
    directly (a Python int goes in as a 64-bit integer, a float as a double: every parameter of
    rtkernels' kernels is 8 bytes wide, or a 4-byte int read from the low half of its slot), which
    costs a few microseconds less than CuPy's generic argument handling. Where CuPy does not
    expose the function handle, or with ``RTKERNELS_CUPY_LAUNCH=1``, it launches through CuPy.
    """

    def __init__(self, function: Any):
        self.function = function  # keeps the module loaded
        self.fast = False
        try:
            if os.environ.get("RTKERNELS_CUPY_LAUNCH") == "1":
                raise RuntimeError("CuPy launch requested")
            from cupy_backends.cuda.api import driver

            inner = getattr(function, "kernel", function)
            self._ptr = int(inner.ptr)
            self._launch_kernel = driver.launchKernel
            self.fast = True
        except Exception:
            pass
        self._layouts: dict[int, tuple[struct.Struct, Any, int]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _layout(args: Sequence[Any]) -> tuple[struct.Struct, Any, int]:
        import ctypes

        fmt = "<" + "".join("d" if isinstance(a, float) else "q" for a in args)
        buf = ctypes.create_string_buffer(8 * len(args))
        base = ctypes.addressof(buf)
        params = (ctypes.c_void_p * len(args))(*[base + 8 * i for i in range(len(args))])
        return struct.Struct(fmt), (buf, params), ctypes.addressof(params)

    def bind(self, grid: tuple[int, int, int], block: tuple[int, int, int], shared_mem: int, device_index: int,
             n_head: int, tail: Sequence[Any]) -> "BoundLaunch":
        """This kernel with its grid, block, shared memory and every argument after the first
        ``n_head`` fixed: see :class:`BoundLaunch`."""
        return BoundLaunch(self, grid, block, shared_mem, device_index, n_head, tuple(tail))

    def launch(self, grid: tuple[int, int, int], block: tuple[int, int, int], args: Sequence[Any],
               shared_mem: int, device_index: int) -> None:
        if not self.fast:
            self.function(grid, block, tuple(args), shared_mem=shared_mem, stream=cupy_stream(device_index))
            return
        stream = _raw_stream(device_index)
        with self._lock:
            layout = self._layouts.get(len(args))
            if layout is None:
                layout = self._layouts[len(args)] = self._layout(args)
            packer, (buf, _), params_ptr = layout
            packer.pack_into(buf, 0, *args)
            self._launch_kernel(self._ptr, grid[0], grid[1], grid[2], block[0], block[1], block[2],
                                shared_mem, stream, params_ptr, 0)


class BoundLaunch:
    """A launch of one kernel whose grid, block, shared memory and trailing arguments are fixed:
    ``bound(*head)`` launches it on torch's current stream with the ``n_head`` leading arguments
    (Python ints: pointers). The trailing arguments are packed once into a parameter buffer owned
    by this object, so a call packs only the head (the host path of a cached API call)."""

    __slots__ = ("kernel", "grid", "block", "shared_mem", "dev", "n_head", "tail", "_head", "_buf", "_params",
                 "_lock")

    def __init__(self, kernel: Kernel, grid: tuple[int, int, int], block: tuple[int, int, int], shared_mem: int,
                 device_index: int, n_head: int, tail: tuple):
        self.kernel, self.grid, self.block, self.shared_mem = kernel, grid, block, shared_mem
        self.dev, self.n_head, self.tail = device_index, n_head, tail
        self._lock = threading.Lock()
        if kernel.fast:
            packer, (buf, params), self._params = Kernel._layout((0,) * n_head + tail)
            packer.pack_into(buf, 0, *((0,) * n_head), *tail)
            self._buf, self._head = (buf, params), struct.Struct(f"<{n_head}q")

    def __call__(self, *head: int) -> None:
        k = self.kernel
        if not k.fast or torch._C._cuda_getDevice() != self.dev:
            launch(k, self.grid, self.block, (*head, *self.tail), self.dev, shared_mem=self.shared_mem)
            return
        g, b = self.grid, self.block
        stream = _raw_stream(self.dev)
        with self._lock:
            self._head.pack_into(self._buf[0], 0, *head)
            k._launch_kernel(k._ptr, g[0], g[1], g[2], b[0], b[1], b[2], self.shared_mem, stream, self._params, 0)


def launch(fn: Kernel, grid: tuple[int, int, int], block: tuple[int, int, int],
           args: Sequence[Any], device_index: int, shared_mem: int = 0) -> None:
    """Launch ``fn`` on torch's current stream of ``device_index`` (asynchronous)."""
    if torch.cuda.current_device() == device_index:
        fn.launch(grid, block, args, shared_mem, device_index)
        return
    import cupy

    with cupy.cuda.Device(device_index):
        fn.launch(grid, block, args, shared_mem, device_index)
