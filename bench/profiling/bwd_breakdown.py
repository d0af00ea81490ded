"""Scratch: the GPU time of each kernel in one forward + backward (bf16, decay a CUDA tensor,
fixed or trainable), by torch.profiler; where the time of a training step goes.

    python bench/profiling/bwd_breakdown.py [small|mid|long] [--trainable]
"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import rtkernels

SHAPES = {"small": (2, 32, 1024, 128), "mid": (4, 32, 4096, 128), "long": (1, 32, 16384, 128)}
shape = SHAPES[sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] in SHAPES else "mid"]
trainable = "--trainable" in sys.argv
b, h, n, d = shape
q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(3))
gamma = 1 - torch.exp(torch.linspace(-3.5, -6.2, h, device="cuda"))
decay = torch.nn.Parameter(gamma) if trainable else gamma
do = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)


def step():
    o = rtkernels.causal_linear_attention(q, k, v, decay, method="chunk")
    o.backward(do)
    for x in (q, k, v):
        x.grad = None


for _ in range(5):
    step()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(10):
        step()
    torch.cuda.synchronize()
print(f"shape {shape} trainable={trainable}: per step")
rows = {}
for e in prof.key_averages():
    if e.device_type.name == "CUDA" or getattr(e, "self_device_time_total", 0) > 0:
        rows[e.key] = (getattr(e, "self_device_time_total", 0) / 10, e.count // 10)
total = sum(t for t, _ in rows.values())
for key, (t, c) in sorted(rows.items(), key=lambda kv: -kv[1][0]):
    if t > 0:
        print(f"{t / 1000:8.3f} ms  x{c:<3d} {key[:110]}")
print(f"{total / 1000:8.3f} ms  total GPU")
