"""The package version and the versions of what rtkernels runs on: for ``rtkernels info``, the
bench's environment record and the GPU checks of the CLI. Imports only :mod:`rtkernels.jit`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

__all__ = ["VERSION", "torch_version_text", "cupy_version", "nvrtc_version_text", "kernel_cache_dir",
           "cuda_version_text", "driver_version", "no_gpu_reason"]

#: rtkernels' version (``rtkernels.__version__``).
VERSION = "0.1.0"


def cupy_version() -> Optional[str]:
    """CuPy's version with its distribution name (e.g. ``"14.2.0 (cupy-cuda12x)"``), or None."""
    try:
        import cupy
    except Exception:
        return None
    text = str(cupy.__version__)
    try:
        from importlib.metadata import packages_distributions

        dists = packages_distributions().get("cupy")
        if dists:
            text += f" ({', '.join(sorted(set(dists)))})"
    except Exception:
        pass
    return text


def nvrtc_version_text() -> str:
    """NVRTC's version as CuPy loads it (``"12.9"``), or why it is not available."""
    try:
        from .jit import nvrtc_version

        major, minor = nvrtc_version()
        return f"{major}.{minor}"
    except ImportError:
        return "not available (CuPy is not installed)"
    except Exception as exc:
        return f"not available ({type(exc).__name__}: {exc})"


def kernel_cache_dir() -> tuple[Path, str]:
    """rtkernels' compiled-kernel cache directory and where that setting comes from."""
    from .jit.files import ENV_CACHE_DIR
    from .jit.kernel_cache import kernels_dir

    origin = f"from {ENV_CACHE_DIR}" if os.environ.get(ENV_CACHE_DIR) else f"platformdirs; set {ENV_CACHE_DIR} to move it"
    return kernels_dir(), origin


def cuda_version_text(v: int) -> str:
    """12040 -> "12.4" (the encoding of cudaDriverGetVersion / cudaRuntimeGetVersion)."""
    return f"{v // 1000}.{(v % 1000) // 10}"


def torch_version_text() -> str:
    """torch's version and its CUDA build (``"2.5.1 (built with CUDA 12.4)"``, ``"2.5.1 (CPU-only build)"``)."""
    try:
        import torch
    except Exception as exc:
        return f"not importable ({type(exc).__name__}: {exc})"
    cuda = getattr(torch.version, "cuda", None)
    return f"{torch.__version__} (built with CUDA {cuda})" if cuda else f"{torch.__version__} (CPU-only build)"


def _libcuda_driver_version() -> int:
    """cuDriverGetVersion of the CUDA driver library (libcuda / nvcuda), or 0 where there is none.
    The driver API's own call: it needs no GPU and no CUDA context."""
    import ctypes
    import ctypes.util

    names = ("nvcuda.dll",) if os.name == "nt" else ("libcuda.so.1", "libcuda.so", ctypes.util.find_library("cuda"))
    for name in names:
        if not name:
            continue
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        v = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(v)) == 0 and v.value > 0:
            return v.value
    return 0


def driver_version() -> str:
    """The CUDA driver version, from CuPy where it is installed, else from the driver library's
    ``cuDriverGetVersion``; or "unknown" (public interfaces only: no torch internals)."""
    try:
        import cupy

        v = int(cupy.cuda.runtime.driverGetVersion())
        if v > 0:
            return f"{cuda_version_text(v)} (from CuPy)"
    except Exception:
        pass
    try:
        v = _libcuda_driver_version()
        if v > 0:
            return f"{cuda_version_text(v)} (from the driver library)"
    except Exception:
        pass
    return "unknown (no CUDA driver found)"


def no_gpu_reason() -> Optional[str]:
    """Why the CUDA kernels cannot run here (no GPU visible to torch, or no CuPy with a driver), or None."""
    try:
        import torch

        if not torch.cuda.is_available():
            return "torch sees no CUDA GPU" + ("" if torch.version.cuda else " (this torch is a CPU-only build)")
    except Exception as exc:
        return f"torch cannot query CUDA ({type(exc).__name__})"
    from .jit import compiler_available

    if not compiler_available():
        return ("no kernel compiler backend: CuPy or PyCUDA with a CUDA driver (pip install 'rtkernels[cuda12]', "
                "'rtkernels[cuda13]' or 'rtkernels[pycuda]')")
    return None
