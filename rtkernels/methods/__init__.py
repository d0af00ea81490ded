"""The computation methods: every one computes the same operator (see docs/design.md) with a torch
path that runs on any device in float64/float32/float16/bfloat16 (float32 accumulation for 16-bit
inputs); methods with CUDA kernels run them on CUDA tensors when CuPy is present and the kernel
takes the problem. :mod:`.registry` holds one record per method.
"""

from .registry import (AUTO_ORDER, METHODS, REFERENCE_METHOD, KernelPath, Method, auto_method, heuristic_method,
                       kernel_instances, plan_epoch, run_method, tuned_launch)

__all__ = ["Method", "KernelPath", "METHODS", "AUTO_ORDER", "REFERENCE_METHOD", "run_method", "auto_method",
           "heuristic_method", "kernel_instances", "plan_epoch", "tuned_launch"]
