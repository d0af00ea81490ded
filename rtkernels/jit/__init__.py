"""The JIT runtime: CUDA sources, NVRTC compilation, kernel launch on torch's stream."""

from .compiler import BASE_OPTIONS, CompiledProgram, KernelCompileError, compile_offline, nvrtc_archs, nvrtc_version
from .dtypes import KERNEL_DTYPES, compute_dtype, dtype_code
from .jit import BoundLaunch, Kernel, compile_log, cupy_available, get_function, kernels_available, launch
from .sources import list_sources, load_source, source_dir, sources_hash

__all__ = [
    "BASE_OPTIONS", "CompiledProgram", "KernelCompileError", "compile_offline", "nvrtc_archs", "nvrtc_version",
    "KERNEL_DTYPES", "compute_dtype", "dtype_code",
    "BoundLaunch", "Kernel", "compile_log", "cupy_available", "get_function", "kernels_available", "launch",
    "list_sources", "load_source", "source_dir", "sources_hash",
]
