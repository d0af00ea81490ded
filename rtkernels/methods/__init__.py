"""The computation methods and their dispatch.

Every method computes the same operator (DESIGN.md §1) and has a torch path that runs on any
device in float64/float32/float16/bfloat16 (float32 accumulation for 16-bit inputs). Methods with
a CUDA kernel use it on CUDA tensors when CuPy is present and the kernel takes the problem.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..decay import LogDecay

from ..autotune import plan_state, selection
from ..jit import kernels_available
from . import block, chunk, fleet, recursion, scan, vanilla
from ._torch_common import TorchForward, run_torch_path

__all__ = ["Method", "METHODS", "run_method", "auto_method", "kernel_instances", "plan_epoch"]

KernelForward = Callable[..., Optional[torch.Tensor]]


@dataclass(frozen=True)
class Method:
    """One computation method: its math in ``module.__doc__``, its work/memory in ``complexity``."""

    name: str
    complexity: str
    torch_forward: TorchForward
    kernel_forward: Optional[KernelForward] = None
    kernel_supports: Optional[Callable[[torch.Tensor, torch.Tensor], bool]] = None
    #: ``(q, k, v, log_decay, scale, out, need_state) -> launcher``: plans the kernel call once for
    #: views with unit stride along D; ``launcher(q, k, v, out, initial_state)`` repeats it with new
    #: tensors of the same shapes, strides and alignment (the API caches it per call signature).
    kernel_prepare: Optional[Callable[..., Callable[..., Optional[torch.Tensor]]]] = None
    #: Whether ``kernel_forward`` and ``kernel_prepare`` take the ``fp32_precision`` keyword (its fp32
    #: kernel has modes).
    fp32_modes: bool = False

    def kernel_kwargs(self, fp32_precision: str) -> dict:
        """The keywords ``kernel_forward`` and ``kernel_prepare`` take beyond the common arguments."""
        return {"fp32_precision": fp32_precision} if self.fp32_modes else {}

    def uses_kernel(self, q: torch.Tensor, v: torch.Tensor) -> bool:
        """Whether a call with these inputs runs this method's CUDA kernel."""
        return (self.kernel_forward is not None and q.is_cuda and self.kernel_supports(q, v)
                and _kernels_or_warn(q.device))


METHODS: dict[str, Method] = {
    "vanilla": Method("vanilla", "O(N^2 (Dk+Dv)) work, O(N^2) memory", vanilla.torch_forward),
    "recursion": Method("recursion", "O(N log N Dk Dv) work, O(N D + N Dk Dv / 32) memory",
                        recursion.torch_forward),
    "block": Method("block", "O(N C (Dk+Dv) + N Dk Dv) work, O(N D + C^2 + Dk Dv) memory",
                    block.torch_forward, block.kernel_forward, block.kernel_supports),
    "fleet": Method("fleet", "O(N Dk Dv) work, O(N D + C Dk Dv) memory", fleet.torch_forward,
                    fleet.kernel_forward, fleet.kernel_supports),
    "scan": Method("scan", "O(N Dk Dv) work in N sequential steps, O(N D + Dk Dv) memory",
                   scan.torch_forward, scan.kernel_forward, scan.kernel_supports),
    "chunk": Method("chunk", "O(N C (Dk+Dv) + N Dk Dv) work, O(N D + N Dk Dv / C) memory",
                    chunk.torch_forward, chunk.kernel_forward, chunk.kernel_supports, chunk.kernel_prepare,
                    fp32_modes=True),
}

_warned_no_cupy = False


def _kernels_or_warn(device: torch.device) -> bool:
    global _warned_no_cupy
    if kernels_available(device):
        return True
    if not _warned_no_cupy:
        _warned_no_cupy = True
        warnings.warn("rtkernels: CuPy with a CUDA driver is not available, so CUDA tensors run the "
                      "torch paths; install rtkernels[cuda12] or rtkernels[cuda13] for the kernels",
                      RuntimeWarning, stacklevel=4)
    return False


def auto_method(q: torch.Tensor, v: torch.Tensor) -> str:
    """The method ``method="auto"`` picks: on CUDA tensors, the one the autotune store names for
    the call's shape bucket on this GPU (one dict lookup per call); without an entry, the
    heuristic: the tensor-core ``chunk`` kernel where it runs (CUDA, fp32/fp16/bf16, Dk and
    Dv <= 256; for fp32 also a tile that fits the GPU's shared memory, e.g. not Dk > 128 on an
    A100), else the ``scan`` kernel where it runs, else the batched torch ``chunk`` path."""
    if q.is_cuda:
        sel = selection(q.get_device(), q.dtype, q.shape[0] * q.shape[1], q.shape[2], q.shape[3], v.shape[3])
        if sel is not None and sel.method in METHODS:
            return sel.method
    if METHODS["chunk"].uses_kernel(q, v):
        return "chunk"
    return "scan" if METHODS["scan"].uses_kernel(q, v) else "chunk"


def plan_epoch() -> tuple:
    """Changes whenever a planned kernel call may no longer be the one a new plan would make: the
    autotune store's answers and the candidate it forces (:func:`rtkernels.autotune.plan_state`) and
    the chunk overrides (``force_*``, ``dedicated_states``)."""
    return (plan_state(), chunk.force_segments, chunk.force_wgmma, chunk.force_bv, chunk.dedicated_states)


def run_method(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: "LogDecay",
               scale: float, out: torch.Tensor, initial_state: Optional[torch.Tensor],
               need_state: bool, fp32_precision: str = "exact") -> Optional[torch.Tensor]:
    """Compute into ``out`` (a ``[B, H, N, Dv]`` view) with method ``name`` (its CUDA kernel where it
    takes the inputs, else its torch path); return the final state when ``need_state``.
    ``fp32_precision`` ("exact" or "tf32") reaches the kernels with fp32 modes (``chunk``); the
    others ignore it."""
    m = METHODS[name]
    if m.uses_kernel(q, v):
        return m.kernel_forward(q, k, v, log_decay, scale, out, initial_state, need_state,
                                **m.kernel_kwargs(fp32_precision))
    return run_torch_path(m.torch_forward, q, k, v, log_decay, scale, out, initial_state, need_state)


#: Modules with CUDA kernels; each has SOURCE, all_configs() and name_expression(config).
KERNEL_MODULES = (scan, fleet, block, chunk)


def kernel_instances() -> dict[str, list[str]]:
    """Every template instance the runtime can request, by source file (for the compile test): the
    methods' kernels and the kernel backward's dlog(gamma) kernel (:mod:`rtkernels.decay_grad`)."""
    from .. import decay_grad  # imported here: it imports this package

    out: dict[str, list[str]] = {}
    for mod in (*KERNEL_MODULES, decay_grad):
        out.setdefault(mod.SOURCE, []).extend(mod.name_expression(c) for c in mod.all_configs())
        out[mod.SOURCE].extend(getattr(mod, "EXTRA_KERNELS", ()))
    return out
