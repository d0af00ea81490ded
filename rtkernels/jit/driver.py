"""The five CUDA driver calls rtkernels makes, through ctypes on the driver library torch loaded.

Module load, function lookup, function attributes and ``cuLaunchKernel``. Going straight to
``libcuda`` keeps a process whose kernels are all in the kernel cache from importing CuPy itself
(about 85 ms on an H200 host). Every call returns the driver's status; a non-zero status raises
:class:`CudaDriverError` with the driver's name for it. Where ``libcuda`` cannot be opened this
way, CuPy's binding (``cupy_backends.cuda.api.driver``) does the same calls. The launch, the one
call on the hot path, takes that compiled binding wherever it imports (the CuPy backend's check
imports it anyway): :func:`launch_kernel`.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any, Callable, Optional

__all__ = ["CudaDriverError", "check", "module_load_data", "module_get_function", "func_set_attribute",
           "func_get_attribute", "launch_kernel", "launch_kernel_address"]

#: CUfunction_attribute values used here.
MAX_THREADS_PER_BLOCK, SHARED_SIZE_BYTES, LOCAL_SIZE_BYTES, NUM_REGS = 0, 1, 3, 4
MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


class CudaDriverError(RuntimeError):
    """A CUDA driver call failed; the message names the call and the driver's error, ``status``
    is the driver's status (as on CuPy's error)."""

    status: int = 0


@functools.lru_cache(maxsize=1)
def _lib() -> Any:
    """libcuda through ctypes with the argument types set, or None."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    vp, u, i = ctypes.c_void_p, ctypes.c_uint, ctypes.c_int
    sig = {"cuModuleLoadData": [ctypes.POINTER(vp), ctypes.c_char_p],
           "cuModuleGetFunction": [ctypes.POINTER(vp), vp, ctypes.c_char_p],
           "cuFuncSetAttribute": [vp, i, i],
           "cuFuncGetAttribute": [ctypes.POINTER(i), i, vp],
           "cuLaunchKernel": [vp, u, u, u, u, u, u, u, vp, vp, vp],
           "cuGetErrorName": [i, ctypes.POINTER(ctypes.c_char_p)],
           "cuDeviceGet": [ctypes.POINTER(i), i],
           "cuDevicePrimaryCtxRetain": [ctypes.POINTER(vp), i],
           "cuDevicePrimaryCtxRelease": [i],
           "cuCtxSetCurrent": [vp]}
    for name, args in sig.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, i
    return lib


def check(status: int, call: str) -> None:
    """Raise :class:`CudaDriverError` for a non-zero ``status`` of ``call``."""
    if status:
        lib, name = _lib(), ctypes.c_char_p()
        known = lib is not None and lib.cuGetErrorName(status, ctypes.byref(name)) == 0 and name.value
        err = CudaDriverError(f"{call} failed: {name.value.decode() if known else '?'} ({status})")
        err.status = int(status)
        raise err


def _cupy() -> Any:
    from cupy_backends.cuda.api import driver

    return driver


def module_load_data(image: bytes) -> int:
    """``cuModuleLoadData`` in the current context: the module handle."""
    lib = _lib()
    if lib is None:
        return int(_cupy().moduleLoadData(image))
    handle = ctypes.c_void_p()
    check(lib.cuModuleLoadData(ctypes.byref(handle), image), "cuModuleLoadData")
    return int(handle.value or 0)


def module_get_function(module: int, name: str) -> int:
    """``cuModuleGetFunction``: the function handle of the kernel with lowered name ``name``."""
    lib = _lib()
    if lib is None:
        return int(_cupy().moduleGetFunction(module, name))
    handle = ctypes.c_void_p()
    check(lib.cuModuleGetFunction(ctypes.byref(handle), module, name.encode()), "cuModuleGetFunction")
    return int(handle.value or 0)


def func_set_attribute(function: int, attribute: int, value: int) -> None:
    """``cuFuncSetAttribute``."""
    lib = _lib()
    if lib is None:
        _cupy().funcSetAttribute(function, attribute, value)
        return
    check(lib.cuFuncSetAttribute(function, attribute, value), "cuFuncSetAttribute")


def func_get_attribute(function: int, attribute: int) -> int:
    """``cuFuncGetAttribute``."""
    lib = _lib()
    if lib is None:
        return int(_cupy().funcGetAttribute(attribute, function))
    out = ctypes.c_int()
    check(lib.cuFuncGetAttribute(ctypes.byref(out), attribute, function), "cuFuncGetAttribute")
    return out.value


def launch_kernel() -> Callable[..., Any]:
    """``launch(function, gx, gy, gz, bx, by, bz, shared_mem, stream, params, extra)``:
    ``cuLaunchKernel`` with plain ints (``params``: the address of the argument pointer array).
    CuPy's compiled binding where it imports (``cupy_backends``, without CuPy itself): it costs
    about 1.4 µs less per launch than a ctypes call on an H200 host, and raises
    :data:`LaunchError` instead of returning a status; else ctypes on ``libcuda``, which returns
    the status. :func:`launch_status` runs either and gives the status. Imported here, when the
    first kernel loads, not when rtkernels is imported."""
    global LaunchError
    try:
        binding = _cupy()
    except ImportError:  # e.g. the PyCUDA backend without CuPy
        lib = _lib()
        if lib is None:
            raise CudaDriverError("no CUDA driver binding: neither libcuda.so.1 nor cupy_backends loads")
        return lib.cuLaunchKernel
    LaunchError = binding.CUDADriverError
    return binding.launchKernel


def launch_kernel_address() -> Optional[int]:
    """The address of ``cuLaunchKernel`` in the driver library torch loaded (for compiled callers,
    :mod:`rtkernels.compiled_call`), or None where ``libcuda.so.1`` does not open."""
    lib = _lib()
    return None if lib is None else ctypes.cast(lib.cuLaunchKernel, ctypes.c_void_p).value


#: What the launch function of :func:`launch_kernel` raises on failure (its ``status`` is the
#: driver's): CuPy's error class once :func:`launch_kernel` has chosen its binding.
LaunchError: type = CudaDriverError


def launch_status(launch: Callable[..., Any], *args: Any) -> int:
    """``launch(*args)``'s driver status (0: launched), whichever binding ``launch`` is."""
    try:
        return launch(*args) or 0
    except LaunchError as exc:
        return int(exc.status)


#: The driver status of a launch or module load on a thread with no current context.
INVALID_CONTEXT = 201


def make_primary_current(device_index: int) -> None:
    """Make the primary context of device ``device_index`` (torch's) current on this thread. A
    thread that has made no CUDA runtime call yet has none, e.g. a fresh autograd worker thread."""
    lib = _lib()
    if lib is None:  # CuPy's binding: cudaSetDevice binds the primary context (CUDA >= 12)
        from cupy_backends.cuda.api import runtime

        runtime.setDevice(device_index)
        return
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    check(lib.cuDeviceGet(ctypes.byref(dev), device_index), "cuDeviceGet")
    check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    try:
        check(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    finally:
        lib.cuDevicePrimaryCtxRelease(dev)  # torch holds the primary context; keep its count as it was
