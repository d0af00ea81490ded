"""The package version and the versions of what rtkernels runs on: for ``rtkernels info``, the
bench's environment record and the GPU checks of the CLI. Imports only :mod:`rtkernels.jit`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

__all__ = ["VERSION", "cupy_version", "nvrtc_version_text", "kernel_cache_dir", "cuda_version_text",
           "driver_version", "no_gpu_reason"]

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


def driver_version() -> str:
    """The CUDA driver version, from torch where it says so, else from CuPy; or "unknown"."""
    try:
        import torch

        get = getattr(torch._C, "_cuda_getDriverVersion", None)  # not public API: guarded
        if get is not None and torch.cuda.is_available():
            v = int(get())
            if v > 0:
                return f"{cuda_version_text(v)} (from torch)"
    except Exception:
        pass
    try:
        import cupy

        v = int(cupy.cuda.runtime.driverGetVersion())
        if v > 0:
            return f"{cuda_version_text(v)} (from CuPy)"
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
    from .jit import cupy_available

    if not cupy_available():
        return "CuPy with a CUDA driver is not available (pip install 'rtkernels[cuda12]' or 'rtkernels[cuda13]')"
    return None
