"""Which compiler backend the JIT uses: CuPy (NVRTC) or PyCUDA (nvcc).

Both backends produce the same thing, a cubin (or PTX) and the lowered name of the kernel in it;
loading and launching are the same for both (ctypes on libcuda, :mod:`rtkernels.jit.driver`).

``$RTKERNELS_BACKEND`` picks one:

- unset, empty or ``auto``: CuPy when its driver binding imports, else PyCUDA when ``pycuda.driver``
  imports and nvcc is found, else none (the torch paths run).
- ``cupy`` or ``pycuda``: that backend and no other. When it is not usable the kernels count as
  unavailable (the torch paths run, as without any backend) and one ``RuntimeWarning`` says why:
  an explicit choice never falls back to the other compiler, so a run meant to exercise PyCUDA
  cannot pass on CuPy unnoticed. The predicates built on this (:func:`compiler_available`) are
  asked by ``rtkernels info``, the autotune store and the tests' collection; they must answer, not
  raise, hence a warning rather than an exception. Any other value is treated the same way.

The choice is made once per process (the first time it is asked) and cached; :func:`reset`
forgets it (tests).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import warnings
from dataclasses import dataclass
from typing import Optional

__all__ = ["ENV_BACKEND", "BACKENDS", "Selection", "selection", "backend_name", "compiler_available",
           "cupy_problem", "pycuda_problem", "torch_sees_gpu", "reset"]

#: Environment variable that picks the compiler backend.
ENV_BACKEND = "RTKERNELS_BACKEND"
#: The backends, in the order ``auto`` tries them.
BACKENDS = ("cupy", "pycuda")


@dataclass(frozen=True)
class Selection:
    """The outcome of the choice: ``name`` the backend in use (None: none is usable),
    ``requested`` what ``$RTKERNELS_BACKEND`` asked for (``"auto"`` when unset), ``reason`` a
    sentence saying why (shown by ``rtkernels info`` and in the warning)."""

    name: Optional[str]
    requested: str
    reason: str


def _import_problem(package: str, module: str, label: str) -> Optional[str]:
    """None when ``module`` imports, else why not: ``package`` absent, or a broken installation."""
    try:
        if importlib.util.find_spec(package) is None:
            return f"{label} is not installed"
        importlib.import_module(module)
    except Exception as exc:  # a broken installation (no driver library, ABI mismatch): unusable
        return f"{label} is installed but {module} does not import ({type(exc).__name__}: {exc})"
    return None


def cupy_problem() -> Optional[str]:
    """None when CuPy's CUDA driver binding imports (CuPy itself is imported only to compile),
    else why not."""
    return _import_problem("cupy", "cupy_backends.cuda.api.driver", "CuPy")


def pycuda_problem() -> Optional[str]:
    """None when ``pycuda.driver`` imports and nvcc is found (PyCUDA compiles with nvcc), else
    why not."""
    problem = _import_problem("pycuda", "pycuda.driver", "PyCUDA")
    if problem is not None:
        return problem
    from .compiler_nvcc import find_nvcc

    if find_nvcc() is None:
        return "PyCUDA is installed but nvcc was not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin)"
    return None


def _choose(requested: str) -> Selection:
    problems = {"cupy": cupy_problem, "pycuda": pycuda_problem}
    if requested == "auto":
        reasons = []
        for name in BACKENDS:
            problem = problems[name]()
            if problem is None:
                return Selection(name, requested, f"{name}: the first usable backend ({ENV_BACKEND} unset)")
            reasons.append(problem)
        return Selection(None, requested, "; ".join(reasons))
    if requested not in problems:
        return Selection(None, requested, f"{ENV_BACKEND}={requested!r} is not one of "
                                          f"{', '.join(BACKENDS)} or auto")
    problem = problems[requested]()
    if problem is None:
        return Selection(requested, requested, f"{requested}: chosen by {ENV_BACKEND}")
    return Selection(None, requested, f"{ENV_BACKEND}={requested}, but {problem}")


@functools.lru_cache(maxsize=1)
def selection() -> Selection:
    """The backend of this process (chosen at the first call, then cached); warns once when an
    explicitly requested backend is not usable."""
    requested = os.environ.get(ENV_BACKEND, "").strip().lower() or "auto"
    chosen = _choose(requested)
    if chosen.name is None and requested != "auto":
        warnings.warn(f"rtkernels: {chosen.reason}; the CUDA kernels are not available and the torch "
                      f"paths run", RuntimeWarning, stacklevel=2)
    return chosen


def backend_name() -> Optional[str]:
    """``"cupy"`` or ``"pycuda"``: the compiler backend in use; None when none is usable."""
    return selection().name


@functools.lru_cache(maxsize=1)
def torch_sees_gpu() -> bool:
    """True when torch sees at least one CUDA device."""
    import torch

    try:
        return torch.cuda.is_available() and torch.cuda.device_count() > 0
    except Exception:  # a broken driver: the torch paths run
        return False


@functools.lru_cache(maxsize=1)
def compiler_available() -> bool:
    """True when the kernels can be compiled and launched here: a backend is usable (see the
    module's docstring) and torch sees a CUDA device. The gate of every kernel path; cached."""
    return backend_name() is not None and torch_sees_gpu()


def reset() -> None:
    """Forget the cached choice (tests that change ``$RTKERNELS_BACKEND`` or importability)."""
    for fn in (selection, torch_sees_gpu, compiler_available):
        getattr(fn, "cache_clear", lambda: None)()  # a test may have put a plain function in its place
