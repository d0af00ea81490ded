"""Scratch: where the GPU waits in one forward + backward step as the bench times it (inputs that
require grad, grads reset, the L2 flushed before each step; bf16, decay a CUDA tensor, fixed or
trainable). torch.profiler's CUDA timeline per step: the span from the first kernel to the last,
the kernels' busy time, and the idle gaps over 5 us with the kernels around them.

    python bench/profiling/step_gaps.py [small|mid|long] [--trainable]
"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import rtkernels

SHAPES = {"small": (2, 32, 1024, 128), "mid": (4, 32, 4096, 128), "long": (1, 32, 16384, 128)}
shape = SHAPES[sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] in SHAPES else "mid"]
trainable = "--trainable" in sys.argv
b, h, n, d = shape
leaves = [torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(3)]
decay = (1 - torch.exp(torch.linspace(-3.5, -6.2, h, device="cuda"))).requires_grad_(trainable)
do = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)
flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")


def step():
    for x in leaves:
        x.grad = None
    decay.grad = None
    rtkernels.causal_linear_attention(*leaves, decay, method="chunk").backward(do)


for _ in range(5):
    step()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
    for _ in range(5):
        flush.zero_()
        torch.cuda.synchronize()
        step()
        torch.cuda.synchronize()
kern = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
steps, cur = [], []
for e in kern:
    if "fill" in e.name.lower() or "zero" in e.name.lower():  # the flush starts a step
        if cur:
            steps.append(cur)
        cur = []
        continue
    cur.append(e)
steps.append(cur)
print(f"shape {shape} trainable={trainable}")
for s in steps[1:]:
    span = (s[-1].time_range.end - s[0].time_range.start) / 1000
    busy = sum(e.time_range.end - e.time_range.start for e in s) / 1000
    print(f"step: span {span:.3f} ms, kernels busy {busy:.3f} ms, {len(s)} kernels")
    for a, c in zip(s, s[1:]):
        gap = (c.time_range.start - a.time_range.end) / 1000
        if gap > 0.005:
            print(f"   gap {gap * 1000:6.1f} us after {a.name[:50]} before {c.name[:50]}")
