"""The method registry: one :class:`Method` record per way of computing the operator.

A record holds everything the rest of the library needs to know about a method: its math (the
module's docstring), its work and memory, its torch path, and, when it has CUDA kernels, one
:class:`KernelPath` (which inputs the kernels take, the forward, the planner the cached call
reuses, the autotuner's space and adapter, the template instances CI compiles). The API, ``auto``,
the autotuner and the CLI read these records; none of them names a method. Adding a method is one
module and one record here.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Optional

import torch

from ..autotune.answers import plan_state, selection, set_config_check
from ..autotune.space import Config, Limits, Problem, Space
from ..decay import LogDecay
from ..jit import kernels_available
from . import block, chunk, fleet, recursion, scan, vanilla
from ._torch_common import TorchForward, run_torch_path

__all__ = ["Method", "KernelPath", "METHODS", "AUTO_ORDER", "SHORT_AUTO_ORDER", "SHORT_N", "REFERENCE_METHOD",
           "run_method", "auto_method", "heuristic_method", "kernel_instances", "plan_epoch"]

#: ``(q, k, v, log_decay, scale, out, initial_state, need_state, fp32_precision=...) -> final state or None``
KernelForward = Callable[..., Optional[torch.Tensor]]


@dataclass(frozen=True)
class KernelPath:
    """A method's CUDA kernels, as the library uses them.

    * ``supports(q, v)``: whether the kernels take these inputs (dtype and head sizes; meta
      tensors work, so the autotuner asks without a GPU).
    * ``forward``: :data:`KernelForward`; ``fp32_precision`` ("exact" or "tf32") matters only to
      kernels with float32 modes.
    * ``prepare(q, k, v, log_decay, scale, out, need_state, fp32_precision=...)``: optional; plans
      the call once and returns ``launcher(q, k, v, out, initial_state)``, which the cached call
      repeats with new tensors of the same shapes, strides and alignment.
    * ``tune_space``: the autotuner's :class:`~rtkernels.autotune.Space`; ``tuned_launch(config,
      problem, limits, *, vec, exact)``: what a config of it launches (the same signature for
      every method).
    * ``instances()``: every template instance the method can ask for, by source under
      ``cuda_src/`` (CI compiles them all).
    """

    supports: Callable[[torch.Tensor, torch.Tensor], bool]
    forward: KernelForward
    instances: Callable[[], dict[str, list[str]]]
    tune_space: Optional[Space] = None
    tuned_launch: Optional[Callable[..., Any]] = None
    prepare: Optional[Callable[..., Callable[..., Optional[torch.Tensor]]]] = None


@dataclass(frozen=True)
class Method:
    """One computation method: ``module`` (its math in the docstring), its work and memory in
    ``complexity``, its torch path, and its :class:`KernelPath` (None: torch only).
    ``torch_bytes(problem)``: about the temporary memory its torch path needs; ``torch_loops``:
    the torch path is a Python loop over the sequence (the autotuner skips it for long ones)."""

    name: str
    module: ModuleType
    complexity: str
    torch_forward: TorchForward
    kernel: Optional[KernelPath] = None
    torch_bytes: Callable[[Problem], int] = lambda p: 0
    torch_loops: bool = False

    @property
    def doc(self) -> str:
        """The method's math and algorithm (its module's docstring)."""
        return self.module.__doc__ or ""

    @property
    def kernel_forward(self) -> Optional[KernelForward]:
        return None if self.kernel is None else self.kernel.forward

    @property
    def kernel_supports(self) -> Optional[Callable[[torch.Tensor, torch.Tensor], bool]]:
        return None if self.kernel is None else self.kernel.supports

    @property
    def kernel_prepare(self) -> Optional[Callable[..., Any]]:
        return None if self.kernel is None else self.kernel.prepare

    def kernel_takes(self, q: torch.Tensor, v: torch.Tensor) -> bool:
        """Whether the kernels take inputs like these on some GPU (no device check)."""
        return self.kernel is not None and self.kernel.supports(q, v)

    def uses_kernel(self, q: torch.Tensor, v: torch.Tensor) -> bool:
        """Whether a call with these inputs runs this method's CUDA kernel."""
        return self.kernel_takes(q, v) and q.is_cuda and _kernels_or_warn(q.device)


def _kernel(module: ModuleType, prepare: bool = False) -> KernelPath:
    """The :class:`KernelPath` of a method module with the usual names."""
    return KernelPath(module.kernel_supports, module.kernel_forward, module.instances, module.TUNE_SPACE,
                      module.tuned_launch, module.kernel_prepare if prepare else None)


METHODS: dict[str, Method] = {
    "vanilla": Method("vanilla", vanilla, "O(N^2 (Dk+Dv)) work, O(N^2) memory", vanilla.torch_forward,
                      torch_bytes=lambda p: 3 * p.bh * p.n * p.n * 4),  # scores and mask, fp32
    "recursion": Method("recursion", recursion, "O(N log N Dk Dv) work, O(N D + N Dk Dv / 32) memory",
                        recursion.torch_forward,
                        torch_bytes=lambda p: p.bh * p.n * (p.dk * p.dv // 32 + p.dk + p.dv) * 4 * 2),
    "block": Method("block", block, "O(N C (Dk+Dv) + N Dk Dv) work, O(N D + C^2 + Dk Dv) memory",
                    block.torch_forward, _kernel(block), torch_loops=True),
    "fleet": Method("fleet", fleet, "O(N Dk Dv) work, O(N D + C Dk Dv) memory", fleet.torch_forward,
                    _kernel(fleet), torch_loops=True),
    "scan": Method("scan", scan, "O(N Dk Dv) work in N sequential steps, O(N D + Dk Dv) memory",
                   scan.torch_forward, _kernel(scan), torch_loops=True),
    "chunk": Method("chunk", chunk, "O(N C (Dk+Dv) + N Dk Dv) work, O(N D + N Dk Dv / C) memory",
                    chunk.torch_forward, _kernel(chunk, prepare=True)),
}

#: ``auto`` without a store entry: the first of these whose kernel runs the call, else the first.
AUTO_ORDER = ("chunk", "scan")
#: Calls of at most this many tokens (decode-like: one or a few new tokens continuing a state) try
#: :data:`SHORT_AUTO_ORDER` instead: there the chunk kernel's 64-token tiles are mostly padding and
#: the scan kernel, one pass with the state in registers, is faster. Measured on an H100 (H = 32,
#: D = 128, bf16, an initial state, cold L2; ms scan / chunk): B = 64: N = 1 0.168 / 0.206,
#: N = 3 0.201 / 0.208, N = 4 0.210 / 0.207, N = 8 0.261 / 0.210, N = 64 1.06 / 0.225; B = 4: N = 4
#: 0.018 / 0.022, N = 8 0.021 / 0.022, N = 16 0.027 / 0.022. Past a few tokens the scan's sequential
#: steps cost more than the chunk kernel's fixed overhead.
SHORT_N = 4
SHORT_AUTO_ORDER = ("scan", "chunk")
#: The method whose float64 torch path the autotuner validates candidates against.
REFERENCE_METHOD = "chunk"

_warned_no_cupy = False


def _kernels_or_warn(device: torch.device) -> bool:
    global _warned_no_cupy
    if kernels_available(device):
        return True
    if not _warned_no_cupy:
        _warned_no_cupy = True
        warnings.warn("rtkernels: no kernel compiler backend (CuPy, or PyCUDA with nvcc) with a CUDA driver is "
                      "available, so CUDA tensors run the torch paths; install rtkernels[cuda12] or "
                      "rtkernels[cuda13] for the kernels", RuntimeWarning, stacklevel=4)
    return False


_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_warned_heads: set[tuple[str, int, int]] = set()


def _warn_head_limit(m: Method, q: torch.Tensor, v: torch.Tensor) -> None:
    """Warn once per (method, Dk, Dv) when a CUDA call of a kernel dtype runs the torch path because
    its heads are wider than the method's kernels take (the torch path is correct, but slow)."""
    max_k = getattr(m.module, "MAX_DIM", None)
    max_v = getattr(m.module, "MAX_VALUE_DIM", max_k)
    dk, dv = q.shape[-1], v.shape[-1]
    key = (m.name, dk, dv)
    if max_k is None or (dk <= max_k and dv <= max_v) or key in _warned_heads:
        return
    _warned_heads.add(key)
    warnings.warn(f"rtkernels: method {m.name!r} has CUDA kernels for Dk <= {max_k} and Dv <= {max_v} only; "
                  f"Dk = {dk}, Dv = {dv} runs its torch path (correct, much slower)", RuntimeWarning, stacklevel=4)


def heuristic_method(q: torch.Tensor, v: torch.Tensor,
                     runs_kernel: Optional[Callable[[Method, torch.Tensor, torch.Tensor], bool]] = None) -> str:
    """``auto`` without a store entry: the first method of :data:`AUTO_ORDER` (of
    :data:`SHORT_AUTO_ORDER` when N <= :data:`SHORT_N`) whose kernel runs the call (``runs_kernel``,
    default :meth:`Method.uses_kernel`), else ``AUTO_ORDER[0]``'s torch path. The autotuner asks
    with meta tensors and ``Method.kernel_takes``."""
    runs = runs_kernel or Method.uses_kernel
    order = SHORT_AUTO_ORDER if q.shape[2] <= SHORT_N else AUTO_ORDER
    return next((name for name in order if runs(METHODS[name], q, v)), AUTO_ORDER[0])


def auto_method(q: torch.Tensor, v: torch.Tensor) -> str:
    """The method ``method="auto"`` picks: on CUDA tensors, the one the autotune store names for
    the call's shape bucket on this GPU (one dict lookup per call); without an entry,
    :func:`heuristic_method`: the tensor-core ``chunk`` kernel where it runs (CUDA,
    fp32/fp16/bf16, Dk <= 256 and Dv <= 512; for fp32 also a tile that fits the GPU's shared memory),
    else the ``scan`` kernel where it runs, else the batched torch ``chunk`` path; for N <=
    :data:`SHORT_N` (4) tokens the ``scan`` kernel first, then the ``chunk`` kernel, else the torch
    ``chunk`` path."""
    if q.is_cuda:
        sel = selection(q.get_device(), q.dtype, q.shape[0] * q.shape[1], q.shape[2], q.shape[3], v.shape[3])
        if sel is not None and sel.method in METHODS:
            return sel.method
    return heuristic_method(q, v)


def _entry_problem(method: Any, config: Optional[dict]) -> Optional[str]:
    """Why an autotune store entry's method (``config`` None) or config of ``method`` is not one
    this library runs, or None (see :func:`rtkernels.autotune.answers.set_config_check`)."""
    if not isinstance(method, str) or method not in METHODS:
        return f"unknown method {method!r}"
    if config is None:
        return None
    kernel = METHODS[method].kernel
    if kernel is None or kernel.tune_space is None:
        return f"method {method!r} has no tuned configs"
    why = kernel.tune_space.invalid(config)
    return None if why is None else f"{method} {why}"


set_config_check(_entry_problem)


def plan_epoch() -> tuple:
    """Changes whenever a planned kernel call may no longer be the one a new plan would make: the
    autotune store's answers and the candidate it forces, and the chunk kernel's overrides."""
    return (plan_state(), chunk.current_overrides())


def run_method(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: LogDecay,
               scale: float, out: torch.Tensor, initial_state: Optional[torch.Tensor],
               need_state: bool, fp32_precision: str = "exact") -> Optional[torch.Tensor]:
    """Compute into ``out`` (a ``[B, H, N, Dv]`` view) with method ``name`` (its CUDA kernel where it
    takes the inputs, else its torch path); return the final state when ``need_state``.
    ``fp32_precision`` ("exact" or "tf32") reaches the kernels with fp32 modes (``chunk``)."""
    m = METHODS[name]
    if m.uses_kernel(q, v):
        return m.kernel.forward(q, k, v, log_decay, scale, out, initial_state, need_state,
                                fp32_precision=fp32_precision)
    if m.kernel is not None and q.is_cuda and q.dtype in _KERNEL_DTYPES:
        _warn_head_limit(m, q, v)
    return run_torch_path(m.torch_forward, q, k, v, log_decay, scale, out, initial_state, need_state)


def kernel_instances() -> dict[str, list[str]]:
    """Every template instance the library can request, by source file under ``cuda_src/`` (for
    the compile test): every method's kernels, and the chunk backward's dlog(gamma) kernel."""
    out: dict[str, list[str]] = {}
    for m in METHODS.values():
        if m.kernel is not None:
            for source, names in m.kernel.instances().items():
                out.setdefault(source, []).extend(n for n in names if n not in out.get(source, ()))
    return out


def tuned_launch(method: str, config: Config, problem: Problem, limits: Limits, *, vec: bool = True,
                 exact: bool = True) -> Any:
    """What ``method``'s kernel launches for a tuned ``config`` (its ``KernelPath.tuned_launch``)."""
    return METHODS[method].kernel.tuned_launch(config, problem, limits, vec=vec, exact=exact)
