"""Scratch: where the time of one training step goes (bf16, decay a CUDA tensor, fixed or
trainable; q, k, v require grad, grads reset each step), by torch.profiler: each kernel's GPU time
per step, then per step the span from the first kernel to the last, the kernels' busy time, and
the GPU's idle gaps over 5 us with the kernels around them. ``--flush``: overwrite 256 MB before
each step (the L2 evicted, as the bench times a call).

    python bench/profiling/bwd_breakdown.py [small|mid|long] [--trainable] [--flush] [--no-tma] [--dtype fp16|fp32|tf32]

``--dtype``: the inputs' dtype (bf16 unless given); ``tf32`` is float32 with fp32_precision="tf32",
``fp32`` float32 in the "exact" mode. ``--no-tma``: the kernels' cp.async instances (``Overrides(tma_io=False)``).
"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import rtkernels
from rtkernels.cli.bench.harness import SHAPES
from rtkernels.methods.chunk import plan

name = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] in ("small", "mid", "long") else "mid"
trainable, flush = "--trainable" in sys.argv, "--flush" in sys.argv
if "--no-tma" in sys.argv:
    plan.overrides = plan.Overrides(tma_io=False)
dname = sys.argv[sys.argv.index("--dtype") + 1] if "--dtype" in sys.argv else "bf16"
dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "tf32": torch.float32}[dname]
precision = "tf32" if dname == "tf32" else "exact"
b, h, n, d = SHAPES[name][0][:4]
leaves = [torch.randn(b, h, n, d, device="cuda", dtype=dtype).requires_grad_() for _ in range(3)]
decay = (1 - torch.exp(torch.linspace(-3.5, -6.2, h, device="cuda"))).requires_grad_(trainable)
do = torch.randn(b, h, n, d, device="cuda", dtype=dtype)
# filled before each step: 256 MB (the flush) or one byte, a fill kernel that marks where a step starts
scratch = torch.empty(256 << 20 if flush else 1, dtype=torch.uint8, device="cuda")
STEPS = 10


def step():
    for x in leaves:
        x.grad = None
    decay.grad = None
    rtkernels.causal_linear_attention(*leaves, decay, method="chunk", fp32_precision=precision).backward(do)


for _ in range(5):
    step()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(STEPS):
        scratch.zero_()
        torch.cuda.synchronize()
        step()
        torch.cuda.synchronize()
print(f"{name} {(b, h, n, d)} {dname} trainable={trainable} flush={flush} tma={plan.overrides.tma_io}: per step")
kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
steps: list[list] = []
for e in kernels:
    if "fill" in e.name.lower():  # the marker: a step starts
        steps.append([])
    elif steps:
        steps[-1].append(e)
by_name: dict[str, float] = {}
for e in (e for s in steps for e in s):
    by_name[e.name] = by_name.get(e.name, 0.0) + (e.time_range.end - e.time_range.start) / STEPS
for key, t in sorted(by_name.items(), key=lambda kv: -kv[1]):
    print(f"{t / 1000:8.3f} ms  {key[:110]}")
print(f"{sum(by_name.values()) / 1000:8.3f} ms  total GPU")
for s in steps:
    span = (s[-1].time_range.end - s[0].time_range.start) / 1000
    busy = sum(e.time_range.end - e.time_range.start for e in s) / 1000
    print(f"step: span {span:.3f} ms, kernels busy {busy:.3f} ms, {len(s)} kernels")
    for a, c in zip(s, s[1:]):
        gap = (c.time_range.start - a.time_range.end) / 1000
        if gap > 0.005:
            print(f"   gap {gap * 1000:6.1f} us after {a.name[:50]} before {c.name[:50]}")
