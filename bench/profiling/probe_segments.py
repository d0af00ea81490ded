"""Scratch: chunk time (back-to-back API calls, so host time hides behind the GPU) per value-tile
width and segment count, at the small, mid and long shapes.

    python bench/profiling/probe_segments.py
"""
import math

import torch

import rtkernels
from rtkernels.cli.bench.timing import back_to_back_ms
from rtkernels.methods import chunk

SHAPES = {"small": (2, 32, 1024, 128), "mid": (4, 32, 4096, 128), "long": (1, 32, 16384, 128)}
PLAN = {"small": [(64, 1), (64, 2), (128, 1), (128, 2)],
        "mid": [(64, 1), (128, 1)],
        "long": [(64, 2), (64, 4), (128, 4), (128, 8), (64, 8)]}

for label, (B, H, N, D) in SHAPES.items():
    g = 1 - torch.exp(torch.linspace(math.log(1 / 32), math.log(1 / 512), H))
    q, k = (torch.randn(B, H, N, D, device="cuda").bfloat16() / D ** 0.5 for _ in range(2))
    v = torch.randn(B, H, N, D, device="cuda").bfloat16()
    ref = rtkernels.causal_linear_attention(q.float(), k.float(), v.float(), g, method="chunk")
    row = []
    for bv, segs in PLAN[label]:
        def f():
            return rtkernels.causal_linear_attention(q, k, v, g, method="chunk")

        with chunk.override(bv=bv, segments=segs):
            err = ((f().float() - ref).norm() / ref.norm()).item()
            ms = back_to_back_ms(f, reps=20, warmup=3)
        row.append(f"bv{bv}/seg{segs}:{ms:.3f}ms({err:.1e})")
    print(label, " ".join(row), flush=True)
