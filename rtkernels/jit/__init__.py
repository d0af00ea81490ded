"""The JIT runtime: CUDA sources, compilation (NVRTC through CuPy, or nvcc through PyCUDA), kernel
launch on torch's stream."""

from .compiler import BASE_OPTIONS, CompiledProgram, KernelCompileError, compile_offline, nvrtc_archs, nvrtc_version
from .compiler_nvcc import compile_nvcc
from .dtypes import KERNEL_DTYPES, compute_dtype, dtype_code
from .jit import (BoundLaunch, Kernel, backend_name, compile_log, compiler_available, cupy_available, get_function,
                  kernels_available, launch, precompile)
from .sources import list_sources, load_source, source_dir, sources_hash

__all__ = [
    "BASE_OPTIONS", "CompiledProgram", "KernelCompileError", "compile_offline", "nvrtc_archs", "nvrtc_version",
    "compile_nvcc",
    "KERNEL_DTYPES", "compute_dtype", "dtype_code",
    "BoundLaunch", "Kernel", "backend_name", "compile_log", "compiler_available", "cupy_available", "get_function",
    "kernels_available", "launch", "precompile",
    "list_sources", "load_source", "source_dir", "sources_hash",
]
