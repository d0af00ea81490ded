"""Scratch: the backward's dq pass alone (bf16 and fp16, CUDA events, median of 20): the plain pass
as planned, the plain pass with 64-wide value tiles, the pass that also sums dlog(gamma) (DLOG
instance), and the separate dlog(gamma) kernel it replaces (a second walk over the sequence).

    python bench/profiling/time_dq_pass.py [small|mid|long ...] [--fp16]
"""
import sys

import torch

from rtkernels.cli.bench.harness import SHAPES
from rtkernels.cli.bench.timing import time_call
from rtkernels.decay import KIND_FACTOR, LogDecay
from rtkernels.methods.chunk import decay_grad, launch, plan


def med(fn, reps=20):  # the bench's timer, no L2 flush
    return time_call(fn, torch.device("cuda"), reps)["ms"]


dtype = torch.float16 if "--fp16" in sys.argv else torch.bfloat16
for name in [a for a in sys.argv[1:] if not a.startswith("--")] or ["mid"]:
    b, h, n, d = SHAPES[name][0][:4]
    q, k, v, g = (torch.randn(b, h, n, d, device="cuda", dtype=dtype) for _ in range(4))
    ld = LogDecay(torch.device("cuda"), raw=1 - torch.exp(torch.linspace(-3.5, -6.2, h, device="cuda")), kind=KIND_FACTOR)
    dq = torch.empty_like(q)
    part = decay_grad.dq_pass_partials(q, v)
    plain = med(lambda: launch.kernel_forward(g, v, k, ld, 1.0, dq, None, False))
    with plan.override(bv=64, segments=1):
        bv64 = med(lambda: launch.kernel_forward(g, v, k, ld, 1.0, dq, None, False))
    fused = med(lambda: launch.kernel_forward(g, v, k, ld, 1.0, dq, None, False, dlog=(q, part, None)))
    alone = med(lambda: decay_grad.kernel_log_decay_grad(q, k, v, ld, 1.0, None, g, None))
    print(f"{name} {(b, h, n, d)} {dtype}: plain {plain:.3f} ms, plain BV 64 one segment {bv64:.3f}, "
          f"with dlog {fused:.3f}; separate dlog kernel {alone:.3f}")
