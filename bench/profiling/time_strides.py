"""Scratch: does the memory layout's power-of-two spacing slow the chunk kernels (DRAM partition
camping)? The forward (kernel time alone, CUDA-graph replay, rounds alternating) on contiguous
[B, H, N, D] inputs against the same N as a view of a [B, H, N + pad, D] buffer, so that heads (and
segments) no longer start at power-of-two byte offsets; the training step the same way.

    python bench/profiling/time_strides.py
"""
import math
import statistics
from collections import defaultdict

import torch

import rtkernels
from rtkernels.cli.bench.timing import back_to_back_ms, graph_replay_ms

SHAPES = {"long": (1, 32, 16384, 128), "mid": (4, 32, 4096, 128), "d64": (8, 16, 2048, 64),
          "h8-128k": (1, 8, 131072, 128)}
PADS = (0, 64, 8, 1)

print(torch.cuda.get_device_name())
for name, (b, h, n, d) in SHAPES.items():
    g = (1 - torch.exp(torch.linspace(math.log(1 / 32), math.log(1 / 512), h))).cuda()
    inputs = {}
    for pad in PADS:
        bufs = [torch.randn(b, h, n + pad, d, device="cuda", dtype=torch.bfloat16) / d ** 0.25 for _ in range(3)]
        inputs[pad] = [x[:, :, :n] for x in bufs]
    ref = rtkernels.causal_linear_attention(*inputs[0], g, method="chunk").float()
    times, steps = defaultdict(list), defaultdict(list)
    for rnd in range(3):
        for pad in PADS:
            xs = inputs[pad]
            times[pad].append(graph_replay_ms(lambda: rtkernels.causal_linear_attention(*xs, g, method="chunk"),
                                              reps=20))
            if name in ("long", "mid"):
                leaves = [x.detach().requires_grad_() for x in xs]
                do = torch.ones_like(xs[0])

                def step():
                    for x in leaves:
                        x.grad = None
                    rtkernels.causal_linear_attention(*leaves, g, method="chunk").backward(do)
                steps[pad].append(back_to_back_ms(step, reps=10))
    line = "  ".join(f"pad {p}: {statistics.median(times[p]):.4f}" for p in PADS)
    print(f"{name:8s} fwd graph ms  {line}")
    if steps:
        line = "  ".join(f"pad {p}: {statistics.median(steps[p]):.4f}" for p in PADS)
        print(f"{name:8s} step ms       {line}")
